"""Hungarian matching with fewer host syncs (``hungarian_host_syncs``); all of a step's matching in one pass
(``batched_matching``) builds on it in :mod:`.batched_matching`.

``hungarian_host_syncs``: mmdet's ``HungarianAssigner.assign`` copies the matched row/column indices to the device
with two blocking copies and then scatters labels through them; the DETR heads' ``_get_targets_single`` then finds
the positive and negative queries with two ``nonzero()`` calls (two more host syncs per image and decoder layer). The
fast path builds the per-query ``gt_inds`` on the host, where scipy's result already is, copies it once from pinned
memory without blocking, gathers the labels on the device, and lets the DETR heads take their sorted
positive/negative indices from that host copy. Same cost matrix, same ``linear_sum_assignment`` call, the same
integers out: bitwise identical assignments and targets. The cost terms themselves are mmdet's, but for two small
constants that mmdet's ``BBoxL1Cost`` (the image-size factor) and ``bbox_overlaps`` (the ``eps`` floor of
``IoUCost`` and of the GIoU loss) build with ``new_tensor`` from Python numbers: on a GPU each is a blocking copy
that waits for all queued work. Here the factor comes from pinned memory without blocking and ``eps`` is filled on
the device; the same values enter the same operations.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn
from torch.profiler import record_function

__all__ = ["bbox_overlaps_without_sync", "enable_hungarian_host_syncs", "host_solves", "image_size_factor",
           "image_size_factors"]

# A prediction set's identity in the step: its scores' storage address, shape and strides, and the gt instances.
_PredictionKey = Tuple[int, Tuple[int, ...], Tuple[int, ...], int]


def _prediction_key(scores: torch.Tensor, gt_instances) -> _PredictionKey:
    return scores.data_ptr(), tuple(scores.shape), tuple(scores.stride()), id(gt_instances)


def _to_device_without_blocking(host_tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return host_tensor.to(device)
    # Pinned memory lets the copy run asynchronously; the caching host allocator keeps the buffer alive until the
    # copy has completed. A plain tensor.new_tensor(list) on CUDA would wait for the GPU.
    return host_tensor.pin_memory().to(device, non_blocking=True)


def image_size_factor(img_meta: dict, like: torch.Tensor) -> torch.Tensor:
    """``(1, 4)`` tensor ``[w, h, w, h]`` of the image, in ``like``'s dtype and device, copied without blocking."""
    return image_size_factors([img_meta], like)[0]


def image_size_factors(img_metas: Sequence[dict], like: torch.Tensor) -> torch.Tensor:
    """``(images, 1, 4)`` ``[w, h, w, h]`` per image, in ``like``'s dtype and device, copied once without blocking."""
    sizes = [[meta["img_shape"][1], meta["img_shape"][0]] * 2 for meta in img_metas]
    return _to_device_without_blocking(torch.tensor(sizes, dtype=like.dtype)[:, None, :], like.device)


def _assignment_from_host(num_gts: int, host_gt_inds: np.ndarray, gt_labels: torch.Tensor):
    from mmdet.models.task_modules.assigners.assign_result import AssignResult

    host_gt_inds = torch.from_numpy(host_gt_inds)
    gt_inds = _to_device_without_blocking(host_gt_inds, gt_labels.device)
    # labels[q] = gt_labels[gt_inds[q] - 1] for matched queries, -1 elsewhere: the stock scatter, as a gather.
    matched = gt_inds > 0
    labels = torch.where(matched, gt_labels[(gt_inds - 1).clamp(min=0)].long(), torch.full_like(gt_inds, -1))
    result = AssignResult(num_gts=num_gts, gt_inds=gt_inds, max_overlaps=None, labels=labels)
    # The host copy lets the DETR heads' target builder skip its two nonzero() syncs (see below).
    result.host_gt_inds = host_gt_inds
    return result


def host_solves():
    """The span in which a step's assignments are solved on the host, as a profiler range."""
    return record_function("deform_plugin::matching.scipy")


def _solve(cost: np.ndarray) -> np.ndarray:
    """Per-query ``gt_inds`` (1-based gt index, 0 for background) of the optimal assignment of one cost matrix."""
    from scipy.optimize import linear_sum_assignment
    matched_rows, matched_cols = linear_sum_assignment(cost)
    host_gt_inds = np.zeros(cost.shape[0], dtype=np.int64)
    host_gt_inds[matched_rows] = matched_cols + 1
    return host_gt_inds


