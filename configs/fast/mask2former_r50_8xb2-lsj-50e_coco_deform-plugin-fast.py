# Mask2Former R50 (COCO instance) on deform_plugin's MSDA, with the exact step-level speedups that apply to it
# (_base_/fast_step.py lists the shared ones): the decoder's masked cross-attention and self-attention through
# PyTorch SDPA, every decoder layer's Hungarian matching in one pass with sync-free losses (Mask2Former's own: the
# DETR heads' sync_free_losses and batched_losses do not apply), a pixel decoder without host syncs, and on CUDA the
# network's training forward and backward (backbone, pixel decoder, masked-attention decoder) replayed from CUDA
# graphs: the LSJ pipeline's fixed 1024x1024 crop is one input shape (see docs/whole_detector.md).
_base_ = ['../mask2former/mask2former_r50_8xb2-lsj-50e_coco_deform-plugin.py', './_base_/fast_step.py']

custom_imports = {{_base_.fast_custom_imports}}
optim_wrapper = {{_base_.fast_optim_wrapper}}
default_hooks = {{_base_.fast_default_hooks}}
train_dataloader = {{_base_.fast_train_dataloader}}
model = {{_base_.fast_model}}
model_wrapper_cfg = {{_base_.fast_model_wrapper_cfg}}
custom_hooks = [dict(type='FastPathsHook', sdpa_attention=True, batched_matching=True, sync_free_forward=True,
                     cuda_graphs=True)]
