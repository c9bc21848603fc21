"""Cheaper cuDNN convolution planning for inputs whose shape keeps changing.

PyTorch chooses a cuDNN algorithm once per convolution and input shape, and caches the choice. With cuDNN's v8
(frontend) API, PyTorch's default, the choice queries the engine heuristics and builds execution plans, which
costs host time at every new shape; PyTorch keeps the older v7 API, whose query is cheaper but whose choices run
slower. ``TORCH_CUDNN_V8_API_DISABLED=1`` selects it. Measured on an H200 (torch 2.11, cuDNN 9.19), mmdet's R50 with
its ChannelMapper neck, forward and backward at batch 2, ms per step:

=========  ================  =================  ================  =================
API        fp32, new shape   fp32, seen shape   bf16, new shape   bf16, seen shape
=========  ================  =================  ================  =================
v8         120               16                 197               20
v7         50                32                 55                24
=========  ================  =================  ================  =================

So the v7 API wins where nearly every step meets a new shape (training without shape buckets: a Deformable-DETR
bf16 step at a new shape took 199 ms instead of 295), and loses where shapes recur (the same run's graph replays:
67 ms instead of 56). Both APIs run cuDNN's own kernels; results agree to the rounding of the algorithm chosen.

PyTorch reads the variable once, at the process's first cuDNN convolution: :func:`prefer_cudnn_v7_api` therefore
acts only when called before any convolution has run, and never overrides a value the user has set.
"""
from __future__ import annotations

import os

CUDNN_V8_API_DISABLED = "TORCH_CUDNN_V8_API_DISABLED"
_TRUE = ("1", "on", "yes", "true", "y")


def prefer_cudnn_v7_api() -> bool:
    """Select cuDNN's v7 convolution API for this process unless ``TORCH_CUDNN_V8_API_DISABLED`` is already set;
    returns whether the v7 API is selected. See the module for when it takes effect."""
    value = os.environ.setdefault(CUDNN_V8_API_DISABLED, "1")
    return value.strip().lower() in _TRUE
