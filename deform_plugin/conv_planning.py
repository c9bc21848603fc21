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
67 ms instead of 56). In float32 and float16 both APIs run cuDNN's kernels. In bfloat16 PyTorch takes cuDNN only
through the v8 API: under v7 its convolutions run on PyTorch's own kernels (im2col and col2im around a GEMM), which
the bf16 columns above measure. A run whose shapes recur keeps v8: in a Mask2Former panoptic bf16 step at its one LSJ
size (H200), v7 left 23 ms per step in those im2col and col2im kernels alone.

Batch-1 graph inference meets a new input size at every new bucket, where a call runs eagerly or captures; there the
v7 API is the better trade. Four H200s of one host, one stream per GPU, ms per image over 64 images (coco16: the 16
commonest COCO sizes cycling) or 50 (distinct: every image its own size), ours graph bf16 against stock fp32 in
the same run:

===========  ============  =========  =========  ==============  ===========  ===========
all images   stock coco16  v8 coco16  v7 coco16  stock distinct  v8 distinct  v7 distinct
===========  ============  =========  =========  ==============  ===========  ===========
DINO         86.6          42.7       35.7       130.3           107.8        74.7
Mask2Former  111.4         52.7       52.1       151.6           134.1        88.1
===========  ============  =========  =========  ==============  ===========  ===========

Replays ran about 1 ms slower under v7 (DINO bf16 12.5 against 11.5 ms, Mask2Former 24.2 against 22.6), so
``enable_fast_inference`` selects v7 unless told not to.

PyTorch reads the variable once, at the process's first cuDNN convolution: :func:`prefer_cudnn_v7_api` therefore
acts only when called before any convolution has run, and never overrides a value the user has set.
"""
from __future__ import annotations

import os
from typing import Optional

CUDNN_V8_API_DISABLED = "TORCH_CUDNN_V8_API_DISABLED"
_TRUE = ("1", "on", "yes", "true", "y")


def selects_v7_api(value: Optional[str]) -> bool:
    """Whether ``TORCH_CUDNN_V8_API_DISABLED=value`` (None: unset) selects cuDNN's v7 API, as PyTorch reads it."""
    return value is not None and value.strip().lower() in _TRUE


def v7_api_selected() -> bool:
    """Whether the environment selects cuDNN's v7 API."""
    return selects_v7_api(os.environ.get(CUDNN_V8_API_DISABLED))


def selected_api_line() -> str:
    """Which convolution API the environment selects, and who chose it, in words for a log."""
    value = os.environ.get(CUDNN_V8_API_DISABLED)
    api = "v7" if v7_api_selected() else "v8"
    return (f"cuDNN's {api} convolution API ({CUDNN_V8_API_DISABLED}={value!r}; read at the process's first "
            "convolution)" if value is not None else f"cuDNN's {api} convolution API (PyTorch's default)")


def prefer_cudnn_v7_api() -> bool:
    """Select cuDNN's v7 convolution API for this process unless ``TORCH_CUDNN_V8_API_DISABLED`` is already set;
    returns whether the v7 API is selected. See the module for when it takes effect."""
    os.environ.setdefault(CUDNN_V8_API_DISABLED, "1")
    return v7_api_selected()


def select_cudnn_api(api: str) -> Optional[str]:
    """Select cuDNN's ``api`` ('v7' or 'v8') for this process, for the tools' ``--cudnn-api``; None, or why not: a
    clash with ``TORCH_CUDNN_V8_API_DISABLED`` as the user set it (the user's value stays). Acts where no
    convolution has run yet in this process."""
    if api not in ("v7", "v8"):
        raise ValueError(f"select_cudnn_api: api must be 'v7' or 'v8', got {api!r}")
    user_value = os.environ.get(CUDNN_V8_API_DISABLED)
    if user_value is not None and v7_api_selected() != (api == "v7"):
        return (f"--cudnn-api {api}: the environment sets {CUDNN_V8_API_DISABLED}={user_value!r}, which selects "
                f"cuDNN's {'v7' if v7_api_selected() else 'v8'} API; unset it or drop --cudnn-api")
    os.environ[CUDNN_V8_API_DISABLED] = "1" if api == "v7" else "0"
    return None
