# Grounding-DINO Swin-T (COCO fine-tuning) on deform_plugin's MSDA, with every step-level speedup that applies to it
# (_base_/fast_step.py lists the shared ones): exact but for ShapeBucketsHook's padding.
# Decoder self-attention, its cross-attention to the text and the encoder's text self-attention through PyTorch SDPA;
# every decoder layer's (and the encoder proposals') Hungarian matching in one pass with one copy to the host, on the
# head's own text-conditioned cost (BinaryFocalLossCost over the caption's tokens); every layer's losses, denoising
# ones included, in one batched pass against the gts' positive maps (the caption's tokens only, as stock); the visual
# forward without host syncs; FFNs without dropout (all of them here) recompute their hidden layer in the backward;
# on CUDA, the training forward and backward (BERT, its masks made on the host from the tokenizer's output; Swin; the
# fusion encoder; the decoder; the head's branches) replayed from CUDA graphs, one pair per input shape (random layers
# draw other numbers: Swin's drop path, the fusion layers' and BERT's dropout).
# Activation checkpointing is off (Swin's with_cp, the encoder's fairscale num_cp): it recomputes the backbone and
# the encoder in every backward, and it is reentrant, which the captured backward (torch.autograd.grad) cannot run.
# The same values; more activation memory than the plain config (FastPathsHook refuses cuda_graphs while it is on).
# Off, with the reason:
# - sync_free_losses (FastPathsHook refuses it for Grounding-DINO): GroundingDINOHead's own per-layer loss reads
#   masked_select's output size from the device; batched_losses computes every layer's loss without it.
# - relu_dropout_fusion: no FFN has dropout.
# Without bert-base-uncased's files, tools/benchmark_train.py and tools/benchmark_infer.py (--text-encoder auto)
# time it on a random text encoder of the same shape (deform_plugin/benchmarks/detector/random_text_encoder.py).
_base_ = ['../grounding_dino/grounding_dino_swin-t_finetune_16xb2_1x_coco_deform-plugin.py', './_base_/fast_step.py']

custom_imports = {{_base_.fast_custom_imports}}
optim_wrapper = {{_base_.fast_optim_wrapper}}
default_hooks = {{_base_.fast_default_hooks}}
train_dataloader = {{_base_.fast_train_dataloader}}
model = dict(data_preprocessor={{_base_.fast_model.data_preprocessor}}, backbone=dict(with_cp=False),
             encoder=dict(num_cp=0))
model_wrapper_cfg = {{_base_.fast_model_wrapper_cfg}}
custom_hooks = [dict(type='FastPathsHook', sdpa_attention=True, batched_matching=True, batched_losses=True,
                     sync_free_forward=True, cuda_graphs=True, ffn_recompute=True),
                {{_base_.detr_shape_buckets}}]
