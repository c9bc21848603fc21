# Mask2Former R50 (COCO panoptic: 80 thing and 53 stuff classes) on deform_plugin's MSDA, with the exact step-level
# speedups of the instance config (configs/fast/mask2former_r50_8xb2-lsj-50e_coco_deform-plugin-fast.py says what
# each does). Panoptic training adds the stuff classes of each semantic map to the targets: with batched_matching the
# head finds them on the device and copies them to the host ahead of the graphed forward, instead of mmdet's
# torch.unique and a host read per class, and the thing masks reach the device without a blocking copy
# (docs/whole_detector.md). The LSJ pipeline's fixed 1024x1024 crop is one input shape: no shape buckets.
_base_ = ['../mask2former/mask2former_r50_8xb2-lsj-50e_coco-panoptic_deform-plugin.py', './_base_/fast_step.py']

custom_imports = {{_base_.fast_custom_imports}}
optim_wrapper = {{_base_.fast_optim_wrapper}}
default_hooks = {{_base_.fast_default_hooks}}
train_dataloader = {{_base_.fast_train_dataloader}}
model = {{_base_.fast_model}}
model_wrapper_cfg = {{_base_.fast_model_wrapper_cfg}}
custom_hooks = [dict(type='FastPathsHook', sdpa_attention=True, batched_matching=True, sync_free_forward=True,
                     cuda_graphs=True)]
