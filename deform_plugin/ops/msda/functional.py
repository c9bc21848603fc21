"""Public entry points of the MSDA op: validate, pick a backend, run it."""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..backend import resolve_backend
from .checks import check_msda_inputs
from .reference import multi_scale_deformable_attn_reference, sampling_locations_from_offsets


def multi_scale_deformable_attn(value: torch.Tensor, spatial_shapes: torch.Tensor, level_start_index: torch.Tensor,
                                sampling_locations: torch.Tensor, attention_weights: torch.Tensor,
                                backend: Optional[str] = None) -> torch.Tensor:
    """Multi-scale deformable attention (Deformable-DETR), a drop-in for mmcv's op with any batch size.

    Args:
        value: ``(B, S, H, D)`` values of all levels, each level's map flattened row-major, levels concatenated.
        spatial_shapes: ``(L, 2)`` integer (h, w) of each level.
        level_start_index: ``(L,)`` offset of each level in S: ``[0, h0*w0, h0*w0 + h1*w1, ...]``.
        sampling_locations: ``(B, Q, H, L, P, 2)`` normalized (x, y); pixel = x * w - 0.5 (mmcv's convention).
            Locations outside the map, NaN or infinite contribute zero.
        attention_weights: ``(B, Q, H, L, P)`` weight of each sample (usually a softmax over L*P).
        backend: ``'auto'``, ``'triton'``, ``'pytorch'``, ``'mmcv'`` or None for the process default
            (see :mod:`deform_plugin.ops.backend`).

    Returns:
        ``(B, Q, H*D)`` in the dtype of ``value``.

    Example:
        >>> value = torch.randn(2, 12 * 20 + 6 * 10, 8, 32)
        >>> shapes = torch.tensor([[12, 20], [6, 10]])
        >>> starts = torch.tensor([0, 240])
        >>> loc = torch.rand(2, 100, 8, 2, 4, 2)
        >>> weights = torch.rand(2, 100, 8, 2, 4).softmax(-1)
        >>> multi_scale_deformable_attn(value, shapes, starts, loc, weights).shape
        torch.Size([2, 100, 256])
    """
    # The level-table check reads spatial_shapes on the host: data-dependent, so torch.compile(fullgraph=True)
    # could not trace it. Compiled graphs skip it (eager calls of the same code have checked the tables).
    shape = check_msda_inputs(value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
                              check_level_sizes=not torch.compiler.is_compiling())
    name = resolve_backend(backend, value.device)
    if shape.batch == 0 or shape.num_queries == 0:
        return value.new_zeros((shape.batch, shape.num_queries, shape.num_heads * shape.head_dim))
    if name == "triton":
        from .triton_op import multi_scale_deformable_attn_triton
        return multi_scale_deformable_attn_triton(value, spatial_shapes, level_start_index, sampling_locations,
                                                  attention_weights)
    if name == "mmcv":
        return _multi_scale_deformable_attn_mmcv(value, spatial_shapes, level_start_index, sampling_locations,
                                                 attention_weights)
    return multi_scale_deformable_attn_reference(value, spatial_shapes, level_start_index, sampling_locations,
                                                 attention_weights)


def _multi_scale_deformable_attn_mmcv(value, spatial_shapes, level_start_index, sampling_locations,
                                      attention_weights):
    from mmcv.ops.multi_scale_deform_attn import MultiScaleDeformableAttnFunction

    # The stock kernel needs batch % im2col_step == 0; gcd(batch, 64) is the largest such step up to its default.
    im2col_step = math.gcd(value.shape[0], 64)
    return MultiScaleDeformableAttnFunction.apply(value, spatial_shapes, level_start_index, sampling_locations,
                                                  attention_weights, im2col_step)


def fused_multi_scale_deformable_attn(value: torch.Tensor, spatial_shapes: torch.Tensor,
                                      level_start_index: torch.Tensor, reference_points: torch.Tensor,
                                      sampling_offsets: torch.Tensor, attention_logits: torch.Tensor,
                                      backend: Optional[str] = None) -> torch.Tensor:
    """MSDA from the module's raw predictions: softmax and location arithmetic fused into the op.

    Computes ``multi_scale_deformable_attn(value, ..., locations, softmax(attention_logits over L*P))`` with
    ``locations`` from :func:`~deform_plugin.ops.msda.reference.sampling_locations_from_offsets`. The Triton
    backend does the softmax and the location arithmetic inside its kernels (no intermediate tensors); the other
    backends compose PyTorch ops.

    Args:
        value: ``(B, S, H, D)``.
        spatial_shapes, level_start_index: as in :func:`multi_scale_deformable_attn`.
        reference_points: ``(B, Q, L, 2)`` normalized points or ``(B, Q, L, 4)`` normalized boxes (cx, cy, w, h).
        sampling_offsets: ``(B, Q, H, L, P, 2)`` raw offsets predicted by the module.
        attention_logits: ``(B, Q, H, L, P)`` raw logits; the softmax runs over the last L*P values per head.
        backend: as in :func:`multi_scale_deformable_attn`.

    Returns:
        ``(B, Q, H*D)`` in the dtype of ``value``.
    """
    if reference_points.dim() != 4 or reference_points.shape[-1] not in (2, 4):
        raise ValueError("reference_points must be (batch, num_queries, num_levels, 2 or 4), "
                         f"got shape {tuple(reference_points.shape)}")
    batch, num_queries, num_heads, num_levels, num_points, _ = (
        sampling_offsets.shape if sampling_offsets.dim() == 6 else (None,) * 6)
    if batch is None:
        raise ValueError("sampling_offsets must be (batch, num_queries, num_heads, num_levels, num_points, 2), "
                         f"got shape {tuple(sampling_offsets.shape)}")
    if tuple(reference_points.shape[:3]) != (batch, num_queries, num_levels):
        raise ValueError(f"reference_points has shape {tuple(reference_points.shape)} but sampling_offsets "
                         f"implies (batch, queries, levels) = {(batch, num_queries, num_levels)}")
    name = resolve_backend(backend, value.device)
    if name == "triton":
        check_msda_inputs(value, spatial_shapes, level_start_index, sampling_offsets, attention_logits,
                          check_level_sizes=not torch.compiler.is_compiling())
        if batch == 0 or num_queries == 0:
            return value.new_zeros((batch, num_queries, value.shape[2] * value.shape[3]))
        from .triton_op import fused_multi_scale_deformable_attn_triton
        return fused_multi_scale_deformable_attn_triton(value, spatial_shapes, level_start_index, reference_points,
                                                        sampling_offsets, attention_logits)
    weights = attention_logits.flatten(-2).softmax(-1).view_as(attention_logits)
    locations = sampling_locations_from_offsets(reference_points, sampling_offsets, spatial_shapes)
    return multi_scale_deformable_attn(value, spatial_shapes, level_start_index, locations, weights, backend=name)
