"""MSDA in standard ONNX operators: what the public entry points run while ``torch.onnx.export`` traces them.

Neither the Triton kernels (a ``torch.library`` custom op that ONNX has no translation for) nor the reference (its
corner gathers index with ``long`` arithmetic on host-sized slices) is what a deployed graph should contain. While an
ONNX export traces the model, :func:`~deform_plugin.ops.multi_scale_deformable_attn` and
:func:`~deform_plugin.ops.fused_multi_scale_deformable_attn` run this formulation instead, whatever the backend
setting: one bilinear ``GridSample`` (opset 16) per level on ``(B*H, D, h, w)`` maps, then the weighted sum over
levels and points. Only standard operators appear in the graph (``GridSample``, ``Softmax``, elementwise ops,
``Reshape``/``Transpose``/``Slice``, ``ReduceSum``), so any ONNX runtime that implements opset 16 runs it without a
plugin.

Level sizes:
    * the TorchScript exporter (``dynamo=False``) traces real tensors: each level's (h, w) is read on the host and
      baked into the graph as a constant, so the graph is specialised to the traced input size;
    * the default exporter (``dynamo=True``, ``torch.export`` underneath) traces fake tensors whose values are
      unknown: (h, w) and the level starts become data-dependent sizes read from the table tensors when the graph
      runs, so an exported module takes any level sizes that tile its ``value``.

Non-finite and far-away locations: ONNX ``GridSample`` leaves NaN, infinite and huge coordinates unspecified (ONNX
Runtime 1.30 returns non-zero values for all of them; PyTorch's ``grid_sample`` returns NaN for the non-finite ones),
so coordinates are sanitised before sampling: non-finite ones move outside every map and finite ones are clamped to a
band whose edges are still entirely outside it. Both contribute zero, as in the op.
"""
from __future__ import annotations

from typing import List, Tuple

import torch
import torch.nn.functional as F

from .level_tables import host_level_tables
from .reference import sampling_locations_from_offsets

# grid_sample coordinates (the map spans [-1, 1]) at or beyond +-3 are at least 1.5 pixels outside a map of any size:
# every bilinear corner there is outside, so clamping to this band changes no result and keeps runtimes' float->int
# conversions defined.
_OUTSIDE = 3.0


def in_onnx_export() -> bool:
    """Whether ``torch.onnx.export`` (either exporter) is tracing the caller.

    Both exporters trace: the TorchScript one with ``torch.jit``'s tracer, the default one with ``torch.export``
    (which sets the compiling flag). The cheap flags come first: an eager call measured 0.6 µs against 2 µs for
    ``torch.onnx.is_in_onnx_export`` alone (2-core CPU); under ``torch.compile`` dynamo folds it to False.
    """
    return (torch.jit.is_tracing() or torch.compiler.is_compiling()) and torch.onnx.is_in_onnx_export()


def _level_tables(spatial_shapes: torch.Tensor, level_start_index: torch.Tensor, num_keys: int
                  ) -> Tuple[List[Tuple[int, int]], List[int]]:
    if not torch.compiler.is_compiling():
        # Real tensors (TorchScript tracing, eager): the host copies that validation made, constants in a trace.
        shapes, starts = host_level_tables(spatial_shapes, level_start_index)
        return [tuple(s) for s in shapes], list(starts)
    # torch.export: the values are unknown while tracing, so they become data-dependent sizes read when the graph
    # runs; the checks give torch.export the facts that make the slices and reshapes below valid.
    shapes = [tuple(s) for s in spatial_shapes.tolist()]
    starts = level_start_index.tolist()
    for (height, width), start in zip(shapes, starts):
        torch._check(height >= 1)
        torch._check(width >= 1)
        torch._check(start >= 0)
        torch._check(start + height * width <= num_keys)
    return shapes, starts


