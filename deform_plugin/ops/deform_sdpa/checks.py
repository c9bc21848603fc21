"""Input validation shared by every deformable-SDPA backend.

Every backend calls :func:`check_deform_sdpa_inputs` first, so a bad call fails the same way whichever kernel would
have run it, with a message that names the offending values.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TRITON_MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class DeformSDPAShape:
    """Sizes of one call: batch, views, heads, pixels per view (N = width*height), head_dim, samples per view."""

    batch: int
    num_views: int
    num_heads: int
    num_pixels: int
    head_dim: int
    num_samples: int
    width: int
    height: int

    @property
    def is_empty(self) -> bool:
        return self.batch == 0 or self.num_views == 0 or self.num_heads == 0 or self.num_pixels == 0


def check_deform_sdpa_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, coords: torch.Tensor,
                             width: int, height: int) -> DeformSDPAShape:
    """Validate the inputs of :func:`deform_plugin.ops.deform_sdpa` and return their sizes.

    Raises:
        TypeError: a tensor argument is not a tensor, has an unsupported dtype, or q, k, v differ in dtype;
            width or height is not an integer (Python, numpy or 0-d integer tensor).
        ValueError: shapes that do not agree with each other or with ``width * height``, or tensors on
            different devices; the message names the values.
    """
    named = dict(q=q, k=k, v=v, coords=coords)
    for name, tensor in named.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    width = _integral_size("width", width)
    height = _integral_size("height", height)
    for name, tensor in named.items():
        if tensor.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be a floating tensor (float16, bfloat16, float32 or float64), "
                            f"got {tensor.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    for name in ("q", "k", "v"):
        if named[name].dim() != 5:
            raise ValueError(f"{name} must be (batch, num_views, num_heads, num_pixels, head_dim), "
                             f"got shape {tuple(named[name].shape)}")
    if coords.dim() != 6:
        raise ValueError("coords must be (batch, num_views, num_pixels, num_views, num_samples, 2), "
                         f"got shape {tuple(coords.shape)}")
    if k.shape != q.shape:
        raise ValueError(f"k has shape {tuple(k.shape)} but q has {tuple(q.shape)}")
    if v.shape != q.shape:
        raise ValueError(f"v has shape {tuple(v.shape)} but q has {tuple(q.shape)}")
    batch, num_views, num_heads, num_pixels, head_dim = q.shape
    if num_pixels != width * height:
        raise ValueError(f"q has {num_pixels} pixels per view but width * height = {width} * {height} "
                         f"= {width * height}")
    if head_dim == 0:
        raise ValueError(f"head_dim must be >= 1, got q shape {tuple(q.shape)}")
    c_batch, c_views, c_pixels, c_sampled_views, num_samples, last = coords.shape
    if last != 2:
        raise ValueError(f"coords must end in 2 coordinates (x, y), got last dim {last}")
    expected = (batch, num_views, num_pixels, num_views)
    if (c_batch, c_views, c_pixels, c_sampled_views) != expected:
        raise ValueError(f"coords has shape {tuple(coords.shape)} but q implies (batch, num_views, num_pixels, "
                         f"num_views) = {expected} before (num_samples, 2)")
    if num_samples == 0:
        raise ValueError(f"need at least one sample per view: the softmax over num_views*num_samples "
                         f"keys is undefined for none, got coords shape {tuple(coords.shape)}")
    devices = {t.device for t in (q, k, v, coords)}
    if len(devices) > 1:
        raise ValueError(f"q, k, v and coords must be on one device, got q {q.device}, k {k.device}, "
                         f"v {v.device}, coords {coords.device}")
    return DeformSDPAShape(batch, num_views, num_heads, num_pixels, head_dim, num_samples, width, height)


def _integral_size(name: str, size) -> int:
    """An image size as a Python int: any integer type is accepted (int, numpy integer, 0-d integer tensor)."""
    if isinstance(size, torch.Tensor):
        if size.dim() != 0 or size.dtype.is_floating_point or size.dtype.is_complex or size.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer, got a {size.dtype} tensor of shape {tuple(size.shape)}")
        size = size.item()
    # bool is an int subclass but never a meaningful image size.
    elif isinstance(size, bool) or not isinstance(size, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(size).__name__} ({size!r})")
    size = int(size)
    if size < 0:
        raise ValueError(f"{name} must be >= 0, got {size}")
    return size


def check_sm_scale(sm_scale, head_dim: int) -> float:
    """The score scale as a finite float: ``1 / sqrt(head_dim)`` for None."""
    if sm_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real):
        raise TypeError(f"sm_scale must be a real number or None, got {type(sm_scale).__name__}")
    if not math.isfinite(sm_scale):
        raise ValueError(f"sm_scale must be finite, got {sm_scale}")
    return float(sm_scale)


def triton_unsupported_reasons(q: torch.Tensor, coords: torch.Tensor) -> list:
    """Every reason the Triton kernels cannot run these (already validated) inputs; empty when they can."""
    reasons = []
    if q.dtype not in TRITON_DTYPES:
        reasons.append(f"q, k, v are {q.dtype} but the Triton kernels take float16, bfloat16 or float32 "
                       "(use backend='pytorch' for float64)")
    if q.shape[-1] > TRITON_MAX_HEAD_DIM:
        reasons.append(f"head_dim {q.shape[-1]} exceeds {TRITON_MAX_HEAD_DIM}, the largest the kernels tile")
    return reasons
