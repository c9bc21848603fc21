"""Less activation memory in mmcv's ``FFN``: the ``relu_dropout_fusion`` and ``ffn_recompute`` fast paths.

``relu_dropout_fusion``: the ReLU and dropout of an FFN keep one activation for backward instead of three. mmcv's
``FFN`` runs ``Linear -> ReLU(inplace) -> Dropout -> Linear -> Dropout``. For the backward, autograd keeps the
ReLU's output (its backward masks by it), the dropout's mask (bool from CUDA's fused kernel, a noise tensor of the
input's dtype elsewhere) and the dropout's output (the second Linear's input): 2 + 1 + 2 bytes per hidden element in
16-bit on CUDA. With Deformable-DETR's dropout of 0.1, 1024 hidden channels and ~44k encoder queries of a batch of
two 800x1333 images, the first two are ~0.8 GB over the six encoder layers in bf16 (an estimate). The gradient of
``dropout(relu(x))`` is the incoming gradient times the dropout's scale where the output is positive and zero
elsewhere: the output is positive exactly where the dropout kept the element and ``relu(x) > 0`` (scaling a positive
number by ``1 / (1 - p) > 1`` cannot round to zero, and NaN compares false as ReLU's backward does). So the output,
which the next Linear keeps anyway, is all the backward needs.

The forward calls ``F.relu`` and ``F.dropout`` as the stock modules do: the same output and the same random draws.
The backward computes the gradient with the operation stock's dropout backward uses, with the kept mask read off the
output, so it equals the stock backward of the dropout and then the ReLU bitwise (a zero may differ in sign): CUDA's
fused dropout kernel is differentiated by ``native_dropout_backward`` with the scale in float64, elsewhere dropout
is a product with a noise tensor of the input's dtype. Dropouts of probability 0 or 1, other activations and eval
mode are left to the stock modules (nothing to save or nothing to fuse).

``ffn_recompute``: an FFN whose dropouts draw nothing (probability 0: DINO's, Mask2Former's) keeps only its input
for the backward and recomputes its hidden layer there (``torch.utils.checkpoint``, non-reentrant). Its hidden
activation (2048 channels in DINO's encoder: ~1.1 GB over six layers of ~44k queries in bf16, an estimate) is not
kept; the price is the FFN's two matmuls run again in the backward. The recomputation runs the same kernels on the
same values, so outputs and gradients are stock's bitwise; with no random draw inside, no generator state needs
restoring (which a CUDA-graph capture would not allow).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


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


def _draws_nothing(module: nn.Module) -> bool:
    # Dropouts of probability 0 return their input; ReLUDropout always draws (0 < p < 1).
    return not isinstance(module, ReLUDropout) and not (isinstance(module, nn.Dropout) and module.p > 0)


@functools.lru_cache(maxsize=None)
def recomputed_ffn_class():
    """The recomputing subclass of mmcv's ``FFN`` (made on first use, after mmcv is importable; one class)."""
    from mmcv.cnn.bricks.transformer import FFN

    class RecomputedFFN(FFN):
        """mmcv's ``FFN`` that keeps only its input for the backward and recomputes its hidden layers there."""

        def forward(self, x, identity=None):
            # mmcv's FFN.forward line for line, with self.layers under a checkpoint while training.
            if self.training and torch.is_grad_enabled():
                out = checkpoint(self.layers, x, use_reentrant=False, preserve_rng_state=False)
            else:
                out = self.layers(x)
            out = self.gamma2(out)
            if not self.add_identity:
                return self.dropout_layer(out)
            if identity is None:
                identity = x
            return identity + self.dropout_layer(out)

    RecomputedFFN.__qualname__ = "RecomputedFFN"
    return RecomputedFFN


def enable_ffn_recompute(model: nn.Module) -> int:
    """Switch every stock mmcv ``FFN`` of ``model`` whose layers draw no random numbers to
    :func:`recomputed_ffn_class` (the instance's class only: parameters and state-dict keys stay). Returns the number
    of FFNs switched."""
    from mmcv.cnn.bricks.transformer import FFN
    switched = 0
    for module in model.modules():
        if type(module) is FFN and all(_draws_nothing(layer) for layer in module.layers.modules()):
            module.__class__ = recomputed_ffn_class()
            switched += 1
    return switched
