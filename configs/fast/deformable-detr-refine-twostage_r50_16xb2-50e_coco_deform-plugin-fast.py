# Deformable-DETR refine two-stage R50 on deform_plugin's MSDA, with every exact step-level speedup selected:
#   - MergedParamGroupsOptimWrapperConstructor: the stock per-parameter lr/weight decay in a few merged param
#     groups, on the fused (CUDA) or foreach AdamW kernels;
#   - FastPathsHook: decoder self-attention through PyTorch SDPA, Hungarian matching with fewer host syncs.
# Losses and gradients match the plain config to float rounding (docs/whole_detector.md explains why).
# Optimizer state dicts differ in layout from stock runs: resume a run with the constructor it was started with.
_base_ = '../deformable_detr/deformable-detr-refine-twostage_r50_16xb2-50e_coco_deform-plugin.py'

custom_imports = dict(imports=['deform_plugin', 'deform_plugin.engine'], allow_failed_imports=False)
optim_wrapper = dict(constructor='MergedParamGroupsOptimWrapperConstructor')
custom_hooks = [dict(type='FastPathsHook', sdpa_attention=True, hungarian_host_syncs=True)]
