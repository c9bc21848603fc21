# Mask2Former R50 (COCO instance) on deform_plugin's MSDA, with the exact step-level speedups that apply to it:
# merged param groups on fused AdamW, losses and gradient norm logged once per interval, the decoder's masked
# cross-attention and self-attention through PyTorch SDPA, Hungarian matching with fewer host syncs, a pixel
# decoder without host syncs, and on CUDA the network's training forward and backward (backbone, pixel decoder,
# masked-attention decoder) replayed from CUDA graphs: the LSJ pipeline's fixed 1024x1024 crop is one input shape
# (see docs/whole_detector.md). Its heads are not DETR heads: batched matching and sync-free losses do not apply.
_base_ = '../mask2former/mask2former_r50_8xb2-lsj-50e_coco_deform-plugin.py'

custom_imports = dict(imports=['deform_plugin', 'deform_plugin.engine'], allow_failed_imports=False)
optim_wrapper = dict(type='SyncFreeOptimWrapper', constructor='MergedParamGroupsOptimWrapperConstructor')
default_hooks = dict(runtime_info=dict(type='DeferredRuntimeInfoHook'))
custom_hooks = [dict(type='FastPathsHook', sdpa_attention=True, hungarian_host_syncs=True, sync_free_forward=True,
                     cuda_graphs=True)]
