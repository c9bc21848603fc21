"""Training-step speedups registered with MMEngine: importing this package registers them.

- ``MergedParamGroupsOptimWrapperConstructor`` (``optim_wrapper.constructor``): the stock per-parameter
  hyper-parameters in merged param groups, on fused/foreach optimizer kernels.
- ``FastPathsHook`` (``custom_hooks``, :mod:`.fast_paths_hook`): the exact fast paths of the training step
  (:class:`~deform_plugin.integration.mmdet_fast_paths.FastPaths`).
- ``FastInferenceHook`` (``custom_hooks``, :mod:`.fast_inference_hook`): validation and testing through graph
  inference, inputs padded to buckets.
- ``ShapeBucketsHook`` (``custom_hooks``, :mod:`.shape_buckets_hook`): training batches padded to a few distinct
  shapes (not exact: more padding), so that random-resize pipelines stop paying per-shape cuDNN/cuBLAS plan
  selection every step.
- ``FlatGradientsDataParallel`` (``model_wrapper_cfg``): data parallelism that all-reduces one flat gradient buffer
  per step, into which graphed training steps write their gradients.
- ``OptimizerStateByNameHook`` (``custom_hooks``, :mod:`.optimizer_state_by_name_hook`; ``tools/train.py`` adds it):
  checkpoints record the parameter name of each optimizer state and resume under any param-group layout, so runs
  move between plain and fast configs (:mod:`.optimizer_state_layout` moves the state dicts).
- ``SyncFreeOptimWrapper`` / ``SyncFreeAmpOptimWrapper`` (``optim_wrapper.type``) and ``DeferredRuntimeInfoHook``
  (``default_hooks.runtime_info``, :mod:`.deferred_runtime_info_hook`): no per-iteration host syncs for logging,
  no loss scaling for bf16.
"""
from .data_parallel import FlatGradientsDataParallel, ParameterGradientSlots
from .deferred_runtime_info_hook import DeferredRuntimeInfoHook
from .fast_inference_hook import FastInferenceHook
from .fast_paths_hook import FastPathsHook, fast_path_switches_from_config
from .optim_constructor import MergedParamGroupsOptimWrapperConstructor, choose_optimizer_kernels, merge_param_groups
from .optimizer_state_by_name_hook import OptimizerStateByNameHook
from .optimizer_state_layout import OptimizerLayoutMismatch, translate_optimizer_state, translate_scheduler_state
from .shape_buckets_hook import ShapeBucketsHook, training_size_divisor_from_config
from .sync_free import DEFERRED_SCALARS, SyncFreeAmpOptimWrapper, SyncFreeOptimWrapper

__all__ = [
    "DEFERRED_SCALARS",
    "DeferredRuntimeInfoHook",
    "FastInferenceHook",
    "FastPathsHook",
    "FlatGradientsDataParallel",
    "MergedParamGroupsOptimWrapperConstructor",
    "OptimizerLayoutMismatch",
    "OptimizerStateByNameHook",
    "ParameterGradientSlots",
    "ShapeBucketsHook",
    "SyncFreeAmpOptimWrapper",
    "SyncFreeOptimWrapper",
    "choose_optimizer_kernels",
    "fast_path_switches_from_config",
    "merge_param_groups",
    "training_size_divisor_from_config",
    "translate_optimizer_state",
    "translate_scheduler_state",
]
