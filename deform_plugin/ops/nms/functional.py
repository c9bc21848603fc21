"""Public entry point of the greedy-NMS op: validate, pick a backend, run it."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..backend import registered_backend, resolve_backend
from .checks import check_greedy_nms_inputs
from .reference import greedy_nms_first_kept_reference

OP_NAME = "greedy_nms"


def greedy_nms_first_kept(boxes: torch.Tensor, scores: torch.Tensor, valid: Optional[torch.Tensor],
                          iou_threshold: float, max_kept: int, backend: Optional[str] = None
                          ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Greedy non-maximum suppression per row, with fixed-shape outputs and no host synchronisation on Triton.

    For a detector's query or proposal selection that must stay on the device and keep a fixed shape, for example
    inside a CUDA graph: the outputs are always ``(B, max_kept)`` and ``(B,)`` whatever is kept, and the Triton
    path (a device sort, gathers and one kernel) never reads a tensor on the host. Each row is independent: its
    boxes are visited by descending score, and a valid box is kept unless a box kept before it overlaps it by more
    than ``iou_threshold``; the walk stops once ``max_kept`` boxes are kept. The exact rules, tie order and float32
    arithmetic included, are written in :mod:`deform_plugin.ops.nms.reference`.

    Args:
        boxes: ``(B, N, 4)`` boxes as x1, y1, x2, y2, any floating dtype. Every dtype computes in float32, float64
            included, so all backends agree exactly.
        scores: ``(B, N)`` floating scores; the visit order sorts their float32 values, descending, exactly tied
            scores in index order (on every device alike).
        valid: ``(B, N)`` bool or None (every box valid). An invalid box is never kept and never suppresses.
        iou_threshold: in [0, 1]. Kept box ``a`` suppresses box ``b`` when ``inter > iou_threshold * union`` in
            float32 (IoU above the threshold, tested without a division).
        max_kept: >= 1, the width of the output; it may exceed N.
        backend: ``'auto'``, ``'triton'``, ``'pytorch'`` or None for the process default (see
            :mod:`deform_plugin.ops.backend`). ``'auto'`` runs Triton on CUDA and the PyTorch reference elsewhere;
            a process default that this op does not offer counts as ``'auto'``.

    Returns:
        ``kept``: ``(B, max_kept)`` int64, for each row the original indices (into N) of the kept boxes in the
        order they were visited (descending score), then -1. ``count``: ``(B,)`` int64, the number kept per row
        (at most ``min(max_kept, N)``). With N == 0, every entry of ``kept`` is -1 and every count 0.

    Raises:
        TypeError: non-tensor inputs, non-floating boxes or scores, a valid mask that is not bool, an
            iou_threshold that is not a real number or a max_kept that is not an integer.
        ValueError: shapes that do not agree, mixed devices, an iou_threshold that is not finite or lies outside
            [0, 1], max_kept < 1, a backend this op does not have.

    Example:
        >>> boxes = torch.tensor([[[0., 0., 10., 10.], [1., 0., 11., 10.], [20., 20., 30., 30.]]])
        >>> scores = torch.tensor([[0.9, 0.8, 0.7]])
        >>> kept, count = greedy_nms_first_kept(boxes, scores, None, iou_threshold=0.5, max_kept=4)
        >>> kept, count
        (tensor([[ 0,  2, -1, -1]]), tensor([2]))
    """
    call = check_greedy_nms_inputs(boxes, scores, valid, iou_threshold, max_kept)
    name = resolve_backend(OP_NAME, backend, boxes.device)
    if call.is_empty:
        return (torch.full((call.batch, call.max_kept), -1, dtype=torch.int64, device=boxes.device),
                torch.zeros(call.batch, dtype=torch.int64, device=boxes.device))
    if name == "triton":
        from .triton_op import greedy_nms_first_kept_triton
        return greedy_nms_first_kept_triton(boxes, scores, valid, call.iou_threshold, call.max_kept)
    if name == "pytorch":
        return greedy_nms_first_kept_reference(boxes, scores, valid, call.iou_threshold, call.max_kept)
    return registered_backend(OP_NAME, name).implementation(boxes, scores, valid, call.iou_threshold,
                                                            call.max_kept)
