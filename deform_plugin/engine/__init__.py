"""Training-step speedups registered with MMEngine: importing this package registers them.

- ``MergedParamGroupsOptimWrapperConstructor`` (``optim_wrapper.constructor``): the stock per-parameter
  hyper-parameters in merged param groups, on fused/foreach optimizer kernels.
- ``FastPathsHook`` (``custom_hooks``): SDPA attention bricks and fewer host syncs in Hungarian matching.
"""
from .hooks import FastPathsHook, fast_path_switches_from_config
from .optim_constructor import (MergedParamGroupsOptimWrapperConstructor, choose_optimizer_kernels,
                                merge_param_groups)

__all__ = [
    "FastPathsHook",
    "MergedParamGroupsOptimWrapperConstructor",
    "choose_optimizer_kernels",
    "fast_path_switches_from_config",
    "merge_param_groups",
]
