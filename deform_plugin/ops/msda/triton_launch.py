"""Host launchers of the MSDA Triton kernels: make inputs contiguous, allocate, choose blocks, launch.

They take tensors that :mod:`.checks` already accepted and do no host synchronisation (the level tables stay on the
device and are read by the kernels), so they can run inside a ``torch.compile``'d graph as the body of a custom op
and inside a CUDA-graph capture. Each launch runs under :func:`~deform_plugin.ops.triton_support.launch_device`.

Two entry points per direction: the plain op takes sampling locations and attention weights; the fused op takes
reference points, sampling offsets and attention logits, and the kernels derive locations and weights themselves.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import triton.language as tl

from ..triton_support import DirectLaunches, alignment_bits, data_pointers, launch_device, next_power_of_2
from .triton_kernels import msda_backward_kernel, msda_forward_kernel, msda_grad_value_segments_kernel

# Entries of the deterministic grad_value reduction handled per step of its loop.
_SEGMENT_BLOCK_E = 16
_INT32_MAX = 2 ** 31 - 1
# Tensors of at most this many elements index in int32: the kernels' offsets stay within a few rows of a tensor's
# extent (masked lanes, corners just outside a level), far below 2^31.
_INT32_INDEX_MAX_NUMEL = 2 ** 30

_forward_launches = DirectLaunches(msda_forward_kernel)
_backward_launches = DirectLaunches(msda_backward_kernel)


@dataclass(frozen=True)
class LaunchConfig:
    """Block sizes of one launch: queries per program, padded head_dim, warps, pipelining stages."""

    block_q: int
    block_d: int
    num_warps: int
    num_stages: int = 1


@functools.lru_cache(maxsize=None)
def choose_config(head_dim: int, block_q: Optional[int] = None, num_warps: Optional[int] = None) -> LaunchConfig:
    """Blocks of about 256 elements ([8 queries x 32 channels] at head_dim 32), one warp, with overrides for tuning.

    Small programs win (docs/kernels.md, notes 2, 8 and 11): many resident programs keep more independent gathers
    and atomics in flight than a large tile per program does. On an H100, 8 x 32 with one warp was the fastest
    configuration of the sweep in both directions, plain and fused, fp32 and bf16 (the backward 4-8% faster than
    16 x 32 with 2 warps); 128 x 32 tiles were 1.2-2x slower. Register caps (``maxnreg`` 64-96) did not help.
    The blocks depend on head_dim only, never on the query count: a new image size must not compile a new variant.
    """
    block_d = next_power_of_2(head_dim)
    if block_q is None:
        block_q = max(1, 256 // block_d)
    if num_warps is None:
        num_warps = max(1, min(8, block_q * block_d // 256))
    return LaunchConfig(block_q=block_q, block_d=block_d, num_warps=num_warps)


def _accumulator_dtype(value: torch.Tensor):
    return tl.float64 if value.dtype == torch.float64 else tl.float32


def _index_dtype(value: torch.Tensor, samples: torch.Tensor, output: torch.Tensor):
    # The largest tensors a launch indexes: value (and grad_value), the output (or its gradient), and the
    # per-sample ones (locations; the deterministic backward's per-corner entries, twice as many).
    largest = max(value.numel(), output.numel(), 2 * samples.numel())
    return tl.int32 if largest <= _INT32_INDEX_MAX_NUMEL else tl.int64


def _grad_value_buffer_dtype(value: torch.Tensor) -> torch.dtype:
    return torch.float64 if value.dtype == torch.float64 else torch.float32


def _level_tables(spatial_shapes: torch.Tensor, level_start_index: torch.Tensor, device: torch.device):
    return (spatial_shapes.to(device=device).contiguous(), level_start_index.to(device=device).contiguous())


def _variant(device, config, tensors, pointers, num_heads, head_dim, sizes, constexprs):
    """What selects the compiled variant of a launch (see :class:`DirectLaunches`): the tensors' dtypes and pointer
    alignment, the specialised integers (heads, head_dim), whether the unspecialised ones (keys, queries) fit 32
    bits, the constexprs and the launch options."""
    return (device.index, config, tuple([t.dtype for t in tensors]), alignment_bits(pointers), num_heads,
            head_dim, max(sizes) <= _INT32_MAX, constexprs)


def _launch(launches: DirectLaunches, grid, config, tensors, num_keys, num_queries, num_heads, head_dim, constexprs):
    device = tensors[0].device
    pointers = data_pointers(tensors)
    launches.launch(grid, _variant(device, config, tensors, pointers, num_heads, head_dim, (num_keys, num_queries),
                                   constexprs),
                    device, tensors, pointers, (num_keys, num_queries, num_heads, head_dim) + constexprs,
                    num_warps=config.num_warps, num_stages=config.num_stages)


def msda_forward(value: torch.Tensor, spatial_shapes: torch.Tensor, level_start_index: torch.Tensor,
                 sampling_locations: torch.Tensor, attention_weights: torch.Tensor,
                 config: Optional[LaunchConfig] = None) -> torch.Tensor:
    """Forward of the plain op. Returns ``(B, Q, H*D)`` in the dtype of ``value``."""
    return _forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights, None, config)


def fused_msda_forward(value: torch.Tensor, spatial_shapes: torch.Tensor, level_start_index: torch.Tensor,
                       reference_points: torch.Tensor, sampling_offsets: torch.Tensor,
                       attention_logits: torch.Tensor, config: Optional[LaunchConfig] = None) -> torch.Tensor:
    """Forward of the fused op (softmax of the logits and location arithmetic in the kernel)."""
    return _forward(value, spatial_shapes, level_start_index, sampling_offsets, attention_logits,
                    reference_points.contiguous(), config)


def _forward(value, spatial_shapes, level_start_index, samples, sample_weights, reference_points, config):
    # samples / sample_weights: locations and weights, or (fused, with reference_points) offsets and logits.
    value = value.contiguous()
    samples = samples.contiguous()
    sample_weights = sample_weights.contiguous()
    batch, num_keys, num_heads, head_dim = value.shape
    _, num_queries, _, num_levels, num_points, _ = samples.shape
    output = torch.empty((batch, num_queries, num_heads * head_dim), device=value.device, dtype=value.dtype)
    if output.numel() == 0:
        return output.zero_()
    shapes, starts = _level_tables(spatial_shapes, level_start_index, value.device)
    fused = reference_points is not None
    config = config or choose_config(head_dim)
    grid = (-(-num_queries // config.block_q), num_heads, batch)  # triton.cdiv is a slow host call
    tensors = (value, shapes, starts, samples, sample_weights, reference_points if fused else samples, output)
    constexprs = (num_levels, num_points, reference_points.shape[-1] if fused else 2, fused, config.block_q,
                  config.block_d, next_power_of_2(num_levels * num_points), _accumulator_dtype(value),
                  _index_dtype(value, samples, output))
    with launch_device(value):
        _launch(_forward_launches, grid, config, tensors, num_keys, num_queries, num_heads, head_dim, constexprs)
    return output


def msda_backward(grad_output: torch.Tensor, value: torch.Tensor, spatial_shapes: torch.Tensor,
                  level_start_index: torch.Tensor, sampling_locations: torch.Tensor,
                  attention_weights: torch.Tensor, deterministic: bool = False,
                  config: Optional[LaunchConfig] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of the plain op: ``(grad_value, grad_sampling_locations, grad_attention_weights)``."""
    grad_value, grad_locations, grad_weights, _ = _backward(
        grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights, None,
        deterministic, config)
    return grad_value, grad_locations, grad_weights


