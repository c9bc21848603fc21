"""Pure-PyTorch greedy NMS with fixed-shape outputs: the specification of the op and its CPU path.

For each row ``b`` of a batch, independently:

1. Visit order: the boxes in the order of
   ``torch.sort(torch.where(valid, scores.float(), -inf), dim=-1, descending=True, stable=True)``
   (:func:`visit_order`): exactly tied scores in index order, so that every device visits them alike (an unstable
   sort orders ties differently on a CPU and a GPU, and overlapping tied boxes would then keep another box). NaN
   scores sort first, as ``torch.sort`` places them. mmcv's NMS sorts without ``stable``; it can differ from this
   only among exactly tied scores.
2. Greedy pass: an invalid box (``valid`` False) is never kept and never suppresses. A visited valid box is kept
   unless some box kept before it suppresses it; the pass stops once ``max_kept`` boxes are kept.
3. Kept box ``a`` suppresses box ``b`` when, in float32,

       w = max(min(x2_a, x2_b) - max(x1_a, x1_b), 0),  h likewise along y,  inter = w * h,
       area = (x2 - x1) * (y2 - y1),  union = area_a + area_b - inter,
       inter > iou_threshold * union

   with ``iou_threshold`` rounded to float32 and each operation rounded to float32 in this order (no fused
   multiply-add). This is the test of mmcv's CUDA NMS kernel with offset 0; mmcv's CPU kernel tests
   ``inter / union > iou_threshold`` instead, which differs only where the IoU lies within a few float32 ulps of
   the threshold.

Outputs: ``kept (B, max_kept) int64``, the original indices (into N) of the kept boxes in visit order, then -1;
``count (B,) int64``, how many were kept.

Every dtype computes in float32, float64 included (boxes and scores are converted first), so that all backends
agree exactly on every input. Boxes with NaN or infinite coordinates give results that may differ between
backends (the ``max`` of a NaN is not pinned down on every device).

This is a plain loop over the boxes with one vectorised test per visited box against the boxes kept so far: it
reads tensors on the host and so synchronises on a GPU, which the Triton path never does.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def visit_order(scores: torch.Tensor, valid: Optional[torch.Tensor]) -> torch.Tensor:
    """``(B, N)`` int64: each row's box indices in the order greedy NMS visits them (the module docstring's step 1).

    With ``valid`` None every box is valid, and the sort key is the float32 scores themselves.
    """
    key = scores.float()
    if valid is not None:
        key = torch.where(valid, key, torch.full_like(key, -float("inf")))
    return torch.sort(key, dim=-1, descending=True, stable=True).indices


def suppressed_by(kept_boxes: torch.Tensor, box: torch.Tensor, iou_threshold: torch.Tensor) -> torch.Tensor:
    """Whether each of ``kept_boxes (K, 4)`` suppresses ``box (4,)``: the module docstring's step 3, float32 in,
    ``(K,)`` bool out. ``iou_threshold`` is a 0-d float32 tensor, so that the product is rounded to float32."""
    width = (torch.minimum(kept_boxes[:, 2], box[2]) - torch.maximum(kept_boxes[:, 0], box[0])).clamp_min(0)
    height = (torch.minimum(kept_boxes[:, 3], box[3]) - torch.maximum(kept_boxes[:, 1], box[1])).clamp_min(0)
    inter = width * height
    kept_area = (kept_boxes[:, 2] - kept_boxes[:, 0]) * (kept_boxes[:, 3] - kept_boxes[:, 1])
    box_area = (box[2] - box[0]) * (box[3] - box[1])
    union = kept_area + box_area - inter
    return inter > iou_threshold * union


def greedy_nms_first_kept_reference(boxes: torch.Tensor, scores: torch.Tensor, valid: Optional[torch.Tensor],
                                    iou_threshold: float, max_kept: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reference greedy NMS. Arguments and outputs as in :func:`deform_plugin.ops.greedy_nms_first_kept`."""
    batch, num_boxes = scores.shape
    device = boxes.device
    kept = torch.full((batch, max_kept), -1, dtype=torch.int64, device=device)
    count = torch.zeros(batch, dtype=torch.int64, device=device)
    if batch == 0 or num_boxes == 0:
        return kept, count

    order = visit_order(scores, valid)
    visited_boxes = boxes.float().gather(1, order[..., None].expand(-1, -1, 4))
    visited_valid = (valid.gather(1, order) if valid is not None
                     else torch.ones(batch, num_boxes, dtype=torch.bool, device=device))
    threshold = torch.tensor(iou_threshold, dtype=torch.float32, device=device)
    capacity = min(max_kept, num_boxes)
    for row in range(batch):
        row_boxes = visited_boxes[row]
        row_valid = visited_valid[row].tolist()
        kept_boxes = row_boxes.new_empty(capacity, 4)
        kept_positions = []  # positions in visit order
        for position in range(num_boxes):
            if len(kept_positions) == max_kept:
                break
            if not row_valid[position]:
                continue
            box = row_boxes[position]
            if kept_positions and bool(suppressed_by(kept_boxes[:len(kept_positions)], box, threshold).any()):
                continue
            kept_boxes[len(kept_positions)] = box
            kept_positions.append(position)
        positions = torch.tensor(kept_positions, dtype=torch.int64, device=device)
        kept[row, :len(kept_positions)] = order[row, positions]
        count[row] = len(kept_positions)
    return kept, count
