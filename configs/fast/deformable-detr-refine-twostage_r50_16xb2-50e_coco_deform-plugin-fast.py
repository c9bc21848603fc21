# Deformable-DETR refine two-stage R50 on deform_plugin's MSDA, with every step-level speedup selected:
#   - MergedParamGroupsOptimWrapperConstructor: the stock per-parameter lr/weight decay in a few merged param
#     groups, on the fused (CUDA) or foreach AdamW kernels;
#   - SyncFreeOptimWrapper + DeferredRuntimeInfoHook: losses and the gradient norm reach the logger once per logging
#     interval, in one device-to-host copy (with --amp-dtype bfloat16, tools/train.py also drops the loss scaler);
#   - FastPathsHook: decoder self-attention through PyTorch SDPA; every decoder layer's Hungarian matching in one
#     pass with one copy to the host; every decoder layer's losses (and the encoder's) in one batched pass; the
#     loss normalisers and the forward without host syncs; on CUDA, the network's training forward and backward
#     replayed from CUDA graphs, one pair per input shape (cuda_graphs; dropout draws other random numbers); less
#     activation memory in the FFNs: ReLU and dropout keep one tensor for the backward instead of three
#     (relu_dropout_fusion), FFNs without dropout recompute their hidden layer in the backward (ffn_recompute).
#   - ShapeBucketsHook (the one change that is not exact): training batches padded to multiples of 128 px, so
#     that the random-resize pipeline yields a few dozen input shapes instead of a new one per batch, each
#     of which costs cuDNN/cuBLAS plan selection and a graph capture (docs/whole_detector.md measures both
#     sides); a shape's first 4 batches borrow a larger shape that ran before (at most 1.5x its pixels) instead
#     of paying that cost for a shape that may be rare.
# Apart from that padding, losses and gradients match the plain config to float rounding (docs/whole_detector.md
# explains why).
# The merged param groups lay out the optimizer state differently from stock runs; tools/train.py --resume still takes
# a checkpoint of the plain config (or of stock mmdet) here and the other way round, carrying the optimizer and LR
# scheduler state over by parameter name (OptimizerStateByNameHook, docs/whole_detector.md).
_base_ = '../deformable_detr/deformable-detr-refine-twostage_r50_16xb2-50e_coco_deform-plugin.py'

custom_imports = dict(imports=['deform_plugin', 'deform_plugin.engine'], allow_failed_imports=False)
optim_wrapper = dict(type='SyncFreeOptimWrapper', constructor='MergedParamGroupsOptimWrapperConstructor')
default_hooks = dict(runtime_info=dict(type='DeferredRuntimeInfoHook'))
# Batches reach the GPU without a blocking copy: pinned by the data loader, copied asynchronously by the data
# preprocessor (the same values; a blocking copy would wait for all queued GPU work).
train_dataloader = dict(pin_memory=True)
model = dict(data_preprocessor=dict(non_blocking=True))
# Under tools/dist_train.sh: the graphed step writes every gradient into one flat buffer, which the wrapper
# all-reduces once per step (DistributedDataParallel's reducer would hook, scale and copy each of ~350 gradients on
# the host every step); the same averaged gradients. See deform_plugin/engine/data_parallel.py.
model_wrapper_cfg = dict(type='FlatGradientsDataParallel')
custom_hooks = [dict(type='FastPathsHook', sdpa_attention=True, batched_matching=True, sync_free_losses=True,
                     batched_losses=True, sync_free_forward=True, cuda_graphs=True, relu_dropout_fusion=True,
                     ffn_recompute=True),
                dict(type='ShapeBucketsHook', size_divisor=128, borrow_until_seen=5, borrow_max_pixels=1.5)]
