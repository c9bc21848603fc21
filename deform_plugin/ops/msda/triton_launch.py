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
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
import triton.language as tl

from ..triton_support import DirectLaunches, alignment_bits, data_pointers, device_of_launch, next_power_of_2
from .triton_kernels import msda_backward_kernel, msda_forward_kernel, msda_grad_value_segments_kernel

__all__ = ["KernelLaunch", "LaunchConfig", "choose_config", "fused_msda_backward", "fused_msda_forward",
           "msda_backward", "msda_forward", "recorded_fused_launches"]

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


# Bytes of a corner row that one thread of the forward loads at once (one 16-byte vector load per row).
_FORWARD_BYTES_PER_THREAD_ROW = 16
_WARP_THREADS = 32


@functools.lru_cache(maxsize=None)
def choose_config(head_dim: int, block_q: Optional[int] = None, num_warps: Optional[int] = None,
                  forward_element_size: Optional[int] = None) -> LaunchConfig:
    """Blocks of about 256 elements ([8 queries x 32 channels] at head_dim 32), one warp, with overrides for tuning;
    the forward (``forward_element_size``: value's bytes per element) takes fewer queries where a 256-element tile
    would give each thread more than one 16-byte load per corner row: 4 x 32 in float32.

    Small programs win (docs/kernels.md, notes 2, 8, 11 and 17): many resident programs keep more independent
    gathers and atomics in flight than a large tile per program does. On an H100, 8 x 32 with one warp was the
    fastest configuration of the sweep in both directions, plain and fused, fp32 and bf16 (the backward 4-8% faster
    than 16 x 32 with 2 warps); 128 x 32 tiles were 1.2-2x slower. Register caps (``maxnreg`` 64-96) did not help.
    The float32 forward then ran faster still with 4 x 32 (encoder 5-10%, decoder-sized calls 35%), where each
    thread loads one 16-byte vector per row; in 16-bit 4 x 32 halves those loads to 8 bytes and was slower (note 6).
    The blocks depend on head_dim and dtype only, never on the query count: a new image size must not compile a
    new variant.
    """
    block_d = next_power_of_2(head_dim)
    if block_q is None:
        block_q = max(1, 256 // block_d)
        if forward_element_size is not None:
            one_load_per_row = _WARP_THREADS * _FORWARD_BYTES_PER_THREAD_ROW // (block_d * forward_element_size)
            block_q = max(1, min(block_q, one_load_per_row))
    if num_warps is None:
        num_warps = max(1, min(8, block_q * block_d // 256))
    return LaunchConfig(block_q=block_q, block_d=block_d, num_warps=num_warps)


def _accumulator_dtype(value: torch.Tensor):
    return tl.float64 if value.dtype == torch.float64 else tl.float32


def _index_dtype(value_numel: int, samples_numel: int, output_numel: int):
    # The largest tensors a launch indexes: value (and grad_value), the output (or its gradient), and the
    # per-sample ones (locations; the deterministic backward's per-corner entries, twice as many).
    return tl.int32 if max(value_numel, output_numel, 2 * samples_numel) <= _INT32_INDEX_MAX_NUMEL else tl.int64


def _level_tables(spatial_shapes: torch.Tensor, level_start_index: torch.Tensor, device: torch.device):
    return (spatial_shapes.to(device=device).contiguous(), level_start_index.to(device=device).contiguous())


class _LaunchPlan(NamedTuple):
    """What a launch derives from its inputs' shapes, dtypes and device: computed once per signature and kept, so
    that a repeated call (every layer of every step) spends its host time on allocation and the launch alone."""

    grid: Tuple[int, int, int]
    scalars: tuple       # num_keys, num_queries, num_heads, head_dim, then the kernel's constexprs
    variant: tuple       # what selects the compiled variant, but the pointers' alignment (see DirectLaunches)
    device: torch.device
    config: LaunchConfig
    empty: bool          # nothing to launch (no query, or value is empty)


# Distinct call signatures kept (a training run with random resizing meets a few hundred encoder sizes).
_PLANS_KEPT = 1024
_plans: Dict[tuple, _LaunchPlan] = {}


def _make_plan(key: tuple, value: torch.Tensor, samples: torch.Tensor, output_numel: int,
               config: Optional[LaunchConfig], constexprs_before_blocks: tuple,
               constexprs_after_blocks: tuple) -> _LaunchPlan:
    """The plan of ``key`` at its first call, kept for the next. The variant holds the key's dtypes and flags
    (which decide every tensor's dtype), the specialised integers (heads, head_dim), whether the unspecialised ones
    (keys, queries) fit 32 bits, the constexprs and the launch options."""
    batch, num_keys, num_heads, head_dim = value.shape
    _, num_queries, _, num_levels, num_points, _ = samples.shape
    forward = key[0] == "forward"
    config = config or choose_config(head_dim, forward_element_size=value.element_size() if forward else None)
    index_dtype = _index_dtype(value.numel(), samples.numel(), output_numel)
    constexprs = (num_levels, num_points) + constexprs_before_blocks + (
        config.block_q, config.block_d, next_power_of_2(num_levels * num_points), _accumulator_dtype(value),
        index_dtype
    ) + constexprs_after_blocks
    grid = (-(-num_queries // config.block_q), num_heads, batch)  # triton.cdiv is a slow host call
    # The key without its sizes (torch.Size entries): a new image size must not make a new variant.
    dtypes_and_flags = tuple([part for part in key[2:] if not isinstance(part, torch.Size)])
    variant = (key[0], value.device.index, config, dtypes_and_flags, num_heads, head_dim,
               max(num_keys, num_queries) <= _INT32_MAX, constexprs)
    plan = _LaunchPlan(grid, (num_keys, num_queries, num_heads, head_dim) + constexprs, variant, value.device,
                       config, value.numel() == 0 or num_queries == 0)
    if len(_plans) >= _PLANS_KEPT:
        del _plans[next(iter(_plans))]
    _plans[key] = plan
    return plan


def _launch(launches: DirectLaunches, plan: _LaunchPlan, tensors: tuple) -> None:
    pointers = data_pointers(tensors)
    with device_of_launch(plan.device):
        launches.launch(plan.grid, (plan.variant, alignment_bits(pointers)), plan.device, tensors, pointers,
                        plan.scalars, num_warps=plan.config.num_warps, num_stages=plan.config.num_stages)


class KernelLaunch(NamedTuple):
    """One kernel launch's arguments, as ``kernel[grid](*tensors, *scalars, num_warps=..., num_stages=...)``."""

    kernel: object
    grid: Tuple[int, int, int]
    tensors: tuple
    scalars: tuple
    num_warps: int
    num_stages: int


def recorded_fused_launches(value: torch.Tensor, spatial_shapes: torch.Tensor, level_start_index: torch.Tensor,
                            reference_points: torch.Tensor, sampling_offsets: torch.Tensor,
                            attention_logits: torch.Tensor, backward: bool = True,
                            reference_grad: bool = False) -> List[KernelLaunch]:
    """The launches that the fused forward (and, with ``backward``, its backward with a ``grad_output`` in value's
    dtype) of these inputs would make, recorded instead of made: what compiling their variants ahead needs. The
    inputs may be small CPU tensors of the real launch's dtypes (the variant does not depend on sizes, and a
    kernel's pointers are 16-byte aligned on either device). Outputs are allocated but never written."""
    recorded = []

    def record(launches: DirectLaunches, plan: _LaunchPlan, tensors: tuple) -> None:
        recorded.append(KernelLaunch(launches.kernel, plan.grid, tensors, plan.scalars, plan.config.num_warps,
                                     plan.config.num_stages))

    output = _forward(value, spatial_shapes, level_start_index, sampling_offsets, attention_logits,
                      reference_points.contiguous(), None, launch=record)
    if backward:  # the output stands for its gradient: same shape and dtype
        _backward(output, value, spatial_shapes, level_start_index, sampling_offsets, attention_logits,
                  reference_points.contiguous(), False, None, reference_grad, launch=record)
    return recorded


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


def _forward(value, spatial_shapes, level_start_index, samples, sample_weights, reference_points, config,
             launch=_launch):
    # samples / sample_weights: locations and weights, or (fused, with reference_points) offsets and logits.
    # launch: _launch, or a recorder (recorded_fused_launches).
    value = value.contiguous()
    samples = samples.contiguous()
    sample_weights = sample_weights.contiguous()
    fused = reference_points is not None
    key = ("forward", config, value.shape, value.dtype, value.device, samples.shape, samples.dtype,
           sample_weights.dtype, reference_points.shape if fused else None,
           reference_points.dtype if fused else None, spatial_shapes.dtype, level_start_index.dtype)
    plan = _plans.get(key)
    if plan is None:
        output_numel = samples.shape[0] * samples.shape[1] * value.shape[2] * value.shape[3]
        plan = _make_plan(key, value, samples, output_numel, config,
                          (reference_points.shape[-1] if fused else 2, fused), ())
    batch, num_keys, num_heads, head_dim = value.shape
    output = value.new_empty((batch, samples.shape[1], num_heads * head_dim))
    if plan.empty:
        return output.zero_()
    shapes, starts = _level_tables(spatial_shapes, level_start_index, plan.device)
    launch(_forward_launches, plan, (value, shapes, starts, samples, sample_weights,
                                     reference_points if fused else samples, output))
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
              deterministic, config, reference_grad=True, launch=_launch):
    """Gradients of value, samples, sample weights (and reference points when fused), each in its input's dtype.

    ``grad_value`` is accumulated with float32 atomics (float64 for float64 values), or, with ``deterministic``,
    without atomics: each (sample, corner) writes its grad_value row and coefficient, a stable sort groups them by
    row, and one program per row sums its entries in a fixed order, so the result is bit-identical between runs.
    """
    value = value.contiguous()
    samples = samples.contiguous()
    sample_weights = sample_weights.contiguous()
    grad_output = grad_output.contiguous()
    fused = reference_points is not None
    reference_grad = fused and reference_grad
    key = ("backward", config, value.shape, value.dtype, value.device, samples.shape, samples.dtype,
           sample_weights.dtype, reference_points.shape if fused else None,
           reference_points.dtype if fused else None, spatial_shapes.dtype, level_start_index.dtype,
           grad_output.dtype, deterministic, reference_grad)
    plan = _plans.get(key)
    if plan is None:
        plan = _make_plan(key, value, samples, grad_output.numel(), config,
                          (reference_points.shape[-1] if fused else 2, fused, deterministic), (reference_grad,))
    buffer_dtype = torch.float64 if value.dtype == torch.float64 else torch.float32
    grad_samples = torch.empty_like(samples)
    grad_sample_weights = torch.empty_like(sample_weights)
    if plan.empty:
        grad_reference = torch.zeros_like(reference_points) if reference_grad else None
        return torch.zeros_like(value), grad_samples.zero_(), grad_sample_weights.zero_(), grad_reference

    batch, num_keys, num_heads, head_dim = value.shape
    _, num_queries, _, num_levels, num_points, _ = samples.shape
    unused = grad_samples  # stands for pointer arguments a variant does not use
    grad_ref_per_head = weight_scratch = offset_scratch = entry_keys = entry_coefs = unused
    if reference_grad:
        grad_ref_per_head = value.new_empty((batch, num_queries, num_heads, num_levels, reference_points.shape[-1]),
                                            dtype=buffer_dtype)
    if fused:
        # Per-sample gradients, queries fastest, until the kernel's softmax backward (see the kernel). The weights'
        # stay in float32 (or float64): that subtraction cancels.
        weight_scratch = value.new_empty((batch, num_heads, num_levels * num_points, num_queries), dtype=buffer_dtype)
        offset_scratch = samples.new_empty((batch, num_heads, num_levels * num_points, 2, num_queries))
    if deterministic:
        num_entries = batch * num_queries * num_heads * num_levels * num_points * 4
        grad_value_accum = unused
        entry_keys = value.new_empty(num_entries, dtype=torch.int64)
        entry_coefs = value.new_empty(num_entries, dtype=buffer_dtype)
    else:
        # Atomics accumulate into float32 (or float64) whatever value's dtype; written in place when they match.
        grad_value_accum = value.new_zeros(value.shape, dtype=buffer_dtype)

    shapes, starts = _level_tables(spatial_shapes, level_start_index, plan.device)
    tensors = (grad_output, value, shapes, starts, samples, sample_weights, reference_points if fused else samples,
               grad_value_accum, grad_samples, grad_sample_weights, grad_ref_per_head, entry_keys, entry_coefs,
               weight_scratch, offset_scratch)
    launch(_backward_launches, plan, tensors)
    if deterministic:
        with device_of_launch(plan.device):
            grad_value = _reduce_grad_value_segments(grad_output, entry_keys, entry_coefs, value,
                                                     plan.config.block_d, num_levels * num_points * 4)
    else:
        grad_value = grad_value_accum if grad_value_accum.dtype == value.dtype else grad_value_accum.to(value.dtype)
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