def fused_msda_backward(grad_output: torch.Tensor, value: torch.Tensor, spatial_shapes: torch.Tensor,
                        level_start_index: torch.Tensor, reference_points: torch.Tensor,
                        sampling_offsets: torch.Tensor, attention_logits: torch.Tensor, deterministic: bool = False,
                        config: Optional[LaunchConfig] = None, reference_grad: bool = True
                        ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Backward of the fused op: ``(grad_value, grad_reference_points, grad_sampling_offsets,
    grad_attention_logits)``; ``grad_reference_points`` is None without ``reference_grad`` (the DETRs' reference
    points are constants or detached: the kernel then stores no per-head gradient and nothing sums it)."""
    grad_value, grad_offsets, grad_logits, grad_reference = _backward(
        grad_output, value, spatial_shapes, level_start_index, sampling_offsets, attention_logits,
        reference_points.contiguous(), deterministic, config, reference_grad)
    return grad_value, grad_reference, grad_offsets, grad_logits


def _backward(grad_output, value, spatial_shapes, level_start_index, samples, sample_weights, reference_points,
              deterministic, config, reference_grad=True):
    """Gradients of value, samples, sample weights (and reference points when fused), each in its input's dtype.

    ``grad_value`` is accumulated with float32 atomics (float64 for float64 values), or, with ``deterministic``,
    without atomics: each (sample, corner) writes its grad_value row and coefficient, a stable sort groups them by
    row, and one program per row sums its entries in a fixed order, so the result is bit-identical between runs.
    """
    value = value.contiguous()
    samples = samples.contiguous()
    sample_weights = sample_weights.contiguous()
    grad_output = grad_output.contiguous()
    batch, num_keys, num_heads, head_dim = value.shape
    _, num_queries, _, num_levels, num_points, _ = samples.shape
    fused = reference_points is not None
    ref_dim = reference_points.shape[-1] if fused else 2
    reference_grad = fused and reference_grad

    grad_samples = torch.empty_like(samples)
    buffer_dtype = _grad_value_buffer_dtype(value)
    grad_sample_weights = torch.empty_like(sample_weights)
    grad_ref_per_head = (torch.empty((batch, num_queries, num_heads, num_levels, ref_dim), device=value.device,
                                     dtype=buffer_dtype) if reference_grad else None)
    if grad_output.numel() == 0 or value.numel() == 0:
        grad_reference = torch.zeros_like(reference_points) if reference_grad else None
        return torch.zeros_like(value), grad_samples.zero_(), torch.zeros_like(sample_weights), grad_reference

    if fused:
        # Per-sample gradients, queries fastest, until the kernel's softmax backward (see the kernel). The weights'
        # stay in float32 (or float64): that subtraction cancels.
        weight_scratch = torch.empty((batch, num_heads, num_levels * num_points, num_queries), device=value.device,
                                     dtype=buffer_dtype)
        offset_scratch = torch.empty((batch, num_heads, num_levels * num_points, 2, num_queries),
                                     device=value.device, dtype=samples.dtype)

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
    config = config or choose_config(head_dim)
    grid = (-(-num_queries // config.block_q), num_heads, batch)  # triton.cdiv is a slow host call
    unused = grad_samples  # stands for pointer arguments a variant does not use
    tensors = (grad_output, value, shapes, starts, samples, sample_weights, reference_points if fused else samples,
               grad_value_accum if grad_value_accum is not None else unused, grad_samples, grad_sample_weights,
               grad_ref_per_head if reference_grad else unused, entry_keys if deterministic else unused,
               entry_coefs if deterministic else unused, weight_scratch if fused else unused,
               offset_scratch if fused else unused)
    constexprs = (num_levels, num_points, ref_dim, fused, deterministic, config.block_q, config.block_d,
                  next_power_of_2(num_levels * num_points), _accumulator_dtype(value),
                  _index_dtype(value, samples, grad_output), reference_grad)
    with launch_device(value):
        _launch(_backward_launches, grid, config, tensors, num_keys, num_queries, num_heads, head_dim, constexprs)
        if deterministic:
            grad_value = _reduce_grad_value_segments(grad_output, entry_keys, entry_coefs, value, config.block_d,
                                                     num_levels * num_points * 4)
        else:
            grad_value = grad_value_accum.to(value.dtype)
    grad_reference = grad_ref_per_head.sum(2).to(reference_points.dtype) if reference_grad else None
    return grad_value, grad_samples, grad_sample_weights, grad_reference


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
