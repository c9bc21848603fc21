"""Floors for the MSDA kernels, measured on the card that runs the benchmark.

- the DRAM floor: the fewest bytes a forward (or forward+backward) must move, over the measured copy bandwidth;
- the gather/scatter floor: plain Triton kernels that gather (and atomically scatter) exactly the value rows the
  case's bilinear corners touch, with no interpolation arithmetic. A kernel-only figure, labelled as such.

``case`` arguments are :class:`.msda.Case` objects (levels, batch, queries, heads, head_dim, points).
"""
from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl

from deform_plugin.benchmarks.common import do_bench


def measure_copy_bandwidth() -> float:
    """Bytes read + written per second of a 2 GiB device-to-device copy."""
    src = torch.empty(2 ** 31 // 4, device="cuda", dtype=torch.float32).normal_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src))[0]
    return 2 * 2 ** 31 / (ms * 1e-3)


def dram_bytes(case, dtype: torch.dtype) -> Tuple[int, int]:
    """Fewest bytes of forward and forward+backward: each input read once, each output written once."""
    size = torch.tensor([], dtype=dtype).element_size()
    levels = len(case.levels)
    value = case.batch * case.num_keys * case.heads * case.head_dim * size
    samples = case.batch * case.num_queries * case.heads * levels * case.points
    locations, weights = samples * 2 * size, samples * size
    out = case.batch * case.num_queries * case.heads * case.head_dim * size
    forward = value + locations + weights + out
    backward = out + value + locations + weights + value + locations + weights  # grad_out, inputs, their grads
    return forward, forward + backward


@triton.jit
def _gather_rows_kernel(table_ptr,  # (R, D)
                        rows_ptr,  # (N,) int32 row indices
                        out_ptr,  # (cdiv(N, BLOCK_R), D) float32
                        num_rows, row_dim, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # Plain gather: BLOCK_R rows summed into one row per program (almost nothing written back).
    pid = tl.program_id(0).to(tl.int64)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    mask = r < num_rows
    row = tl.load(rows_ptr + r, mask=mask, other=0).to(tl.int64)
    vals = tl.load(table_ptr + row[:, None] * row_dim + d[None, :], mask=mask[:, None] & (d < row_dim)[None, :],
                   other=0.0).to(tl.float32)
    tl.store(out_ptr + pid * row_dim + d, tl.sum(vals, axis=0), mask=d < row_dim)


@triton.jit
def _scatter_rows_kernel(table_ptr,  # (R, D) float32
                         rows_ptr,  # (N,) int32 row indices
                         num_rows, row_dim, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    # Plain atomic scatter of a [BLOCK_R, D] float32 tile made in registers: the backward's grad_value traffic.
    pid = tl.program_id(0).to(tl.int64)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    mask = r < num_rows
    row = tl.load(rows_ptr + r, mask=mask, other=0).to(tl.int64)
    src = (r % 7).to(tl.float32)[:, None] * 0.25 + d[None, :].to(tl.float32)
    tl.atomic_add(table_ptr + row[:, None] * row_dim + d[None, :], src, mask=mask[:, None] & (d < row_dim)[None, :],
                  sem="relaxed")


def corner_rows(case, starts: torch.Tensor, locations: torch.Tensor) -> torch.Tensor:
    """int32 value-row index of every (sample, corner) of the case, clamped into the map (same volume)."""
    b, q, h, levels, p, _ = locations.shape
    loc = locations.float()
    rows = []
    for level in range(levels):
        height, width = case.levels[level]
        px = (loc[:, :, :, level, :, 0] * width - 0.5).floor().clamp(0, width - 2 if width > 1 else 0)
        py = (loc[:, :, :, level, :, 1] * height - 0.5).floor().clamp(0, height - 2 if height > 1 else 0)
        start = int(starts[level])
        for dy in (0, 1):
            for dx in (0, 1):
                rows.append(start + (py + min(dy, height - 1)) * width + px + min(dx, width - 1))
    keys = torch.stack(rows, -1).long()                        # (B, Q, H, P, L*4)
    batch_index = torch.arange(b, device=keys.device).view(b, 1, 1, 1, 1)
    head_index = torch.arange(h, device=keys.device).view(1, 1, h, 1, 1)
    value_rows = (batch_index * case.num_keys + keys) * case.heads + head_index
    return value_rows.flatten().to(torch.int32)


def gather_scatter_floor(case, dtype: torch.dtype, starts: torch.Tensor, locations: torch.Tensor
                         ) -> Tuple[float, float]:
    """Median ms of a plain gather and a plain fp32 atomic scatter of exactly this case's corner rows."""
    rows = corner_rows(case, starts, locations)
    num_rows = rows.numel()
    table = torch.randn(case.batch * case.num_keys * case.heads, case.head_dim, device="cuda").to(dtype)
    block_d = triton.next_power_of_2(case.head_dim)
    grid = (triton.cdiv(num_rows, 256),)
    gathered = torch.empty(grid[0], case.head_dim, device="cuda")
    gather_ms = do_bench(lambda: _gather_rows_kernel[grid](table, rows, gathered, num_rows, case.head_dim,
                                                           BLOCK_R=256, BLOCK_D=block_d))[0]
    grad_table = torch.zeros(table.shape, device="cuda", dtype=torch.float32)
    grid = (triton.cdiv(num_rows, 128),)
    scatter_ms = do_bench(lambda: _scatter_rows_kernel[grid](grad_table, rows, num_rows, case.head_dim,
                                                             BLOCK_R=128, BLOCK_D=block_d))[0]
    return gather_ms, scatter_ms
