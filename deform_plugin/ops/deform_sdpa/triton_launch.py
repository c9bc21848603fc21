"""Host launchers of the deformable-SDPA Triton kernels: allocate, pick block sizes (or autotune), launch.

They take inputs that :mod:`.checks` already accepted and do no host synchronisation. Each launch runs under
:func:`~deform_plugin.ops.triton_support.launch_device`.
"""
from __future__ import annotations

import math
import os
from typing import Tuple

import torch
import triton.language as tl

from ..triton_support import launch_device, next_power_of_2, triton_interpreter_enabled
from .checks import TRITON_DTYPES, triton_unsupported_reasons
from .triton_kernels import (
    deform_sdpa_backward_kernel,
    deform_sdpa_backward_kernel_autotuned,
    deform_sdpa_forward_kernel,
    deform_sdpa_forward_kernel_autotuned,
)

AUTOTUNE_ENV = "DEFORM_PLUGIN_SDPA_AUTOTUNE"
# The default launch: one warp per program in both directions (the block's score and value reductions stay inside
# the warp), over blocks of samples of FORWARD_TILE_ELEMENTS or BACKWARD_TILE_ELEMENTS elements (samples x padded
# head_dim). The fastest in a sweep of the kernels at the seed's configuration on an H200, fp32 and bf16
# (docs/deform_sdpa.md): larger forward blocks keep more gathers in flight per warp once int32 addressing has freed
# the registers; the backward, with its atomics, prefers small blocks.
FORWARD_NUM_WARPS = 1
BACKWARD_NUM_WARPS = 1
FORWARD_TILE_ELEMENTS = 512
BACKWARD_TILE_ELEMENTS = 128


def autotune_enabled() -> bool:
    """Autotuning is opt-in (``DEFORM_PLUGIN_SDPA_AUTOTUNE=1``): it compiles ~9 configs per new (V*S, head_dim,
    dtype), tens of seconds, which tests and short jobs should not pay. Never under the interpreter."""
    return os.environ.get(AUTOTUNE_ENV, "0") not in ("", "0") and not triton_interpreter_enabled()


def heuristic_block_t(num_keys: int, block_d: int, tile_elements: int) -> int:
    """Samples per block: ``tile_elements / block_d``, at least 2 and at most the key count rounded up to a power
    of two."""
    return max(2, min(tile_elements // block_d, next_power_of_2(num_keys)))


# int32 offsets while every tensor of a launch has at most this many elements: offsets stay within a few rows of a
# tensor's extent, far below 2**31.
_INT32_INDEX_MAX_NUMEL = 2 ** 30


def _index_dtype(q: torch.Tensor, coords: torch.Tensor):
    return tl.int32 if max(q.numel(), coords.numel()) <= _INT32_INDEX_MAX_NUMEL else tl.int64


def _check_supported(q: torch.Tensor, coords: torch.Tensor) -> None:
    reasons = triton_unsupported_reasons(q, coords)
    if reasons:
        error = TypeError if q.dtype not in TRITON_DTYPES else ValueError
        raise error("backend='triton' cannot run these inputs: " + "; ".join(reasons))


def _sizes(q: torch.Tensor, coords: torch.Tensor, width: int, height: int) -> dict:
    _, num_views, num_heads, num_pixels, head_dim = q.shape
    num_samples = coords.shape[4]
    return dict(num_views=num_views, num_heads=num_heads, num_pixels=num_pixels, num_samples=num_samples,
                NUM_KEYS=num_views * num_samples, width=width, height=height, head_dim=head_dim,
                INDEX_DTYPE=_index_dtype(q, coords))


def _launch(plain_kernel, autotuned_kernel, grid, num_warps, tile_elements, *args, **sizes):
    # Block shapes must be powers of two; masks cover the padding (head_dim 24 -> 32, 80 -> 128). EVEN_D: no
    # channel padding, so the loads are masked by row alone.
    block_d = max(16, next_power_of_2(sizes["head_dim"]))
    even_d = block_d == sizes["head_dim"]
    if autotune_enabled():
        autotuned_kernel[grid](*args, **sizes, BLOCK_D=block_d, EVEN_D=even_d)
    else:
        block_t = heuristic_block_t(sizes["NUM_KEYS"], block_d, tile_elements)
        plain_kernel[grid](*args, **sizes, BLOCK_D=block_d, EVEN_D=even_d, BLOCK_T=block_t, num_warps=num_warps)


def deform_sdpa_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, coords: torch.Tensor, width: int,
                        height: int, sm_scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Fused forward. Returns ``out (B, V, H, N, D)`` in q's dtype and ``lse (B, V, H, N)`` float32 (base 2)."""
    _check_supported(q, coords)
    q, k, v, coords = (t.contiguous() for t in (q, k, v, coords))
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:4], dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    sizes = _sizes(q, coords, width, height)
    grid = (q.shape[0] * sizes["num_views"] * sizes["num_pixels"] * sizes["num_heads"],)
    with launch_device(q):
        _launch(deform_sdpa_forward_kernel, deform_sdpa_forward_kernel_autotuned, grid, FORWARD_NUM_WARPS,
                FORWARD_TILE_ELEMENTS, q, k, v, coords, out, lse, sm_scale * math.log2(math.e),
                **sizes)
    return out, lse


def deform_sdpa_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         coords: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, width: int, height: int,
                         sm_scale: float, coords_grad: bool
                         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused backward. Returns ``dq, dk, dv`` like q, and ``dcoords`` like coords (empty when not ``coords_grad``)."""
    _check_supported(q, coords)
    grad_out, q, k, v, coords, out, lse = (t.contiguous() for t in (grad_out, q, k, v, coords, out, lse))
    dq = torch.empty_like(q)
    # Atomic accumulation happens in float32 whatever the storage dtype; cast once at the end.
    dk = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dcoords = torch.zeros(coords.shape if coords_grad else (0,), dtype=torch.float32, device=q.device)
    if q.numel() > 0:
        sizes = _sizes(q, coords, width, height)
        grid = (q.shape[0] * sizes["num_views"] * sizes["num_pixels"] * sizes["num_heads"],)
        with launch_device(q):
            _launch(deform_sdpa_backward_kernel, deform_sdpa_backward_kernel_autotuned, grid, BACKWARD_NUM_WARPS,
                    BACKWARD_TILE_ELEMENTS, q, k, v, coords, out, grad_out, lse, dq, dk, dv, dcoords, sm_scale,
                    sm_scale * math.log2(math.e), **sizes, COORDS_GRAD=coords_grad)
    else:
        dq.zero_()
    return dq, dk.to(q.dtype), dv.to(q.dtype), dcoords.to(coords.dtype)