def _assign_with_fewer_host_syncs(self, pred_instances, gt_instances, img_meta: Optional[dict] = None, **kwargs):
    """``HungarianAssigner.assign`` with the result built on the host and copied once without blocking; a result
    that batched matching solved ahead is used as it is."""
    from mmdet.models.task_modules.assigners.assign_result import AssignResult

    num_gts, num_preds = len(gt_instances), len(pred_instances)
    gt_labels = gt_instances.labels
    device = gt_labels.device
    if num_gts == 0 or num_preds == 0:
        # The stock path's edge cases: all background without gts, all "don't care" without predictions.
        fill = 0 if num_gts == 0 else -1
        gt_inds = torch.full((num_preds,), fill, dtype=torch.long, device=device)
        labels = torch.full((num_preds,), -1, dtype=torch.long, device=device)
        result = AssignResult(num_gts=num_gts, gt_inds=gt_inds, max_overlaps=None, labels=labels)
        result.host_gt_inds = torch.full((num_preds,), fill, dtype=torch.long)
        return result

    solved = getattr(self, "solved_ahead", {}).get(_prediction_key(pred_instances.scores, gt_instances))
    if solved is not None:
        return _assignment_from_host(num_gts, solved, gt_labels)
    # The named ranges cost ~1 us each when no profiler runs; under a profile they split matching's host time into
    # launching the cost terms, waiting for the device (the copy is a sync), and scipy.
    with record_function("deform_plugin::matching.cost_terms"):
        cost = _cost_matrix(self, pred_instances, gt_instances, img_meta)
    with record_function("deform_plugin::matching.wait_and_copy_to_host"):
        cost = cost.cpu()
    with host_solves():
        host_gt_inds = _solve(cost.numpy())
    return _assignment_from_host(num_gts, host_gt_inds, gt_labels)


def _cost_matrix(assigner, pred_instances, gt_instances, img_meta) -> torch.Tensor:
    # As HungarianAssigner.assign sums its cost terms.
    costs = [_match_cost(match_cost, pred_instances, gt_instances, img_meta) for match_cost in assigner.match_costs]
    return torch.stack(costs).sum(dim=0).detach()


def _match_cost(match_cost, pred_instances, gt_instances, img_meta) -> torch.Tensor:
    """``match_cost(...)``; mmdet's ``BBoxL1Cost`` and ``IoUCost`` by the same arithmetic without a blocking copy."""
    from mmdet.models.task_modules.assigners.match_cost import BBoxL1Cost, IoUCost
    if type(match_cost) is BBoxL1Cost:
        return _bbox_l1_cost(match_cost, pred_instances.bboxes, gt_instances.bboxes, [img_meta])
    if type(match_cost) is IoUCost:
        return _iou_cost(match_cost, pred_instances.bboxes, gt_instances.bboxes)
    return match_cost(pred_instances=pred_instances, gt_instances=gt_instances, img_meta=img_meta)


def _bbox_l1_cost(match_cost, pred_bboxes: torch.Tensor, gt_bboxes: torch.Tensor,
                  img_metas: Sequence[dict]) -> torch.Tensor:
    # mmdet 3.3.0's BBoxL1Cost.__call__, its factor copied without blocking: (N, 4) boxes of one image, or
    # (images, N, 4) boxes of as many images.
    from mmdet.structures.bbox import bbox_xyxy_to_cxcywh
    if match_cost.box_format == "xywh":
        gt_bboxes = bbox_xyxy_to_cxcywh(gt_bboxes)
        pred_bboxes = bbox_xyxy_to_cxcywh(pred_bboxes)
    factors = image_size_factors(img_metas, gt_bboxes)
    factors = factors if gt_bboxes.dim() == 3 else factors[0]
    return torch.cdist(pred_bboxes / factors, gt_bboxes / factors, p=1) * match_cost.weight


def _iou_cost(match_cost, pred_bboxes: torch.Tensor, gt_bboxes: torch.Tensor) -> torch.Tensor:
    # mmdet 3.3.0's IoUCost.__call__ (its fp16 overflow guard included) on bbox_overlaps_without_sync.
    fp16 = pred_bboxes.dtype == torch.float16
    if fp16:
        pred_bboxes = pred_bboxes.to(torch.float32)
    overlaps = bbox_overlaps_without_sync(pred_bboxes, gt_bboxes, mode=match_cost.iou_mode, is_aligned=False)
    if fp16:
        overlaps = overlaps.to(torch.float16)
    return -overlaps * match_cost.weight