def _bilinear_zeros_grid_sample(level_map: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """``F.grid_sample(..., mode='bilinear', padding_mode='zeros', align_corners=False)``.

    Under torch.export the 2-d sampler is called directly: ``F.grid_sample``'s dispatcher first asks whether cuDNN's
    sampler could take a CUDA input, and that question (does the map have fewer than 2**31 elements) is a guard on
    the data-dependent level sizes that torch.export cannot decide (torch 2.11). The direct call is the kernel the
    dispatcher picks anyway (cuDNN's needs ``align_corners=True``), and the ONNX exporter translates it to the same
    ``GridSample``. The TorchScript exporter only translates ``grid_sample`` itself.
    """
    if torch.compiler.is_compiling():
        return torch.ops.aten.grid_sampler_2d(level_map, grid, 0, 0, False)  # bilinear, zeros, align_corners
    return F.grid_sample(level_map, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def multi_scale_deformable_attn_export(value: torch.Tensor, spatial_shapes: torch.Tensor,
                                       level_start_index: torch.Tensor, sampling_locations: torch.Tensor,
                                       attention_weights: torch.Tensor) -> torch.Tensor:
    """MSDA as per-level ``grid_sample``: the same contract as :func:`~deform_plugin.ops.multi_scale_deformable_attn`.

    Args:
        value: ``(B, S, H, D)``.
        spatial_shapes: ``(L, 2)`` integer (h, w) of each level.
        level_start_index: ``(L,)`` offset of each level in S.
        sampling_locations: ``(B, Q, H, L, P, 2)`` normalized (x, y); pixel = x * w - 0.5.
        attention_weights: ``(B, Q, H, L, P)``.

    Returns:
        ``(B, Q, H*D)`` in the dtype of ``value`` (computed in float32, or float64 for float64 inputs).
    """
    batch, num_keys, num_heads, head_dim = value.shape
    _, num_queries, _, num_levels, num_points, _ = sampling_locations.shape
    dtype = torch.promote_types(value.dtype, torch.float32)
    rows = batch * num_heads
    shapes, starts = _level_tables(spatial_shapes, level_start_index, num_keys)

    # align_corners=False maps grid coordinate g to pixel ((g + 1) * w - 1) / 2, which is x * w - 0.5 for g = 2x - 1.
    grid = sampling_locations.to(dtype) * 2.0 - 1.0
    grid = torch.where(torch.isfinite(grid), grid, torch.full_like(grid, -_OUTSIDE)).clamp(-_OUTSIDE, _OUTSIDE)
    # (B, Q, H, L, P, 2) -> (B*H, Q, L, P, 2): one sampling grid per (image, head) and level.
    grid = grid.permute(0, 2, 1, 3, 4, 5).reshape(rows, num_queries, num_levels, num_points, 2)

    sampled = []
    for level, ((height, width), start) in enumerate(zip(shapes, starts)):
        # (B, h*w, H, D) -> (B*H, D, h, w): the level's map for each (image, head).
        level_map = value.narrow(1, start, height * width).to(dtype).permute(0, 2, 3, 1)
        level_map = level_map.reshape(rows, head_dim, height, width)
        sampled.append(_bilinear_zeros_grid_sample(level_map, grid[:, :, level]))  # (B*H, D, Q, P)
    # (B*H, D, Q, L*P) weighted by (B*H, 1, Q, L*P), summed over levels and points.
    sampled = torch.cat(sampled, dim=-1)
    weights = attention_weights.to(dtype).permute(0, 2, 1, 3, 4).reshape(rows, 1, num_queries,
                                                                         num_levels * num_points)
    output = (sampled * weights).sum(-1)  # (B*H, D, Q)
    output = output.view(batch, num_heads, head_dim, num_queries).permute(0, 3, 1, 2)
    return output.reshape(batch, num_queries, num_heads * head_dim).to(value.dtype)


def fused_multi_scale_deformable_attn_export(value: torch.Tensor, spatial_shapes: torch.Tensor,
                                             level_start_index: torch.Tensor, reference_points: torch.Tensor,
                                             sampling_offsets: torch.Tensor, attention_logits: torch.Tensor
                                             ) -> torch.Tensor:
    """The fused entry's contract (softmax over L*P, locations from offsets) on the per-level ``grid_sample``."""
    weights = attention_logits.flatten(-2).softmax(-1).view_as(attention_logits)
    locations = sampling_locations_from_offsets(reference_points, sampling_offsets, spatial_shapes)
    return multi_scale_deformable_attn_export(value, spatial_shapes, level_start_index, locations, weights)

