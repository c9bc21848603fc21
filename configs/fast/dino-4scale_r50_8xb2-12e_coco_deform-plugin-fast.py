# DINO-4scale R50 on deform_plugin's MSDA, with every exact step-level speedup selected (see the Deformable-DETR
# file next to this one and docs/whole_detector.md).
_base_ = '../dino/dino-4scale_r50_8xb2-12e_coco_deform-plugin.py'

custom_imports = dict(imports=['deform_plugin', 'deform_plugin.engine'], allow_failed_imports=False)
optim_wrapper = dict(constructor='MergedParamGroupsOptimWrapperConstructor')
custom_hooks = [dict(type='FastPathsHook', sdpa_attention=True, hungarian_host_syncs=True)]
