# The step-level switches the fast configs share. Each fast config inherits this file beside its family config and
# assigns these values to mmengine's keys with {{_base_.NAME}}: mmengine refuses two bases that define the same
# key, and the family configs define every key set here, so the values live under names of their own.

fast_custom_imports = dict(imports=['deform_plugin', 'deform_plugin.engine'], allow_failed_imports=False)
# Merged param groups (the stock per-parameter lr and weight decay, in a few groups) on the fused or foreach AdamW
# kernels; losses and the gradient norm reach the logger once per logging interval, in one device-to-host copy
# (with --amp-dtype bfloat16, tools/train.py also drops the loss scaler).
# The merged groups lay out the optimizer state differently from stock runs; tools/train.py --resume still takes a
# checkpoint of the plain config (or of stock mmdet) under a fast config and the other way round, carrying optimizer
# and LR-scheduler state over by parameter name (OptimizerStateByNameHook, docs/whole_detector.md).
fast_optim_wrapper = dict(type='SyncFreeOptimWrapper', constructor='MergedParamGroupsOptimWrapperConstructor')
fast_default_hooks = dict(runtime_info=dict(type='DeferredRuntimeInfoHook'))
# Batches reach the GPU without a blocking copy: pinned by the data loader (images and, through deform_plugin, the
# data samples' targets), copied asynchronously by the data preprocessor (the same values; a copy from pageable
# memory would wait for all queued GPU work).
fast_train_dataloader = dict(pin_memory=True)
fast_model = dict(data_preprocessor=dict(non_blocking=True))
# Under tools/dist_train.sh: the graphed step writes every gradient into one flat buffer, which the wrapper
# all-reduces once per step (DistributedDataParallel's reducer would hook, scale and copy each of ~350 gradients on
# the host every step); the same averaged gradients. See deform_plugin/engine/data_parallel.py.
fast_model_wrapper_cfg = dict(type='FlatGradientsDataParallel')

# The DETR family (Deformable-DETR, DINO): every exact fast path of FastPathsHook. Decoder self-attention through
# PyTorch SDPA; every decoder layer's Hungarian matching in one pass with one copy to the host; every decoder
# layer's losses (and the encoder's) in one batched pass; the loss normalisers and the forward without host syncs;
# on CUDA, the network's training forward and backward replayed from CUDA graphs, one pair per input shape
# (dropout draws other random numbers); less activation memory in the FFNs: ReLU and dropout keep one tensor for
# the backward instead of three (relu_dropout_fusion), FFNs without dropout recompute their hidden layer in the
# backward (ffn_recompute).
detr_fast_paths = dict(type='FastPathsHook', sdpa_attention=True, batched_matching=True, sync_free_losses=True,
                       batched_losses=True, sync_free_forward=True, cuda_graphs=True, relu_dropout_fusion=True,
                       ffn_recompute=True)
# DDQ-DETR's fast config selects the subset that fits it and says why the others are off.
# The one change that is not exact: training batches padded to multiples of 128 px, so that the random-resize
# pipeline yields a few dozen input shapes instead of a new one per batch, each of which costs cuDNN/cuBLAS plan
# selection and a graph capture (docs/whole_detector.md measures both sides); a shape's first 4 batches borrow a
# larger shape that ran before (at most 1.5x its pixels) instead of paying that cost for a shape that may be rare.
# It moved bbox mAP on the AP-parity task (docs/results.md: up for Deformable-DETR, down by up to 0.1 for DINO fp32).
# Remove it for stock padding (tools/train.py --no-shape-buckets): FastPathsHook then pads Deformable-DETR's and
# DINO's feature maps (not the images) to 128 px feature buckets before the transformer's graphs, which is exact
# (feature_bucket_size), runs the backbone at each batch's own shape (captured once that shape recurs) and selects
# cuDNN's v7 API.
detr_shape_buckets = dict(type='ShapeBucketsHook', size_divisor=128, borrow_until_seen=5, borrow_max_pixels=1.5)
