"""The Triton MSDA kernels as ``torch.library`` custom ops, with fake implementations and registered autograd.

Registering them lets ``torch.compile(fullgraph=True)`` trace a module that calls the op: the compiler sees one opaque
op with known output shapes instead of a graph break. Plain eager calls skip the custom-op dispatcher (its Python
overhead dominated small calls) through ``autograd.Function``s that run the very same launchers.

Dtypes: ``value`` may be float16, bfloat16, float32 or float64 storage; locations, weights (and the fused path's
reference points, offsets and logits) may each have any of these dtypes, as they arrive under ``torch.autocast``
(value from a half-precision Linear, locations in float32). The kernels load each in its own dtype and compute
coordinates, interpolation weights and accumulation in float32 (float64 for float64 values). The output has value's
dtype; each gradient has its input's dtype.
"""
from __future__ import annotations

from typing import Tuple

import torch

from . import triton_launch

__all__ = ["fused_multi_scale_deformable_attn_triton", "multi_scale_deformable_attn_triton"]

_LIBRARY = "deform_plugin"


def _contiguous_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


# ---- plain op: locations and weights ----------------------------------------------------------------------------

@torch.library.custom_op(f"{_LIBRARY}::msda_forward", mutates_args=())
def _msda_forward_op(value: torch.Tensor, spatial_shapes: torch.Tensor, level_start_index: torch.Tensor,
                     sampling_locations: torch.Tensor, attention_weights: torch.Tensor) -> torch.Tensor:
    return triton_launch.msda_forward(value, spatial_shapes, level_start_index, sampling_locations,
                                      attention_weights)


