# The demo detector with the exact step-level speedups of configs/fast/ (_base_/fast_step.py) that a CPU run can
# use: the pair of the plain demo config in loss-curve and mAP comparisons (run it with tools/train.py
# --amp-dtype bfloat16 for the fast bf16 step).
_base_ = ['../demo/deformable-detr-refine_r18_tiny_1xb4-500i_shapes.py', './_base_/fast_step.py']

custom_imports = {{_base_.fast_custom_imports}}
optim_wrapper = {{_base_.fast_optim_wrapper}}
default_hooks = {{_base_.fast_default_hooks}}
train_dataloader = {{_base_.fast_train_dataloader}}
model = {{_base_.fast_model}}
custom_hooks = [dict(type='FastPathsHook', sdpa_attention=True, batched_matching=True, sync_free_losses=True,
                     batched_losses=True, sync_free_forward=True)]
