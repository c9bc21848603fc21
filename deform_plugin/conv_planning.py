"""Cheaper cuDNN convolution planning for inputs whose shape keeps changing.

PyTorch chooses a cuDNN algorithm once per convolution and input shape, and caches the choice. With cuDNN's v8
(frontend) API, PyTorch's default, the choice asks the engine heuristics for every candidate configuration and
builds execution plans: about a millisecond of host time per convolution (PyTorch's own measurements put it at
1.27 ms on average, pytorch/pytorch#187212). A detector trained without shape buckets, or run on photos of many
sizes, meets a new input shape at most steps, and its ResNet's convolutions (about 50 in a forward, 150 in a
training step) then spend most of the step choosing. PyTorch keeps the older v7 API, whose heuristic query is
cheaper; ``TORCH_CUDNN_V8_API_DISABLED=1`` selects it. Both APIs run cuDNN's own convolution kernels: results
agree to the rounding of the algorithm chosen, as they do between cuDNN versions. docs/results.md gives the
measured effect.

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
