# DINO-4scale R50 on deform_plugin's MSDA, with every exact step-level speedup selected (the Deformable-DETR file
# next to this one lists them; docs/whole_detector.md explains why each is exact), and its training batches padded
# to multiples of 128 px by ShapeBucketsHook (not exact: more padding, few distinct input shapes; a shape's first 4
# batches borrow a larger shape that ran before).
_base_ = '../dino/dino-4scale_r50_8xb2-12e_coco_deform-plugin.py'

custom_imports = dict(imports=['deform_plugin', 'deform_plugin.engine'], allow_failed_imports=False)
optim_wrapper = dict(type='SyncFreeOptimWrapper', constructor='MergedParamGroupsOptimWrapperConstructor')
default_hooks = dict(runtime_info=dict(type='DeferredRuntimeInfoHook'))
# Batches reach the GPU without a blocking copy: pinned by the data loader, copied asynchronously by the data
# preprocessor (the same values; a blocking copy would wait for all queued GPU work).
train_dataloader = dict(pin_memory=True)
model = dict(data_preprocessor=dict(non_blocking=True))
# Under tools/dist_train.sh: one all-reduce of a flat gradient buffer per step (the Deformable-DETR file explains).
model_wrapper_cfg = dict(type='FlatGradientsDataParallel')
custom_hooks = [dict(type='FastPathsHook', sdpa_attention=True, batched_matching=True, sync_free_losses=True,
                     batched_losses=True, sync_free_forward=True, cuda_graphs=True, relu_dropout_fusion=True,
                     ffn_recompute=True),
                dict(type='ShapeBucketsHook', size_divisor=128, borrow_until_seen=5, borrow_max_pixels=1.5)]
