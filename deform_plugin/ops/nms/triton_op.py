"""The Triton backend as a PyTorch custom op, so ``torch.compile`` sees one op with known output shapes, not a graph
break. Plain eager calls skip the custom-op dispatcher and run the very same launcher, as the MSDA op does
(``deform_plugin.ops.msda.triton_op`` says why). The op has no autograd: its outputs are indices and counts.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .triton_launch import greedy_nms_first_kept_launch


@torch.library.custom_op("deform_plugin::greedy_nms_first_kept", mutates_args=())
def greedy_nms_first_kept_op(boxes: torch.Tensor, scores: torch.Tensor, valid: Optional[torch.Tensor],
                             iou_threshold: float, max_kept: int) -> Tuple[torch.Tensor, torch.Tensor]:
    return greedy_nms_first_kept_launch(boxes, scores, valid, iou_threshold, max_kept)


@greedy_nms_first_kept_op.register_fake
def _(boxes, scores, valid, iou_threshold, max_kept):
    batch = scores.shape[0]
    return (scores.new_empty((batch, max_kept), dtype=torch.int64), scores.new_empty((batch,), dtype=torch.int64))


def _eager(*tensors: Optional[torch.Tensor]) -> bool:
    # Tensor subclasses (FakeTensor, functional tensors of torch.compile's tracing) need the registered op.
    return not torch.compiler.is_compiling() and all(t is None or type(t) is torch.Tensor for t in tensors)


def greedy_nms_first_kept_triton(boxes: torch.Tensor, scores: torch.Tensor, valid: Optional[torch.Tensor],
                                 iou_threshold: float, max_kept: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Greedy NMS on Triton; inputs already validated."""
    if _eager(boxes, scores, valid):
        return greedy_nms_first_kept_launch(boxes, scores, valid, float(iou_threshold), int(max_kept))
    return greedy_nms_first_kept_op(boxes, scores, valid, float(iou_threshold), int(max_kept))
