# Mask2Former R50 (COCO instance) on deform_plugin's MSDA, with every exact step-level speedup selected: merged
# param groups on fused AdamW, the decoder's masked cross-attention and self-attention through PyTorch SDPA, and
# Hungarian matching with fewer host syncs (see docs/whole_detector.md).
_base_ = '../mask2former/mask2former_r50_8xb2-lsj-50e_coco_deform-plugin.py'

custom_imports = dict(imports=['deform_plugin', 'deform_plugin.engine'], allow_failed_imports=False)
optim_wrapper = dict(constructor='MergedParamGroupsOptimWrapperConstructor')
custom_hooks = [dict(type='FastPathsHook', sdpa_attention=True, hungarian_host_syncs=True)]