@_msda_forward_op.register_fake
def _(value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    batch, _, num_heads, head_dim = value.shape
    return value.new_empty((batch, sampling_locations.shape[1], num_heads * head_dim))


@torch.library.custom_op(f"{_LIBRARY}::msda_backward", mutates_args=())
def _msda_backward_op(grad_output: torch.Tensor, value: torch.Tensor, spatial_shapes: torch.Tensor,
                      level_start_index: torch.Tensor, sampling_locations: torch.Tensor,
                      attention_weights: torch.Tensor, deterministic: bool
                      ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return triton_launch.msda_backward(grad_output, value, spatial_shapes, level_start_index, sampling_locations,
                                       attention_weights, deterministic=deterministic)


@_msda_backward_op.register_fake
def _(grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights, deterministic):
    return _contiguous_like(value), _contiguous_like(sampling_locations), _contiguous_like(attention_weights)


def _save_inputs(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _msda_autograd_backward(ctx, grad_output):
    value, spatial_shapes, level_start_index, sampling_locations, attention_weights = ctx.saved_tensors
    grad_value, grad_locations, grad_weights = _msda_backward_op(
        grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
        torch.are_deterministic_algorithms_enabled())
    return grad_value, None, None, grad_locations, grad_weights


_msda_forward_op.register_autograd(_msda_autograd_backward, setup_context=_save_inputs)


class _EagerMSDA(torch.autograd.Function):
    """The same forward and backward as the registered op, for eager mode only.

    A ``torch.library`` custom op costs a few hundred microseconds of Python per call on the host (dispatch,
    autograd wrapper, dynamo-disable guard): measured on an H200, the decoder's forward+backward (Q=900) spent
    ~1 ms on the host for ~0.1 ms of GPU work. Eager calls take this thin path; traced code takes the custom ops.
    """

    @staticmethod
    def forward(ctx, value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
        ctx.save_for_backward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
        return triton_launch.msda_forward(value, spatial_shapes, level_start_index, sampling_locations,
                                          attention_weights)

    @staticmethod
    def backward(ctx, grad_output):
        value, spatial_shapes, level_start_index, sampling_locations, attention_weights = ctx.saved_tensors
        grad_value, grad_locations, grad_weights = triton_launch.msda_backward(
            grad_output, value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
            deterministic=torch.are_deterministic_algorithms_enabled())
        return grad_value, None, None, grad_locations, grad_weights


# ---- fused op: reference points, offsets and logits ---------------------------------------------------------------

@torch.library.custom_op(f"{_LIBRARY}::fused_msda_forward", mutates_args=())
def _fused_msda_forward_op(value: torch.Tensor, spatial_shapes: torch.Tensor, level_start_index: torch.Tensor,
                           reference_points: torch.Tensor, sampling_offsets: torch.Tensor,
                           attention_logits: torch.Tensor) -> torch.Tensor:
    return triton_launch.fused_msda_forward(value, spatial_shapes, level_start_index, reference_points,
                                            sampling_offsets, attention_logits)


@_fused_msda_forward_op.register_fake
def _(value, spatial_shapes, level_start_index, reference_points, sampling_offsets, attention_logits):
    batch, _, num_heads, head_dim = value.shape
    return value.new_empty((batch, sampling_offsets.shape[1], num_heads * head_dim))


@torch.library.custom_op(f"{_LIBRARY}::fused_msda_backward", mutates_args=())
def _fused_msda_backward_op(grad_output: torch.Tensor, value: torch.Tensor, spatial_shapes: torch.Tensor,
                            level_start_index: torch.Tensor, reference_points: torch.Tensor,
                            sampling_offsets: torch.Tensor, attention_logits: torch.Tensor, deterministic: bool
                            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return triton_launch.fused_msda_backward(grad_output, value, spatial_shapes, level_start_index, reference_points,
                                             sampling_offsets, attention_logits, deterministic=deterministic)


@_fused_msda_backward_op.register_fake
def _(grad_output, value, spatial_shapes, level_start_index, reference_points, sampling_offsets, attention_logits,
      deterministic):
    return tuple(_contiguous_like(t) for t in (value, reference_points, sampling_offsets, attention_logits))


def _fused_autograd_backward(ctx, grad_output):
    value, spatial_shapes, level_start_index, reference_points, sampling_offsets, attention_logits = ctx.saved_tensors
    grad_value, grad_reference, grad_offsets, grad_logits = _fused_msda_backward_op(
        grad_output, value, spatial_shapes, level_start_index, reference_points, sampling_offsets, attention_logits,
        torch.are_deterministic_algorithms_enabled())
    return grad_value, None, None, grad_reference, grad_offsets, grad_logits


_fused_msda_forward_op.register_autograd(_fused_autograd_backward, setup_context=_save_inputs)


class _EagerFusedMSDA(torch.autograd.Function):
    """The fused op's forward and backward for eager mode (see :class:`_EagerMSDA` for why)."""

    @staticmethod
    def forward(ctx, value, spatial_shapes, level_start_index, reference_points, sampling_offsets, attention_logits):
        ctx.save_for_backward(value, spatial_shapes, level_start_index, reference_points, sampling_offsets,
                              attention_logits)
        return triton_launch.fused_msda_forward(value, spatial_shapes, level_start_index, reference_points,
                                                sampling_offsets, attention_logits)

    @staticmethod
    def backward(ctx, grad_output):
        grads = triton_launch.fused_msda_backward(grad_output, *ctx.saved_tensors,
                                                  deterministic=torch.are_deterministic_algorithms_enabled(),
                                                  reference_grad=ctx.needs_input_grad[3])
        grad_value, grad_reference, grad_offsets, grad_logits = grads
        return grad_value, None, None, grad_reference, grad_offsets, grad_logits


# ---- entry points -----------------------------------------------------------------------------------------------

def _eager(*tensors: torch.Tensor) -> bool:
    # Tensor subclasses (FakeTensor, functional tensors of torch.compile's tracing) need the registered ops.
    return not torch.compiler.is_compiling() and not any(
        type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter) for t in tensors)


def _needs_grad(*tensors: torch.Tensor) -> bool:
    # Without it the autograd function's bookkeeping is host time for nothing (inference, frozen inputs).
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def multi_scale_deformable_attn_triton(value: torch.Tensor, spatial_shapes: torch.Tensor,
                                       level_start_index: torch.Tensor, sampling_locations: torch.Tensor,
                                       attention_weights: torch.Tensor) -> torch.Tensor:
    """Triton MSDA on validated inputs (see :func:`deform_plugin.ops.multi_scale_deformable_attn` for shapes).

    Differentiable in value, sampling_locations and attention_weights; deterministic backward under
    ``torch.use_deterministic_algorithms(True)``. Returns ``(B, Q, H*D)`` in value's dtype.
    """
    if _eager(value, sampling_locations, attention_weights):
        if not _needs_grad(value, sampling_locations, attention_weights):
            return triton_launch.msda_forward(value, spatial_shapes, level_start_index, sampling_locations,
                                              attention_weights)
        return _EagerMSDA.apply(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    return _msda_forward_op(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)


def fused_multi_scale_deformable_attn_triton(value: torch.Tensor, spatial_shapes: torch.Tensor,
                                             level_start_index: torch.Tensor, reference_points: torch.Tensor,
                                             sampling_offsets: torch.Tensor,
                                             attention_logits: torch.Tensor) -> torch.Tensor:
    """Triton MSDA from raw predictions: softmax over L*P of ``attention_logits`` and mmcv's location arithmetic
    (``reference_points`` ``(B, Q, L, 2)`` points or ``(B, Q, L, 4)`` boxes plus ``sampling_offsets``) run inside the
    kernels. Differentiable in value, reference_points, sampling_offsets and attention_logits."""
    if _eager(value, reference_points, sampling_offsets, attention_logits):
        if not _needs_grad(value, reference_points, sampling_offsets, attention_logits):
            return triton_launch.fused_msda_forward(value, spatial_shapes, level_start_index, reference_points,
                                                    sampling_offsets, attention_logits)
        return _EagerFusedMSDA.apply(value, spatial_shapes, level_start_index, reference_points, sampling_offsets,
                                     attention_logits)
    return _fused_msda_forward_op(value, spatial_shapes, level_start_index, reference_points, sampling_offsets,
                                  attention_logits)
