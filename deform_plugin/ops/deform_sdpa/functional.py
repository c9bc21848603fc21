"""Public entry point of the deformable-SDPA op: validate, pick a backend, run it."""
from __future__ import annotations

import warnings
from typing import Optional

import torch

from ..backend import get_default_backend, resolve_backend
from .checks import check_deform_sdpa_inputs, check_sm_scale, triton_unsupported_reasons
from .reference import deform_sdpa_reference

OP_NAME = "deform_sdpa"


def deform_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, coords: torch.Tensor, width: int, height: int,
                sm_scale: Optional[float] = None, backend: Optional[str] = None) -> torch.Tensor:
    """Multi-view deformable scaled dot-product attention, with sampling fused into the softmax on Triton.

    For query pixel ``n`` of view ``v`` (every batch element and head), keys and values are sampled bilinearly at
    ``S`` points in each of the ``V`` views; the query attends over those ``V*S`` samples with
    ``softmax(q . k_sampled * sm_scale)``. Differentiable in q, k, v and coords.

    Args:
        q: ``(B, V, H, N, D)`` queries, ``N = width * height`` pixels per view, row-major.
        k: ``(B, V, H, N, D)`` keys, sampled from each view's ``height x width`` map.
        v: ``(B, V, H, N, D)`` values, sampled like the keys.
        coords: ``(B, V, N, V, S, 2)``: for query pixel n of view v, the normalized (x, y) of S points in each of
            the V views; pixel = x * width - 0.5 (our MSDA convention, grid_sample's align_corners=False).
            Points outside a view sample zero keys and values (zero padding), as do NaN or infinite points, and
            still take part in the softmax with score 0.
        width: width of every view's map: an integer of any integer type (Python, numpy, 0-d integer tensor).
        height: height of every view's map, likewise.
        sm_scale: finite score scale; default ``1 / sqrt(D)``.
        backend: ``'auto'``, ``'triton'``, ``'pytorch'`` or None for the process default (see
            :mod:`deform_plugin.ops.backend`). ``'auto'`` runs Triton on CUDA (the PyTorch reference for float64,
            and, with a warning, for head_dim > 256) and the reference elsewhere. A process default that this op
            does not offer (MSDA's ``'mmcv'``) counts as ``'auto'``.

    Returns:
        ``(B, V, H, N, D)`` in the dtype of q.

    Raises:
        TypeError: non-tensor inputs, non-integral width/height, a non-real sm_scale, non-floating dtypes,
            q/k/v dtypes that differ, or dtypes the chosen backend cannot run (Triton: float16, bfloat16, float32).
        ValueError: inconsistent shapes, mixed devices, a non-finite sm_scale, a backend this op does not have,
            head_dim > 256 on ``backend='triton'``.

    Example:
        >>> B, V, S, H, D, W, Hh = 2, 3, 4, 2, 16, 5, 4
        >>> q, k, v = (torch.randn(B, V, H, W * Hh, D) for _ in range(3))
        >>> coords = torch.rand(B, V, W * Hh, V, S, 2)
        >>> deform_sdpa(q, k, v, coords, W, Hh).shape
        torch.Size([2, 3, 2, 20, 16])
    """
    shape = check_deform_sdpa_inputs(q, k, v, coords, width, height)
    width, height = shape.width, shape.height
    sm_scale = check_sm_scale(sm_scale, shape.head_dim)
    # 'auto', and a default this op does not offer, leave the choice to us: fall back instead of failing.
    automatic = (backend if backend is not None else get_default_backend()) not in ("triton", "pytorch")
    name = resolve_backend(OP_NAME, backend, q.device)
    if name == "triton" and automatic:
        reasons = triton_unsupported_reasons(q, coords)
        if reasons:
            # float64 asks for the float64 reference on purpose; anything else is worth one warning.
            if q.dtype != torch.float64:
                warnings.warn("deform_sdpa runs the PyTorch reference instead of Triton: " + "; ".join(reasons))
            name = "pytorch"

    if shape.is_empty:
        return _empty_result(q, k, v, coords)
    if name == "triton":
        from .triton_op import deform_sdpa_triton
        return deform_sdpa_triton(q, k, v, coords, width, height, sm_scale)
    return deform_sdpa_reference(q, k, v, coords, width, height, sm_scale)


def _empty_result(q, k, v, coords):
    # Zeros that stay connected to the inputs, so backward() gives zero gradients rather than an error; the
    # empty slices add exactly 0 even where coords (non-empty when H == 0) hold NaN.
    out = q.new_zeros(q.shape)
    for tensor in (q, k, v, coords):
        if tensor.requires_grad:
            out = out + tensor.flatten()[:0].sum().to(out.dtype)
    return out
