"""The Triton backend as PyTorch custom ops with autograd, so ``torch.compile`` sees one op, not a graph break.

Plain eager calls skip the custom-op dispatcher through an ``autograd.Function`` that runs the very same launchers,
as the MSDA op does (``deform_plugin.ops.msda.triton_op`` says why).
"""
from __future__ import annotations

from typing import Tuple

import torch

from .triton_launch import deform_sdpa_backward, deform_sdpa_forward


@torch.library.custom_op("deform_plugin::deform_sdpa_forward", mutates_args=())
def deform_sdpa_forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, coords: torch.Tensor, width: int,
                           height: int, sm_scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    return deform_sdpa_forward(q, k, v, coords, width, height, sm_scale)


@deform_sdpa_forward_op.register_fake
def _(q, k, v, coords, width, height, sm_scale):
    return (q.new_empty(q.shape), q.new_empty(q.shape[:4], dtype=torch.float32))


@torch.library.custom_op("deform_plugin::deform_sdpa_backward", mutates_args=())
def deform_sdpa_backward_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            coords: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, width: int, height: int,
                            sm_scale: float, coords_grad: bool
                            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return deform_sdpa_backward(grad_out, q, k, v, coords, out, lse, width, height, sm_scale, coords_grad)


@deform_sdpa_backward_op.register_fake
def _(grad_out, q, k, v, coords, out, lse, width, height, sm_scale, coords_grad):
    dcoords = coords.new_empty(coords.shape if coords_grad else (0,))
    return q.new_empty(q.shape), q.new_empty(q.shape), q.new_empty(q.shape), dcoords


def _setup_context(ctx, inputs, output):
    q, k, v, coords, width, height, sm_scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, coords, out, lse)
    ctx.width, ctx.height, ctx.sm_scale = width, height, sm_scale


def _backward(ctx, grad_out, grad_lse):
    # lse is an internal output for the backward; the public entry point never returns it, so grad_lse is unused.
    q, k, v, coords, out, lse = ctx.saved_tensors
    coords_grad = ctx.needs_input_grad[3]
    dq, dk, dv, dcoords = deform_sdpa_backward_op(grad_out, q, k, v, coords, out, lse, ctx.width, ctx.height,
                                                  ctx.sm_scale, coords_grad)
    return dq, dk, dv, (dcoords if coords_grad else None), None, None, None


deform_sdpa_forward_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerDeformSDPA(torch.autograd.Function):
    """The registered op's forward and backward for eager mode only."""

    @staticmethod
    def forward(ctx, q, k, v, coords, width, height, sm_scale):
        out, lse = deform_sdpa_forward(q, k, v, coords, width, height, sm_scale)
        ctx.save_for_backward(q, k, v, coords, out, lse)
        ctx.width, ctx.height, ctx.sm_scale = width, height, sm_scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, coords, out, lse = ctx.saved_tensors
        coords_grad = ctx.needs_input_grad[3]
        dq, dk, dv, dcoords = deform_sdpa_backward(grad_out, q, k, v, coords, out, lse, ctx.width, ctx.height,
                                                   ctx.sm_scale, coords_grad)
        return dq, dk, dv, (dcoords if coords_grad else None), None, None, None


def _eager(*tensors: torch.Tensor) -> bool:
    # Tensor subclasses (FakeTensor, functional tensors of torch.compile's tracing) need the registered op.
    return not torch.compiler.is_compiling() and not any(
        type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter) for t in tensors)


def deform_sdpa_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, coords: torch.Tensor, width: int,
                       height: int, sm_scale: float) -> torch.Tensor:
    """Fused Triton deformable SDPA with autograd for q, k, v and coords; inputs already validated."""
    if _eager(q, k, v, coords):
        return _EagerDeformSDPA.apply(q, k, v, coords, width, height, float(sm_scale))
    out, _ = deform_sdpa_forward_op(q, k, v, coords, width, height, float(sm_scale))
    return out
