# Grounding-DINO Swin-T (COCO fine-tuning) on deform_plugin's MSDA, with the exact step-level speedups that apply to
# it (_base_/fast_step.py lists the shared ones): exact, stock padding kept.
# Decoder self-attention, its cross-attention to the text and the encoder's text self-attention through PyTorch SDPA;
# every decoder layer's (and the encoder proposals') Hungarian matching in one pass with one copy to the host, on the
# head's own text-conditioned cost (BinaryFocalLossCost over the caption's tokens); every layer's losses, denoising
# ones included, in one batched pass against the gts' positive maps (the caption's tokens only, as stock); the visual
# forward without host syncs; FFNs without dropout (all of them here) recompute their hidden layer in the backward
# (relu_dropout_fusion would find no dropout to fuse).
# Off, with the reason (FastPathsHook refuses both for Grounding-DINO, see
# deform_plugin/integration/mmdet_fast_paths/grounding_dino_losses.py):
# - sync_free_losses: GroundingDINOHead's per-layer loss selects the caption's tokens with masked_select (a host
#   read); batched_losses computes every layer's loss without it, so nothing is lost.
# - cuda_graphs: the forward starts with BERT, whose sub-sentence masks mmdet builds with a nonzero and a Python
#   loop over it on the device (reads a capture cannot make), and the config's activation checkpointing (Swin's
#   with_cp, the encoder's fairscale num_cp) is reentrant, which the captured backward (torch.autograd.grad) refuses.
#   With model_wrapper_cfg's FlatGradientsDataParallel the step is then eager: the wrapper all-reduces the
#   autograd gradients once per step, as it does for an eager step of the other detectors.
# - ShapeBucketsHook (the other fast configs' one inexact change): its padding pays for itself by letting captured
#   graphs and cuDNN plans recur; without graphs it would add pixels for little, so batches keep stock's padding
#   (FastPathsHook then selects cuDNN's v7 API, cheaper for the new shapes a random-resize pipeline brings).
# Without bert-base-uncased's files, tools/benchmark_train.py and tools/benchmark_infer.py (--text-encoder auto)
# time it on a random text encoder of the same shape (deform_plugin/benchmarks/detector/random_text_encoder.py).
_base_ = ['../grounding_dino/grounding_dino_swin-t_finetune_16xb2_1x_coco_deform-plugin.py', './_base_/fast_step.py']

custom_imports = {{_base_.fast_custom_imports}}
optim_wrapper = {{_base_.fast_optim_wrapper}}
default_hooks = {{_base_.fast_default_hooks}}
train_dataloader = {{_base_.fast_train_dataloader}}
model = {{_base_.fast_model}}
model_wrapper_cfg = {{_base_.fast_model_wrapper_cfg}}
custom_hooks = [dict(type='FastPathsHook', sdpa_attention=True, batched_matching=True, batched_losses=True,
                     sync_free_forward=True, ffn_recompute=True)]
