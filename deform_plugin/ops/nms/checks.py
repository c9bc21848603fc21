"""Input validation shared by every greedy-NMS backend.

Every backend runs behind :func:`check_greedy_nms_inputs`, so a bad call fails the same way whichever backend would
have run it, with a message that names the offending value. The checks read shapes, dtypes and devices only: they
never read a tensor's data, so they cost no host synchronisation.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# The kernel addresses a row's boxes with int32 offsets of 4 coordinates per box.
TRITON_MAX_BOXES = 2 ** 29 - 1


@dataclass(frozen=True)
class GreedyNMSCall:
    """One validated call: its sizes and its scalar arguments as plain Python numbers."""

    batch: int
    num_boxes: int
    iou_threshold: float
    max_kept: int

    @property
    def is_empty(self) -> bool:
        return self.batch == 0 or self.num_boxes == 0


def check_greedy_nms_inputs(boxes: torch.Tensor, scores: torch.Tensor, valid: Optional[torch.Tensor],
                            iou_threshold: float, max_kept: int) -> GreedyNMSCall:
    """Validate the inputs of :func:`deform_plugin.ops.greedy_nms_first_kept` and return the call's sizes.

    Raises:
        TypeError: a tensor argument that is not a tensor or has the wrong dtype (boxes and scores floating, valid
            bool); an iou_threshold that is not a real number or a max_kept that is not an integer (tensors are
            refused for both: reading one would synchronise with the device).
        ValueError: shapes that do not agree, tensors on different devices, an iou_threshold that is not finite or
            lies outside [0, 1], a max_kept below 1.
    """
    named = dict(boxes=boxes, scores=scores) if valid is None else dict(boxes=boxes, scores=scores, valid=valid)
    for name, tensor in named.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor{' or None' if name == 'valid' else ''}, "
                            f"got {type(tensor).__name__}")
    for name in ("boxes", "scores"):
        if named[name].dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be a floating tensor (float16, bfloat16, float32 or float64), "
                            f"got {named[name].dtype}")
    if valid is not None and valid.dtype != torch.bool:
        raise TypeError(f"valid must be a bool tensor (True where a box may be kept), got {valid.dtype}")
    if boxes.dim() != 3 or boxes.shape[-1] != 4:
        raise ValueError(f"boxes must be (batch, num_boxes, 4) as x1, y1, x2, y2, got shape {tuple(boxes.shape)}")
    batch, num_boxes = boxes.shape[:2]
    if tuple(scores.shape) != (batch, num_boxes):
        raise ValueError(f"scores must be (batch, num_boxes) = {(batch, num_boxes)} to match boxes, "
                         f"got shape {tuple(scores.shape)}")
    if valid is not None and tuple(valid.shape) != (batch, num_boxes):
        raise ValueError(f"valid must be (batch, num_boxes) = {(batch, num_boxes)} to match boxes, "
                         f"got shape {tuple(valid.shape)}")
    devices = {tensor.device for tensor in named.values()}
    if len(devices) > 1:
        raise ValueError("boxes, scores and valid must be on one device, got "
                         + ", ".join(f"{name} on {tensor.device}" for name, tensor in named.items()))
    return GreedyNMSCall(batch, num_boxes, _checked_threshold(iou_threshold), _checked_max_kept(max_kept))


def _checked_threshold(iou_threshold) -> float:
    # bool is a numbers.Real subclass but never a meaningful threshold.
    if isinstance(iou_threshold, bool) or not isinstance(iou_threshold, numbers.Real):
        raise TypeError(f"iou_threshold must be a real number (a Python or numpy float), "
                        f"got {type(iou_threshold).__name__} ({iou_threshold!r})")
    iou_threshold = float(iou_threshold)
    if not math.isfinite(iou_threshold) or not 0.0 <= iou_threshold <= 1.0:
        raise ValueError(f"iou_threshold must be a finite number in [0, 1], got {iou_threshold}")
    return iou_threshold


def _checked_max_kept(max_kept) -> int:
    if isinstance(max_kept, bool) or not isinstance(max_kept, numbers.Integral):
        raise TypeError(f"max_kept must be an integer, got {type(max_kept).__name__} ({max_kept!r})")
    max_kept = int(max_kept)
    if max_kept < 1:
        raise ValueError(f"max_kept must be >= 1, got {max_kept}")
    return max_kept


def triton_unsupported_reasons(call: GreedyNMSCall) -> list:
    """Every reason the Triton kernel cannot run this (already validated) call; empty when it can."""
    reasons = []
    if call.num_boxes > TRITON_MAX_BOXES:
        reasons.append(f"{call.num_boxes} boxes per row exceed {TRITON_MAX_BOXES}, the most the kernel's int32 "
                       "offsets address")
    return reasons
