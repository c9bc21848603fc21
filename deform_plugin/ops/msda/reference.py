"""Pure-PyTorch multi-scale deformable attention: the specification of the op and its CPU path.

Conventions (the same as mmcv's CUDA kernel):
    * ``value`` is ``(B, S, H, D)``, the levels' feature maps flattened row-major and concatenated along S;
    * a sampling location ``(x, y)`` in [0, 1] maps to the pixel coordinate ``(x * w - 0.5, y * h - 0.5)`` of its level;
    * a sample is taken only where that pixel coordinate lies in ``(-1, w) x (-1, h)``: a sample outside, or whose
      location is NaN or infinite, contributes zero and receives zero gradient;
    * a taken sample interpolates bilinearly over its four neighbouring pixels; a corner outside the map contributes
      exactly zero. Such corners and untaken samples never read ``value`` at all, so an ``inf`` or ``NaN`` at a border
      pixel (or anywhere nothing samples) cannot turn into ``0 * inf`` in the output or in any gradient.

Arithmetic runs in float32 for half-precision inputs and in float64 for float64 inputs, so this function is also
the float64 reference that the Triton kernels are tested against.

Memory: gradients come from a hand-written backward (``torch.autograd.Function``) that saves only the three inputs
and recomputes each sample's corners. Both directions walk one level and a chunk of its points at a time, gathering
one (point, corner) of every sample per ``index_select`` (``index_add_`` for ``grad_value``). Besides the inputs, the
output and the gradients, the op holds a copy of ``value`` in the compute dtype (plus one zero row that corners
outside the map read), two ``(B, Q, H, D)`` buffers and the corner tables of one chunk, whatever the number of levels
and points. Autograd through per-corner gathers kept 4 * L gathered ``(B*H, Q*P, D)`` tensors instead; mmcv's
``grid_sample`` path keeps about three ``(B*H, D, Q, L*P)`` tensors (``deform_plugin.benchmarks.ops.reference_memory``).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence, Union

import torch
from torch.autograd.function import once_differentiable

LevelTable = Union[torch.Tensor, Sequence]


def _on_host(table: LevelTable) -> Sequence:
    return table.tolist() if isinstance(table, torch.Tensor) else table


def multi_scale_deformable_attn_reference(value: torch.Tensor, spatial_shapes: LevelTable,
                                          level_start_index: LevelTable, sampling_locations: torch.Tensor,
                                          attention_weights: torch.Tensor) -> torch.Tensor:
    """Reference MSDA. Shapes as in :func:`deform_plugin.ops.multi_scale_deformable_attn`; returns ``(B, Q, H*D)``.

    The level tables may be tensors or their host copies (``((h, w), ...)`` and ``(start, ...)``). Differentiable
    once in ``value``, ``sampling_locations`` and ``attention_weights``.
    """
    levels = tuple((int(height), int(width), int(start)) for (height, width), start
                   in zip(_on_host(spatial_shapes), _on_host(level_start_index)))
    return _ReferenceMSDA.apply(value, sampling_locations, attention_weights, levels)


class _Corners(NamedTuple):
    """The bilinear corners of a chunk of points of one level; each (point, corner) slice is contiguous.

    Corner ``c`` of a sample is the pixel ``(x0 + c % 2, y0 + c // 2)``.
    """

    taken: torch.Tensor   # (p, B, Q, H) bool: the pixel coordinate lies in (-1, w) x (-1, h)
    rows: torch.Tensor    # (p, 4, B*Q*H) value-table row of each corner; the zero sink row where it reads nothing
    frac_x: torch.Tensor  # (p, B, Q, H) pixel x - floor(pixel x); 0 where not taken
    frac_y: torch.Tensor  # (p, B, Q, H)

    def factors(self):
        """``(weight_x, weight_y)``, each ``(p, 2, B, Q, H)``: the bilinear factors of the low and high pixel."""
        return (torch.stack([1 - self.frac_x, self.frac_x], 1), torch.stack([1 - self.frac_y, self.frac_y], 1))

    def weights(self, factors=None) -> torch.Tensor:
        """``(p, 4, B, Q, H)`` bilinear weight of each corner."""
        weight_x, weight_y = factors or self.factors()
        return (weight_y[:, :, None] * weight_x[:, None, :]).flatten(1, 2)


def _corners(locations: torch.Tensor, height: int, width: int, first_row: torch.Tensor, num_heads: int,
             sink: int) -> _Corners:
    """Corners of a chunk of samples of one level.

    ``locations`` is ``(p, B, Q, H, 2)`` in the compute dtype; ``first_row`` ``(B, 1, H)`` the value-table row of the
    level's pixel 0 for each (image, head), in the index dtype; the rows of one pixel are ``num_heads`` apart.
    """
    pixel_x = locations[..., 0] * width - 0.5
    pixel_y = locations[..., 1] * height - 0.5
    # False for NaN and infinite locations too: every comparison with NaN is false.
    taken = (pixel_x > -1) & (pixel_x < width) & (pixel_y > -1) & (pixel_y < height)
    # Untaken samples are parked at pixel 0, so that the float -> integer conversion is defined; none of their
    # corners is read.
    pixel_x = torch.where(taken, pixel_x, 0.0)
    pixel_y = torch.where(taken, pixel_y, 0.0)
    x0 = pixel_x.floor()
    y0 = pixel_y.floor()
    frac_x = pixel_x.sub_(x0)
    frac_y = pixel_y.sub_(y0)
    x0 = x0.to(first_row.dtype)
    y0 = y0.to(first_row.dtype)
    # A taken sample has -1 <= x0 <= w - 1: its low corner is inside from x0 >= 0, its high one up to x0 < w - 1.
    inside_x = (x0 >= 0, x0 < width - 1)
    inside_y = (y0 >= 0, y0 < height - 1)
    base = first_row + (y0 * width + x0) * num_heads
    rows = base.new_empty((base.shape[0], 4) + base.shape[1:])
    sink = base.new_tensor(sink)
    for corner in range(4):
        dx, dy = corner % 2, corner // 2
        read = taken & inside_x[dx] & inside_y[dy]
        torch.where(read, base + (dy * width + dx) * num_heads, sink, out=rows[:, corner])
    return _Corners(taken, rows.flatten(2), frac_x, frac_y)


def _points_per_chunk(num_points: int, head_dim: int, itemsize: int) -> int:
    # A chunk's corner tables and their transients take about 100 bytes per sample and point; keep them within
    # twice a (B, Q, H, D) temporary, so that the op's extra memory stays a few output sizes at any head_dim.
    return max(1, min(num_points, 2 * head_dim * itemsize // 100))


def _value_table(value: torch.Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
    """``value`` as ``(B*S*H + 1, D)`` rows in the compute dtype; the last row is the zero sink."""
    batch, num_keys, num_heads, head_dim = value.shape
    num_rows = batch * num_keys * num_heads
    table = value.new_empty((num_rows + 1, head_dim), dtype=compute_dtype)
    table[:-1].copy_(value.reshape(num_rows, head_dim))
    table[-1].zero_()
    return table


def _first_rows(value: torch.Tensor, num_table_rows: int) -> torch.Tensor:
    # (B, 1, H): table row of key 0 for each (image, head); key k is k * H rows further. int32 where rows fit.
    batch, num_keys, num_heads, _ = value.shape
    dtype = torch.int32 if num_table_rows < 2 ** 31 else torch.int64
    images = torch.arange(batch, device=value.device, dtype=dtype) * (num_keys * num_heads)
    return (images[:, None] + torch.arange(num_heads, device=value.device, dtype=dtype)[None, :])[:, None, :]


def _chunks(levels, num_points: int, points_per_chunk: int):
    for level, (height, width, start) in enumerate(levels):
        for first in range(0, num_points, points_per_chunk):
            yield level, slice(first, min(first + points_per_chunk, num_points)), height, width, start


def _chunk_inputs(sampling_locations, attention_weights, level, points, compute_dtype):
    # (B, Q, H, L, P, 2) -> (p, B, Q, H, 2) and (B, Q, H, L, P) -> (p, B, Q, H) for one level and chunk of points.
    locations = sampling_locations[:, :, :, level, points].permute(3, 0, 1, 2, 4).to(compute_dtype)
    weights = attention_weights[:, :, :, level, points].permute(3, 0, 1, 2).to(compute_dtype)
    return locations, weights


class _ReferenceMSDA(torch.autograd.Function):
    """The reference op; its backward recomputes the corners instead of keeping their gathered values."""

    @staticmethod
    def forward(ctx, value, sampling_locations, attention_weights, levels):
        ctx.save_for_backward(value, sampling_locations, attention_weights)
        ctx.levels = levels
        batch, _, num_heads, head_dim = value.shape
        num_queries, num_points = sampling_locations.shape[1], sampling_locations.shape[4]
        compute_dtype = torch.promote_types(value.dtype, torch.float32)
        table = _value_table(value, compute_dtype)
        sink = len(table) - 1
        first_rows = _first_rows(value, len(table))
        output = value.new_zeros((batch, num_queries, num_heads, head_dim), dtype=compute_dtype)
        gathered_rows = output.new_empty((batch * num_queries * num_heads, head_dim))
        gathered = gathered_rows.view(output.shape)
        chunk = _points_per_chunk(num_points, head_dim, table.element_size())
        for level, points, height, width, start in _chunks(levels, num_points, chunk):
            locations, weights = _chunk_inputs(sampling_locations, attention_weights, level, points, compute_dtype)
            corners = _corners(locations, height, width, first_rows + start * num_heads, num_heads, sink)
            coefficients = weights[:, None] * corners.weights()
            for point in range(len(corners.rows)):
                for corner in range(4):
                    torch.index_select(table, 0, corners.rows[point, corner], out=gathered_rows)
                    output.addcmul_(gathered, coefficients[point, corner, ..., None])
        return output.view(batch, num_queries, num_heads * head_dim).to(value.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        value, sampling_locations, attention_weights = ctx.saved_tensors
        need_value, need_locations, need_weights = ctx.needs_input_grad[:3]
        batch, _, num_heads, head_dim = value.shape
        num_queries, num_points = sampling_locations.shape[1], sampling_locations.shape[4]
        compute_dtype = torch.promote_types(value.dtype, torch.float32)
        grad_output = grad_output.reshape(batch, num_queries, num_heads, head_dim).to(compute_dtype)
        table = _value_table(value, compute_dtype)
        sink = len(table) - 1
        first_rows = _first_rows(value, len(table))
        grad_table = torch.zeros_like(table) if need_value else None
        grad_locations = (sampling_locations.new_zeros(sampling_locations.shape, dtype=compute_dtype)
                          if need_locations else None)
        grad_weights = (attention_weights.new_zeros(attention_weights.shape, dtype=compute_dtype)
                        if need_weights else None)
        scratch_rows = grad_output.new_empty((batch * num_queries * num_heads, head_dim))
        scratch = scratch_rows.view(grad_output.shape)
        chunk = _points_per_chunk(num_points, head_dim, table.element_size())
        for level, points, height, width, start in _chunks(ctx.levels, num_points, chunk):
            locations, weights = _chunk_inputs(sampling_locations, attention_weights, level, points, compute_dtype)
            corners = _corners(locations, height, width, first_rows + start * num_heads, num_heads, sink)
            factors = corners.factors()
            chunk_points = len(corners.rows)
            if need_locations or need_weights:
                # grad_output . (corner's value row) = d output / d (corner's coefficient), per sample.
                dots = grad_output.new_empty((chunk_points, 4, batch, num_queries, num_heads))
                for point in range(chunk_points):
                    for corner in range(4):
                        torch.index_select(table, 0, corners.rows[point, corner], out=scratch_rows)
                        torch.sum(scratch.mul_(grad_output), -1, out=dots[point, corner])
            if need_weights:
                grad_weights[:, :, :, level, points] = (corners.weights(factors) * dots).sum(1).permute(1, 2, 3, 0)
            if need_locations:
                weight_x, weight_y = factors
                dots = dots.unflatten(1, (2, 2))  # (p, dy, dx, B, Q, H)
                # The low corner's factor falls as the pixel coordinate grows, the high one's rises.
                grad_x = (weight_y * (dots[:, :, 1] - dots[:, :, 0])).sum(1)
                grad_y = (weight_x * (dots[:, 1] - dots[:, 0])).sum(1)
                grad_x = torch.where(corners.taken, weights * grad_x * width, 0.0)
                grad_y = torch.where(corners.taken, weights * grad_y * height, 0.0)
                grad_locations[:, :, :, level, points] = torch.stack([grad_x, grad_y], -1).permute(1, 2, 3, 0, 4)
            if need_value:
                coefficients = weights[:, None] * corners.weights(factors)
                for point in range(chunk_points):
                    for corner in range(4):
                        # Corners that read nothing add into the sink row, which is dropped.
                        torch.mul(grad_output, coefficients[point, corner, ..., None], out=scratch)
                        grad_table.index_add_(0, corners.rows[point, corner], scratch_rows)
        grad_value = grad_table[:-1].view(value.shape).to(value.dtype) if need_value else None
        grad_locations = grad_locations.to(sampling_locations.dtype) if need_locations else None
        grad_weights = grad_weights.to(attention_weights.dtype) if need_weights else None
        return grad_value, grad_locations, grad_weights, None


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
