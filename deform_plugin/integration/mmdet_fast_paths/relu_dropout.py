"""The ``relu_dropout_fusion`` fast path: mmcv ``FFN``'s ReLU and dropout keep one activation for backward, not three.

mmcv's ``FFN`` runs ``Linear -> ReLU(inplace) -> Dropout -> Linear -> Dropout``. For the backward, autograd keeps
the ReLU's output (its backward masks by it), the dropout's boolean mask and the dropout's output (the second
Linear's input): 2 + 1 + 2 bytes per hidden element in 16-bit, 4 + 1 + 4 in float32. With Deformable-DETR's
dropout of 0.1, 1024 hidden channels and ~44k encoder queries of a batch of two 800x1333 images, the first two are
~0.8 GB over the six encoder layers in bf16. The gradient of ``dropout(relu(x))`` is the incoming gradient times
the dropout's scale where the output is positive and zero elsewhere: the output is positive exactly where the
dropout kept the element and ``relu(x) > 0`` (scaling a positive number by ``1 / (1 - p) > 1`` cannot round to
zero, and NaN compares false as ReLU's backward does). So the output, which the next Linear keeps anyway, is all
the backward needs.

The forward calls ``F.relu`` and ``F.dropout`` as the stock modules do: the same output and the same random draws.
The backward computes the gradient with the operation stock's dropout backward uses, with the kept mask read off
the output, so it equals stock's ReLU-after-dropout backward bitwise (a zero may differ in sign): CUDA's fused
dropout kernel is differentiated by ``native_dropout_backward`` with the scale in float64, elsewhere dropout is a
product with a noise tensor of the input's dtype. Dropouts of probability 0 or 1, other activations and eval mode
are left to the stock modules (nothing to save or nothing to fuse).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _dropout_is_fused(x: torch.Tensor, p: float) -> bool:
    """Whether ``F.dropout`` runs ATen's fused kernel (``native_dropout``) for ``x``: ATen's own predicate."""
    return (x.is_cuda or x.device.type in ("xpu", "lazy", "privateuseone")) and 0.0 < p < 1.0 and x.numel() > 0


class _ReLUDropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float) -> torch.Tensor:
        out = F.dropout(F.relu(x), p, True)
        ctx.save_for_backward(out)
        ctx.p = p
        ctx.fused = _dropout_is_fused(x, p)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        (out,) = ctx.saved_tensors
        kept = out > 0
        if ctx.fused:
            return torch.ops.aten.native_dropout_backward(grad, kept, 1.0 / (1.0 - ctx.p)), None
        return grad * kept.to(grad.dtype).div_(1.0 - ctx.p), None


class ReLUDropout(nn.Module):
    """``Dropout(p)(ReLU()(x))`` whose backward keeps only the output (see the module docstring)."""

    def __init__(self, p: float):
        super().__init__()
        if not 0.0 < p < 1.0:
            raise ValueError(f"ReLUDropout: p must lie strictly between 0 and 1, got {p!r}")
        self.p = float(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled() and x.requires_grad:
            return _ReLUDropout.apply(x, self.p)
        return F.dropout(F.relu(x), self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"


def _fusable_block(block: nn.Module) -> bool:
    # FFN's hidden blocks: Sequential(Linear, activation, Dropout); only a plain ReLU with a dropout that draws.
    return (isinstance(block, nn.Sequential) and len(block) == 3 and type(block[1]) is nn.ReLU
            and type(block[2]) is nn.Dropout and 0.0 < block[2].p < 1.0)


def enable_relu_dropout_fusion(model: nn.Module) -> int:
    """In every mmcv ``FFN`` of ``model``, replace each hidden block's ``ReLU, Dropout(p)`` (0 < p < 1) by
    ``ReLUDropout(p), Identity``; parameters and state-dict keys do not change (neither module has any). Returns
    the number of blocks changed."""
    from mmcv.cnn.bricks.transformer import FFN
    changed = 0
    for module in model.modules():
        if not isinstance(module, FFN):
            continue
        for block in module.layers:
            if _fusable_block(block):
                block[1] = ReLUDropout(block[2].p)
                block[2] = nn.Identity()
                changed += 1
    return changed
