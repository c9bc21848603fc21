# The demo detector with every exact step-level speedup of configs/fast/ selected: the pair of the plain demo config
# in loss-curve and mAP comparisons (run it with tools/train.py --amp-dtype bfloat16 for the fast bf16 step).
_base_ = '../demo/deformable-detr-refine_r18_tiny_1xb4-500i_shapes.py'

custom_imports = dict(imports=['deform_plugin', 'deform_plugin.engine'], allow_failed_imports=False)
optim_wrapper = dict(type='SyncFreeOptimWrapper', constructor='MergedParamGroupsOptimWrapperConstructor')
default_hooks = dict(runtime_info=dict(type='DeferredRuntimeInfoHook'))
# Batches reach the GPU without a blocking copy: pinned by the data loader, copied asynchronously by the data
# preprocessor (the same values; a blocking copy would wait for all queued GPU work).
train_dataloader = dict(pin_memory=True)
model = dict(data_preprocessor=dict(non_blocking=True))
custom_hooks = [dict(type='FastPathsHook', sdpa_attention=True, batched_matching=True, sync_free_losses=True,
                     batched_losses=True, sync_free_forward=True)]
