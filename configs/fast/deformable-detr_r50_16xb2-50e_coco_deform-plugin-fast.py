# Deformable-DETR R50 (single-stage, without box refinement) on deform_plugin's MSDA, with every step-level speedup
# selected (_base_/fast_step.py lists them): exact but for ShapeBucketsHook's padding. Every switch of the
# two-stage config applies: its pieces for the encoder's proposals simply have none to handle here, and the class
# and box branches that every decoder layer shares are captured once (docs/whole_detector.md).
_base_ = ['../deformable_detr/deformable-detr_r50_16xb2-50e_coco_deform-plugin.py', './_base_/fast_step.py']

custom_imports = {{_base_.fast_custom_imports}}
optim_wrapper = {{_base_.fast_optim_wrapper}}
default_hooks = {{_base_.fast_default_hooks}}
train_dataloader = {{_base_.fast_train_dataloader}}
model = {{_base_.fast_model}}
model_wrapper_cfg = {{_base_.fast_model_wrapper_cfg}}
custom_hooks = [{{_base_.detr_fast_paths}}, {{_base_.detr_shape_buckets}}]
