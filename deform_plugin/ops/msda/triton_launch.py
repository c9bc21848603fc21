"""Host launchers of the MSDA Triton kernels: make inputs contiguous, allocate, choose blocks, launch.

They take tensors that :func:`deform_plugin.ops.msda.checks.check_msda_inputs` already accepted and do no host
synchronisation (the level tables stay on the device and are read by the kernels), so they can run inside a
``torch.compile``'d graph as the body of a custom op. Each launch runs under a device guard: Triton launches on the
current CUDA device, which need not be the tensors' device (a tensor on ``cuda:1`` would otherwise be read by a
kernel on ``cuda:0``).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .triton_kernels import msda_backward_kernel, msda_forward_kernel, msda_grad_value_segments_kernel

# Entries of the deterministic grad_value reduction handled per step of its loop.
_SEGMENT_BLOCK_E = 16


@dataclass(frozen=True)
class LaunchConfig:
    """Block sizes of one launch: queries per program, padded head_dim, warps, pipelining stages."""

    block_q: int
    block_d: int
    num_warps: int
    num_stages: int = 1


def _next_power_of_2(n: int) -> int:
    # Plain Python: triton.next_power_of_2 is patched (and slow) under the interpreter, and this runs every call.
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _device_guard(tensor: torch.Tensor):
    # Switching devices costs host time: only when the tensors are not on the current device.
    if tensor.is_cuda and tensor.device.index != torch.cuda.current_device():
        return torch.cuda.device(tensor.device)
    return contextlib.nullcontext()


def _accumulator_dtype(value: torch.Tensor):
    return tl.float64 if value.dtype == torch.float64 else tl.float32


def _grad_value_buffer_dtype(value: torch.Tensor) -> torch.dtype:
    return torch.float64 if value.dtype == torch.float64 else torch.float32


def choose_config(head_dim: int, num_queries: int, backward: bool, block_q: Optional[int] = None,
                  num_warps: Optional[int] = None) -> LaunchConfig:
    """Blocks of about 1K elements ([32 queries x 32 channels] at head_dim 32), 4 warps, with overrides for tuning.

    Measured on an H200 (docs/kernels.md): small tiles win in both directions, since many resident programs keep
    more independent gathers in flight than a large tile per program does; 128 x 32 tiles were 1.2-2x slower.
    """
    block_d = _next_power_of_2(head_dim)
    if block_q is None:
        block_q = max(1, 1024 // block_d)
        # Do not pad a tiny query count up to a large block.
        block_q = min(block_q, max(16, _next_power_of_2(num_queries)))
    if num_warps is None:
        num_warps = max(1, min(8, block_q * block_d // 256))
    return LaunchConfig(block_q=block_q, block_d=block_d, num_warps=num_warps)


def _level_tables(spatial_shapes: torch.Tensor, level_start_index: torch.Tensor, device: torch.device):
    return (spatial_shapes.to(device=device).contiguous(), level_start_index.to(device=device).contiguous())


def _softmax_block(num_levels: int, num_points: int) -> int:
    return _next_power_of_2(num_levels * num_points)


def msda_forward(value: torch.Tensor, spatial_shapes: torch.Tensor, level_start_index: torch.Tensor,
                 sampling_locations: torch.Tensor, attention_weights: torch.Tensor,
                 reference_points: Optional[torch.Tensor] = None,
                 config: Optional[LaunchConfig] = None) -> torch.Tensor:
    """Forward launch. With ``reference_points`` the call is fused: ``sampling_locations`` are the raw offsets and
    ``attention_weights`` the raw logits. Returns ``(B, Q, H*D)`` in the dtype of ``value``."""
    value = value.contiguous()
    sampling_locations = sampling_locations.contiguous()
    attention_weights = attention_weights.contiguous()
    batch, num_keys, num_heads, head_dim = value.shape
    _, num_queries, _, num_levels, num_points, _ = sampling_locations.shape
    output = torch.empty((batch, num_queries, num_heads * head_dim), device=value.device, dtype=value.dtype)
    if output.numel() == 0:
        return output.zero_()
    shapes, starts = _level_tables(spatial_shapes, level_start_index, value.device)
    fused = reference_points is not None
    reference = reference_points.contiguous() if fused else sampling_locations
    config = config or choose_config(head_dim, num_queries, backward=False)
    grid = (triton.cdiv(num_queries, config.block_q), num_heads, batch)
    with _device_guard(value):
        msda_forward_kernel[grid](
            value, shapes, starts, sampling_locations, attention_weights, reference, output,
            num_keys, num_queries, num_heads, head_dim,
            NUM_LEVELS=num_levels, NUM_POINTS=num_points, REF_DIM=reference.shape[-1] if fused else 2,
            FUSED=fused, BLOCK_Q=config.block_q, BLOCK_D=config.block_d,
            BLOCK_LP=_softmax_block(num_levels, num_points), ACC_DTYPE=_accumulator_dtype(value),
            num_warps=config.num_warps, num_stages=config.num_stages)
    return output


def msda_backward(grad_output: torch.Tensor, value: torch.Tensor, spatial_shapes: torch.Tensor,
                  level_start_index: torch.Tensor, sampling_locations: torch.Tensor,
                  attention_weights: torch.Tensor, reference_points: Optional[torch.Tensor] = None,
                  deterministic: bool = False, config: Optional[LaunchConfig] = None
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Backward launch: ``(grad_value, grad_locations, grad_weights, grad_reference_points)``, each in its input's
    dtype (the last is None unless fused; fused, the location and weight grads are those of the raw offsets and
    logits).

    ``grad_value`` is accumulated with float32 atomics (float64 for float64 values), or, with ``deterministic``,
    without atomics: each (sample, corner) writes its grad_value row and coefficient, a stable sort groups them by
    row, and one program per row sums its entries in a fixed order, so the result is bit-identical between runs.
    """
    value = value.contiguous()
    sampling_locations = sampling_locations.contiguous()
    attention_weights = attention_weights.contiguous()
    grad_output = grad_output.contiguous()
    batch, num_keys, num_heads, head_dim = value.shape
    _, num_queries, _, num_levels, num_points, _ = sampling_locations.shape
    fused = reference_points is not None
    reference = reference_points.contiguous() if fused else sampling_locations
    ref_dim = reference.shape[-1] if fused else 2

    grad_locations = torch.empty_like(sampling_locations)
    # The fused softmax backward keeps a query's L*P weight grads in registers and writes the logits' grads once.
    grad_weights = torch.empty_like(attention_weights)
    buffer_dtype = _grad_value_buffer_dtype(value)
    grad_ref_per_head = (torch.empty((batch, num_queries, num_heads, num_levels, ref_dim), device=value.device,
                                     dtype=buffer_dtype) if fused else None)
    if grad_output.numel() == 0 or value.numel() == 0:
        grad_value = torch.zeros_like(value)
        grad_locations.zero_()
        grad_weights.zero_()
        grad_reference = torch.zeros_like(reference_points) if fused else None
        return grad_value, grad_locations, grad_weights, grad_reference

    num_entries = batch * num_queries * num_heads * num_levels * num_points * 4
    if deterministic:
        grad_value_accum = None
        entry_keys = torch.empty(num_entries, device=value.device, dtype=torch.int64)
        entry_coefs = torch.empty(num_entries, device=value.device, dtype=buffer_dtype)
    else:
        # Atomics accumulate into float32 (or float64) whatever value's dtype; written in place when they match.
        grad_value_accum = torch.zeros(value.shape, device=value.device, dtype=buffer_dtype)
        entry_keys = entry_coefs = None

    shapes, starts = _level_tables(spatial_shapes, level_start_index, value.device)
    config = config or choose_config(head_dim, num_queries, backward=True)
    grid = (triton.cdiv(num_queries, config.block_q), num_heads, batch)
    placeholder = grad_locations  # stands for pointer arguments a variant does not use
    with _device_guard(value):
        msda_backward_kernel[grid](
            grad_output, value, shapes, starts, sampling_locations, attention_weights, reference,
            grad_value_accum if grad_value_accum is not None else placeholder,
            grad_locations, grad_weights,
            grad_ref_per_head if fused else placeholder,
            entry_keys if deterministic else placeholder,
            entry_coefs if deterministic else placeholder,
            num_keys, num_queries, num_heads, head_dim,
            NUM_LEVELS=num_levels, NUM_POINTS=num_points, REF_DIM=ref_dim, FUSED=fused,
            DETERMINISTIC=deterministic, BLOCK_Q=config.block_q, BLOCK_D=config.block_d,
            BLOCK_LP=_softmax_block(num_levels, num_points), ACC_DTYPE=_accumulator_dtype(value),
            num_warps=config.num_warps, num_stages=config.num_stages)
        if deterministic:
            grad_value = _reduce_grad_value_segments(grad_output, entry_keys, entry_coefs, value, config.block_d,
                                                     num_levels * num_points * 4)
        else:
            grad_value = grad_value_accum.to(value.dtype)
    grad_reference = grad_ref_per_head.sum(2).to(reference_points.dtype) if fused else None
    return grad_value, grad_locations, grad_weights, grad_reference


def _reduce_grad_value_segments(grad_output: torch.Tensor, entry_keys: torch.Tensor, entry_coefs: torch.Tensor,
                                value: torch.Tensor, block_d: int, entries_per_query_row: int) -> torch.Tensor:
    # Rows are value's (b, s, h) rows; entries that touch no row carry key -1 and sort before row 0.
    num_rows = value.shape[0] * value.shape[1] * value.shape[2]
    sorted_keys, order = torch.sort(entry_keys, stable=True)
    bounds = torch.searchsorted(sorted_keys, torch.arange(num_rows + 1, device=value.device, dtype=torch.int64))
    grad_value = torch.empty_like(value)
    if num_rows == 0:
        return grad_value
    msda_grad_value_segments_kernel[(num_rows,)](
        grad_output, order, bounds, entry_coefs, grad_value, value.shape[3], entries_per_query_row,
        BLOCK_E=_SEGMENT_BLOCK_E, BLOCK_D=block_d, ACC_DTYPE=_accumulator_dtype(value), num_warps=1)
    return grad_value
