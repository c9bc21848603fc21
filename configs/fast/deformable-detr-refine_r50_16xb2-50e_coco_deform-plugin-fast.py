# Deformable-DETR R50 with iterative box refinement (single-stage) on deform_plugin's MSDA, with every step-level
# speedup selected (_base_/fast_step.py lists them): exact but for ShapeBucketsHook's padding. Every switch of the
# two-stage config applies; without the encoder's proposals their matching and loss are simply absent.
_base_ = ['../deformable_detr/deformable-detr-refine_r50_16xb2-50e_coco_deform-plugin.py', './_base_/fast_step.py']

custom_imports = {{_base_.fast_custom_imports}}
optim_wrapper = {{_base_.fast_optim_wrapper}}
default_hooks = {{_base_.fast_default_hooks}}
train_dataloader = {{_base_.fast_train_dataloader}}
model = {{_base_.fast_model}}
model_wrapper_cfg = {{_base_.fast_model_wrapper_cfg}}
custom_hooks = [{{_base_.detr_fast_paths}}, {{_base_.detr_shape_buckets}}]
