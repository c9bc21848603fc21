# Mask2Former R50 (COCO instance) on deform_plugin's MSDA, with the exact step-level speedups that apply to it:
# merged param groups on fused AdamW, losses and gradient norm logged once per interval, the decoder's masked
# cross-attention and self-attention through PyTorch SDPA, every decoder layer's Hungarian matching in one pass
# with sync-free losses (Mask2Former's own: the DETR heads' sync_free_losses and batched_losses do not apply), a
# pixel decoder without host syncs, and on CUDA the network's training forward and backward (backbone, pixel
# decoder, masked-attention decoder) replayed from CUDA graphs: the LSJ pipeline's fixed 1024x1024 crop is one input
# shape (see docs/whole_detector.md).
_base_ = '../mask2former/mask2former_r50_8xb2-lsj-50e_coco_deform-plugin.py'

custom_imports = dict(imports=['deform_plugin', 'deform_plugin.engine'], allow_failed_imports=False)
optim_wrapper = dict(type='SyncFreeOptimWrapper', constructor='MergedParamGroupsOptimWrapperConstructor')
default_hooks = dict(runtime_info=dict(type='DeferredRuntimeInfoHook'))
# Batches reach the GPU without a blocking copy: pinned by the data loader, copied asynchronously by the data
# preprocessor (the same values; a blocking copy would wait for all queued GPU work).
train_dataloader = dict(pin_memory=True)
model = dict(data_preprocessor=dict(non_blocking=True))
# Under tools/dist_train.sh: one all-reduce of a flat gradient buffer per step (the Deformable-DETR file explains).
model_wrapper_cfg = dict(type='FlatGradientsDataParallel')
custom_hooks = [dict(type='FastPathsHook', sdpa_attention=True, batched_matching=True, sync_free_forward=True,
                     cuda_graphs=True)]
