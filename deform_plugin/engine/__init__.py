"""Training-step speedups registered with MMEngine: importing this package registers them.

- ``MergedParamGroupsOptimWrapperConstructor`` (``optim_wrapper.constructor``): the stock per-parameter
  hyper-parameters in merged param groups, on fused/foreach optimizer kernels.
- ``FastPathsHook`` (``custom_hooks``): SDPA attention bricks and fewer host syncs in Hungarian matching.
- ``FastInferenceHook`` (``custom_hooks``): validation and testing through graph inference, inputs padded to
  buckets.
- ``ShapeBucketsHook`` (``custom_hooks``): training batches padded to a few distinct shapes (not exact: more
  padding), so that random-resize pipelines stop paying per-shape cuDNN/cuBLAS plan selection every step.
- ``FlatGradientsDataParallel`` (``model_wrapper_cfg``): data parallelism that all-reduces one flat gradient buffer
  per step, into which graphed training steps write their gradients.
- ``SyncFreeOptimWrapper`` / ``SyncFreeAmpOptimWrapper`` (``optim_wrapper.type``) and ``DeferredRuntimeInfoHook``
  (``default_hooks.runtime_info``): no per-iteration host syncs for logging, no loss scaling for bf16.
"""
from .data_parallel import FlatGradientsDataParallel, ParameterGradientSlots
from .fast_inference_hook import FastInferenceHook
from .hooks import (DeferredRuntimeInfoHook, FastPathsHook, ShapeBucketsHook, fast_path_switches_from_config,
                    training_size_divisor_from_config)
from .optim_constructor import (MergedParamGroupsOptimWrapperConstructor, choose_optimizer_kernels,
                                merge_param_groups)
from .sync_free import DEFERRED_SCALARS, SyncFreeAmpOptimWrapper, SyncFreeOptimWrapper

__all__ = [
    "DEFERRED_SCALARS",
    "DeferredRuntimeInfoHook",
    "FastInferenceHook",
    "FastPathsHook",
    "FlatGradientsDataParallel",
    "MergedParamGroupsOptimWrapperConstructor",
    "ParameterGradientSlots",
    "ShapeBucketsHook",
    "SyncFreeAmpOptimWrapper",
    "SyncFreeOptimWrapper",
    "choose_optimizer_kernels",
    "fast_path_switches_from_config",
    "merge_param_groups",
    "training_size_divisor_from_config",
]