def bbox_overlaps_without_sync(bboxes1: torch.Tensor, bboxes2: torch.Tensor, mode: str = "iou",
                               is_aligned: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """mmdet 3.3.0's ``bbox_overlaps`` for ``(..., N, 4)`` and ``(..., M, 4)`` boxes with the same leading (batch)
    sizes (modes ``iou``, ``iof``, ``giou``): the same operations, with ``eps`` filled on the device where mmdet
    copies it from the host."""
    from mmdet.structures.bbox.bbox_overlaps import fp16_clamp
    if mode not in ("iou", "iof", "giou"):
        raise ValueError(f"bbox_overlaps mode must be 'iou', 'iof' or 'giou', got {mode!r}")
    if (bboxes1.dim() < 2 or bboxes1.shape[:-2] != bboxes2.shape[:-2] or bboxes1.shape[-1] != 4
            or bboxes2.shape[-1] != 4):
        raise ValueError(f"bbox_overlaps_without_sync takes (..., N, 4) and (..., M, 4) boxes with the same leading "
                         f"sizes, got {tuple(bboxes1.shape)} and {tuple(bboxes2.shape)}")
    batch, rows, cols = bboxes1.shape[:-2], bboxes1.shape[-2], bboxes2.shape[-2]
    if is_aligned and rows != cols:
        raise ValueError(f"aligned overlaps need as many boxes on both sides, got {rows} and {cols}")
    if rows * cols == 0:
        return bboxes1.new_empty(batch + ((rows,) if is_aligned else (rows, cols)))
    area1 = (bboxes1[..., 2] - bboxes1[..., 0]) * (bboxes1[..., 3] - bboxes1[..., 1])
    area2 = (bboxes2[..., 2] - bboxes2[..., 0]) * (bboxes2[..., 3] - bboxes2[..., 1])
    first, second = (bboxes1, bboxes2) if is_aligned else (bboxes1[..., :, None, :], bboxes2[..., None, :, :])
    lt = torch.max(first[..., :2], second[..., :2])
    rb = torch.min(first[..., 2:], second[..., 2:])
    wh = fp16_clamp(rb - lt, min=0)
    overlap = wh[..., 0] * wh[..., 1]
    if mode in ("iou", "giou"):
        union = area1 + area2 - overlap if is_aligned else area1[..., None] + area2[..., None, :] - overlap
    else:
        union = area1 if is_aligned else area1[..., None]
    if mode == "giou":
        enclosed_lt = torch.min(first[..., :2], second[..., :2])
        enclosed_rb = torch.max(first[..., 2:], second[..., 2:])
    eps = torch.full((1,), eps, dtype=union.dtype, device=union.device)
    union = torch.max(union, eps)
    ious = overlap / union
    if mode in ("iou", "iof"):
        return ious
    enclose_wh = fp16_clamp(enclosed_rb - enclosed_lt, min=0)
    enclose_area = enclose_wh[..., 0] * enclose_wh[..., 1]
    enclose_area = torch.max(enclose_area, eps)
    return ious - (enclose_area - union) / enclose_area


def assign_with_host_indices(head, cls_score, bbox_pred, gt_instances, img_meta):
    """The assignment step of mmdet 3.3.0's DETR-family ``_get_targets_single``: the image-size factor (copied
    without blocking), the predicted boxes scaled to pixels as xyxy, the assignment, and the sorted positive and
    negative query indices, from the assigner's ``host_gt_inds`` in one non-blocking copy where it left them (the
    fewer-syncs ``assign``), else with stock's two ``nonzero().unique()`` syncs. Returns ``(assign_result, factor,
    scaled_bbox_pred, pos_inds, neg_inds)``."""
    from mmdet.structures.bbox import bbox_cxcywh_to_xyxy
    from mmengine.structures import InstanceData

    factor = image_size_factor(img_meta, bbox_pred)
    bbox_pred = bbox_cxcywh_to_xyxy(bbox_pred) * factor
    assign_result = head.assigner.assign(pred_instances=InstanceData(scores=cls_score, bboxes=bbox_pred),
                                         gt_instances=gt_instances, img_meta=img_meta)
    host_gt_inds = getattr(assign_result, "host_gt_inds", None)
    if host_gt_inds is None:
        pos_inds = torch.nonzero(assign_result.gt_inds > 0, as_tuple=False).squeeze(-1).unique()
        neg_inds = torch.nonzero(assign_result.gt_inds == 0, as_tuple=False).squeeze(-1).unique()
    else:
        host = host_gt_inds.numpy()
        host_pos, host_neg = np.flatnonzero(host > 0), np.flatnonzero(host == 0)  # sorted and unique, as stock
        both = _to_device_without_blocking(torch.from_numpy(np.concatenate([host_pos, host_neg])),
                                           bbox_pred.device)
        pos_inds, neg_inds = both[:len(host_pos)], both[len(host_pos):]
    return assign_result, factor, bbox_pred, pos_inds, neg_inds


def _detr_targets_single_fewer_syncs(self, cls_score, bbox_pred, gt_instances, img_meta):
    """mmdet 3.3.0's ``DETRHead._get_targets_single`` taking the positive/negative query indices from the host
    assignment.

    The stock method finds them with ``torch.nonzero(...).unique()`` on the device: two host syncs per image and
    layer, and one more for its image-size factor. Where the assigner left ``host_gt_inds`` (the fewer-syncs
    ``assign``), the same sorted indices come from numpy and reach the device in one non-blocking copy, as does
    the factor; everything else is the stock computation.
    """
    from mmdet.structures.bbox import bbox_xyxy_to_cxcywh

    num_bboxes = bbox_pred.size(0)
    assign_result, factor, bbox_pred, pos_inds, neg_inds = assign_with_host_indices(
        self, cls_score, bbox_pred, gt_instances, img_meta)
    gt_bboxes = gt_instances.bboxes
    gt_labels = gt_instances.labels
    pos_assigned_gt_inds = assign_result.gt_inds[pos_inds] - 1
    pos_gt_bboxes = gt_bboxes[pos_assigned_gt_inds.long(), :]
    labels = gt_bboxes.new_full((num_bboxes,), self.num_classes, dtype=torch.long)
    labels[pos_inds] = gt_labels[pos_assigned_gt_inds]
    label_weights = gt_bboxes.new_ones(num_bboxes)
    bbox_targets = torch.zeros_like(bbox_pred, dtype=gt_bboxes.dtype)
    bbox_weights = torch.zeros_like(bbox_pred, dtype=gt_bboxes.dtype)
    # index_fill_, not `bbox_weights[pos_inds] = 1.0`: torch <= 2.11 copies that Python scalar to the GPU with a
    # blocking copy (a host sync per image); the same rows are set.
    bbox_weights.index_fill_(0, pos_inds, 1.0)
    bbox_targets[pos_inds] = bbox_xyxy_to_cxcywh(pos_gt_bboxes / factor)
    return labels, label_weights, bbox_targets, bbox_weights, pos_inds, neg_inds


# ---- switching it on ---------------------------------------------------------------------------------------------

def _detr_heads(model: nn.Module, method: str):
    """DETR-family heads whose ``method`` is one of mmdet's own (subclasses that replace it are left alone)."""
    from mmdet.models.dense_heads import DeformableDETRHead, DETRHead, DINOHead
    stock = {getattr(cls, method) for cls in (DETRHead, DeformableDETRHead, DINOHead) if method in vars(cls)}
    for module in model.modules():
        if isinstance(module, DETRHead) and getattr(type(module), method) in stock:
            yield module


def _hungarian_assigners(model: nn.Module):
    from mmdet.models.task_modules.assigners import HungarianAssigner
    seen = set()
    for module in model.modules():
        for value in vars(module).values():
            if type(value) is HungarianAssigner and id(value) not in seen:
                seen.add(id(value))
                yield value


def enable_hungarian_host_syncs(model: nn.Module) -> int:
    """Give every stock ``HungarianAssigner`` held by a module of ``model`` the fewer-syncs ``assign``, and every
    DETR-family head that uses the stock ``DETRHead._get_targets_single`` the variant that reads its result.

    Only instances are changed (the classes stay stock), so other models in the process are unaffected.
    Returns the number of assigners changed.
    """
    changed = 0
    for assigner in _hungarian_assigners(model):
        assigner.assign = _assign_with_fewer_host_syncs.__get__(assigner)
        changed += 1
    for head in _detr_heads(model, "_get_targets_single"):
        head._get_targets_single = _detr_targets_single_fewer_syncs.__get__(head)
    return changed
