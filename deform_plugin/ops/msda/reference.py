"""Pure-PyTorch multi-scale deformable attention: the specification of the op and its CPU path.

Conventions (the same as mmcv's CUDA kernel):
    * ``value`` is ``(B, S, H, D)``, the levels' feature maps flattened row-major and concatenated along S;
    * a sampling location ``(x, y)`` in [0, 1] maps to the pixel coordinate ``(x * w - 0.5, y * h - 0.5)`` of its level;
    * bilinear interpolation over the four neighbouring pixels, each corner outside the map contributing zero;
    * locations that are NaN or infinite contribute zero (and get zero gradient), as in the stock CUDA kernel.

Arithmetic runs in float32 for half-precision inputs and in float64 for float64 inputs, so this function is also
the float64 reference that the Triton kernels are tested against. Gradients come from PyTorch autograd.
"""
from __future__ import annotations

from typing import Sequence, Union

import torch

LevelTable = Union[torch.Tensor, Sequence]


def _on_host(table: LevelTable) -> Sequence:
    return table.tolist() if isinstance(table, torch.Tensor) else table


def multi_scale_deformable_attn_reference(value: torch.Tensor, spatial_shapes: LevelTable,
                                          level_start_index: LevelTable, sampling_locations: torch.Tensor,
                                          attention_weights: torch.Tensor) -> torch.Tensor:
    """Reference MSDA. Shapes as in :func:`deform_plugin.ops.multi_scale_deformable_attn`; returns ``(B, Q, H*D)``.

    The level tables may be tensors or their host copies (``((h, w), ...)`` and ``(start, ...)``).
    """
    batch, _, num_heads, head_dim = value.shape
    _, num_queries, _, _, num_points, _ = sampling_locations.shape
    compute_dtype = torch.promote_types(value.dtype, torch.float32)
    rows = batch * num_heads
    output = value.new_zeros((rows, num_queries, head_dim), dtype=compute_dtype)
    levels = zip(_on_host(spatial_shapes), _on_host(level_start_index))
    for level, ((height, width), start) in enumerate(levels):
        # (B, h*w, H, D) -> (B*H, h*w, D): one gather table per (image, head).
        level_value = value[:, start:start + height * width].to(compute_dtype)
        level_value = level_value.permute(0, 2, 1, 3).reshape(rows, height * width, head_dim)
        # (B, Q, H, P, 2) -> (B*H, Q*P, 2)
        location = sampling_locations[:, :, :, level].to(compute_dtype)
        location = location.permute(0, 2, 1, 3, 4).reshape(rows, num_queries * num_points, 2)
        weight = attention_weights[:, :, :, level].to(compute_dtype)
        weight = weight.permute(0, 2, 1, 3).reshape(rows, num_queries * num_points)

        finite = torch.isfinite(location).all(-1)
        # where() rather than arithmetic masking, so a NaN location cannot leak NaN into any gradient.
        location = torch.where(finite[..., None], location, torch.full_like(location, -1.0))
        # Clamping keeps floor()->long defined for huge values; it moves only points whose four corners are all
        # outside the map (pixel coordinate <= -1 or >= size), which contribute nothing either way.
        pixel_x = (location[..., 0] * width - 0.5).clamp(-2.0, width + 1.0)
        pixel_y = (location[..., 1] * height - 0.5).clamp(-2.0, height + 1.0)
        x0 = pixel_x.floor()
        y0 = pixel_y.floor()
        frac_x = pixel_x - x0
        frac_y = pixel_y - y0
        x0 = x0.long()
        y0 = y0.long()

        sampled = None
        for dy in (0, 1):
            for dx in (0, 1):
                corner_x = x0 + dx
                corner_y = y0 + dy
                corner_weight = (frac_x if dx else 1 - frac_x) * (frac_y if dy else 1 - frac_y)
                inside = (corner_x >= 0) & (corner_x < width) & (corner_y >= 0) & (corner_y < height) & finite
                index = corner_y.clamp(0, height - 1) * width + corner_x.clamp(0, width - 1)
                corner_value = torch.gather(level_value, 1, index[..., None].expand(-1, -1, head_dim))
                term = corner_value * (corner_weight * inside)[..., None]
                sampled = term if sampled is None else sampled + term
        weighted = sampled * weight[..., None]
        output = output + weighted.view(rows, num_queries, num_points, head_dim).sum(2)
    output = output.view(batch, num_heads, num_queries, head_dim).permute(0, 2, 1, 3)
    return output.reshape(batch, num_queries, num_heads * head_dim).to(value.dtype)


def sampling_locations_from_offsets(reference_points: torch.Tensor, sampling_offsets: torch.Tensor,
                                    spatial_shapes: torch.Tensor) -> torch.Tensor:
    """mmcv's location arithmetic: reference points plus offsets scaled to each level (or to each box).

    Args:
        reference_points: ``(B, Q, L, 2)`` normalized (x, y), or ``(B, Q, L, 4)`` boxes (cx, cy, w, h).
        sampling_offsets: ``(B, Q, H, L, P, 2)`` offsets in pixels of each level (2-d reference points) or in
            units of half the box size divided by the number of points (4-d reference boxes).
        spatial_shapes: ``(L, 2)`` as (h, w).

    Returns:
        ``(B, Q, H, L, P, 2)`` normalized sampling locations.
    """
    num_points = sampling_offsets.shape[4]
    if reference_points.shape[-1] == 2:
        normalizer = torch.stack([spatial_shapes[..., 1], spatial_shapes[..., 0]], -1).to(sampling_offsets.dtype)
        return reference_points[:, :, None, :, None, :] + sampling_offsets / normalizer[None, None, None, :, None, :]
    if reference_points.shape[-1] == 4:
        return (reference_points[:, :, None, :, None, :2]
                + sampling_offsets / num_points * reference_points[:, :, None, :, None, 2:] * 0.5)
    raise ValueError(f"Last dim of reference_points must be 2 or 4, but got {reference_points.shape[-1]}")
