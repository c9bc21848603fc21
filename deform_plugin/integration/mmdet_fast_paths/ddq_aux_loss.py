"""DDQ-DETR's dense-query loss (mmdet's ``DDQAuxLoss``) of every decoder layer and of the encoder in one pass.

mmdet 3.3.0's ``DDQAuxLoss.loss`` matches each image's dense queries to its gts one-to-k (``TopkHungarianAssigner``:
the Hungarian matching of the cost matrix with each gt's column repeated k times), builds the targets with a loop
over the matched gts and computes a quality focal loss (on probabilities) and a GIoU loss, both weighted by the
normalised alignment metrics. ``DDQDETRHead`` calls it for the dense queries of each decoder layer and of the
encoder; each call waits for the GPU a dozen times per image and more (the cost copy, the index copies back,
``nonzero``, ``unique`` and a boolean index per matched gt, the normalisers' ``.item()``).

Here the cost matrices of every set (a decoder layer's or the encoder's dense queries) and image are computed in one
pass (:func:`launch_dense_costs`) and reach the host in the step's one copy (beside the one-to-one matching's, see
:mod:`.ddq_losses`); each is solved as the assigner solves it (:func:`solve_dense_costs`); the targets, alignment
metrics and losses of every set and image are then computed at once on the device from index tables made on the
host (:func:`dense_losses`). Every element is computed by the formula stock computes it with (bitwise where the
same kernels see the same values); the per-image and per-set sums run over other layouts, and the normalisers stay
on the device where stock reads them with ``.item()``: the same losses up to float summation order.

Where mmdet's quality focal loss cannot run (bf16 or fp16 probabilities against its float32 targets; CUDA autocast,
which refuses ``binary_cross_entropy``), the loss is computed as in float32 training: in float32, outside autocast.
"""
from __future__ import annotations

import inspect
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from .batched_matching import focal_cost
from .matching import _bbox_l1_cost, _iou_cost, _to_device_without_blocking, bbox_overlaps_without_sync

# mmdet's weight_reduce_loss divides by (avg_factor + this) whatever the dtype.
_AVG_FACTOR_EPS = torch.finfo(torch.float32).eps
# DDQAuxLoss._get_target_single's floor under each gt's largest alignment metric.
_METRIC_FLOOR = 10e-8


def batchable_aux_loss(aux_loss) -> bool:
    """Whether ``aux_loss`` is mmdet 3.3.0's ``DDQAuxLoss`` with the pieces this pass reproduces: a quality focal
    loss on probabilities, a GIoU loss and a ``TopkHungarianAssigner`` of mmdet's focal, box-L1 and IoU costs."""
    from mmdet.models.losses import DDQAuxLoss, GIoULoss, QualityFocalLoss
    from mmdet.models.task_modules.assigners import BboxOverlaps2D, TopkHungarianAssigner
    from mmdet.models.task_modules.assigners.match_cost import BBoxL1Cost, FocalLossCost, IoUCost
    from mmdet.models.task_modules.samplers import PseudoSampler
    if type(aux_loss) is not DDQAuxLoss:
        return False
    assigner, loss_cls, loss_bbox = aux_loss.assigner, aux_loss.loss_cls, aux_loss.loss_bbox
    return (type(loss_cls) is QualityFocalLoss and loss_cls.activated and loss_cls.reduction == "mean"
            and type(loss_bbox) is GIoULoss and loss_bbox.reduction == "mean"
            and type(aux_loss.sampler) is PseudoSampler
            and type(assigner) is TopkHungarianAssigner and "assign" not in vars(assigner)
            and type(assigner.cls_cost) is FocalLossCost and not assigner.cls_cost.binary_input
            and type(assigner.reg_cost) is BBoxL1Cost and type(assigner.iou_cost) is IoUCost
            and type(assigner.iou_calculator) is BboxOverlaps2D and assigner.iou_calculator.dtype is None)


class DenseCosts(NamedTuple):
    """The one-to-k cost matrices of a pass: ``(images with gts, sets * queries, most gts)``, flattened (None
    without gts), the images in that order, and the block's shape."""
    flat: Optional[torch.Tensor]
    images: List[int]
    shape: Tuple[int, int, int]

    @property
    def num_elements(self) -> int:
        return 0 if self.flat is None else self.flat.numel()


def launch_dense_costs(aux_loss, probabilities: torch.Tensor, pixel_boxes: torch.Tensor, batch_gt_instances,
                       batch_img_metas) -> DenseCosts:
    """The one-to-k cost matrices of every set and image, queued without waiting for the device.

    Args:
        aux_loss: the head's ``DDQAuxLoss`` (:func:`batchable_aux_loss`).
        probabilities: ``(S, B, N, C)`` class probabilities of ``S`` sets of ``N`` dense queries.
        pixel_boxes: ``(S, B, N, 4)`` their boxes, x1-y1-x2-y2 in pixels.
        batch_gt_instances, batch_img_metas: as ``DDQAuxLoss.loss`` gets them.
    """
    from torch.nn.utils.rnn import pad_sequence
    images = [image for image, gts in enumerate(batch_gt_instances) if len(gts) > 0]
    if not images:  # the assigner's own edge case needs no cost matrix
        return DenseCosts(None, [], (0, 0, 0))
    num_sets, _, num_queries, num_classes = probabilities.shape
    assigner = aux_loss.assigner
    with torch.no_grad():
        # Per image, every set's queries as rows: each cost term is row-wise.
        if len(images) < len(batch_gt_instances):
            chosen = _to_device_without_blocking(torch.tensor(images), probabilities.device)
            probabilities, pixel_boxes = probabilities.index_select(1, chosen), pixel_boxes.index_select(1, chosen)
        scores = probabilities.transpose(0, 1).reshape(len(images), num_sets * num_queries, num_classes)
        boxes = pixel_boxes.transpose(0, 1).reshape(len(images), num_sets * num_queries, 4)
        gt_boxes = pad_sequence([batch_gt_instances[i].bboxes for i in images], batch_first=True)
        gt_labels = pad_sequence([batch_gt_instances[i].labels for i in images], batch_first=True)
        metas = [batch_img_metas[i] for i in images]
        reg_cost = _bbox_l1_cost(assigner.reg_cost, boxes, gt_boxes, metas)
        iou_cost = _iou_cost(assigner.iou_cost, boxes, gt_boxes)
        cls_cost = focal_cost(assigner.cls_cost, scores, gt_labels)
        cost = cls_cost + reg_cost + iou_cost  # TopkHungarianAssigner.assign's sum, in its order
    return DenseCosts(cost.reshape(-1), images, tuple(cost.shape))


class DenseMatches(NamedTuple):
    """Every positive (query, gt) pair of the pass's one-to-k assignments: its set and image as ``set * B + image``,
    its query, its gt, and its place among its set and image's positives (their order is stock's, by query)."""
    set_image: np.ndarray
    query: np.ndarray
    gt: np.ndarray
    place: np.ndarray


def solve_dense_costs(aux_loss, costs: DenseCosts, host: np.ndarray, batch_gt_instances, num_sets: int,
                      num_queries: int) -> DenseMatches:
    """The one-to-k assignments of :func:`launch_dense_costs`' matrices, from their copy on the host: as
    ``TopkHungarianAssigner.assign`` solves each (every gt's column repeated ``min(topk, queries // gts)`` times)."""
    from scipy.optimize import linear_sum_assignment
    batch = len(batch_gt_instances)
    parts = []
    if costs.flat is not None:
        block = host.reshape(costs.shape)
        for cost, image in zip(block, costs.images):
            num_gts = len(batch_gt_instances[image])
            topk = min(aux_loss.assigner.topk, int(num_queries / num_gts))
            for set_index in range(num_sets):
                rows = cost[set_index * num_queries:(set_index + 1) * num_queries, :num_gts]
                matched_rows, matched_cols = linear_sum_assignment(np.repeat(rows, topk, axis=1))
                count = len(matched_rows)
                parts.append((np.full(count, set_index * batch + image), matched_rows, matched_cols // max(topk, 1),
                              np.arange(count)))
    if not parts:
        empty = np.zeros(0, dtype=np.int64)
        return DenseMatches(empty, empty, empty, empty)
    return DenseMatches(*(np.concatenate(column).astype(np.int64) for column in zip(*parts)))


def _alignment_hyperparameters(assigner) -> Tuple[int, int]:
    # DDQAuxLoss calls assign without alpha and beta: the method's defaults hold.
    parameters = inspect.signature(type(assigner).assign).parameters
    return parameters["alpha"].default, parameters["beta"].default


def _segment_max(values: torch.Tensor, segments: torch.Tensor, num_segments: int) -> torch.Tensor:
    return values.new_zeros(num_segments).scatter_reduce(0, segments, values, "amax", include_self=False)


def _placed(values: torch.Tensor, slots: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """``values`` laid out in a zero ``(rows, columns)`` table at their flat ``slots``."""
    return values.new_zeros(rows * columns).index_put((slots,), values).view(rows, columns)


def dense_losses(aux_loss, probabilities: torch.Tensor, pixel_boxes: torch.Tensor, matches: DenseMatches,
                 batch_gt_instances, batch_img_metas) -> List[Dict[str, List[torch.Tensor]]]:
    """``DDQAuxLoss.loss``'s result (``aux_loss_cls`` and ``aux_loss_bbox``, one loss per image) for each set of
    :func:`launch_dense_costs`' ``probabilities`` and ``pixel_boxes``, from the assignments in ``matches``."""
    from mmdet.utils import reduce_mean
    from torch.nn.utils.rnn import pad_sequence
    num_sets, batch, num_queries, num_classes = probabilities.shape
    device = probabilities.device
    # Under autocast mmdet's loss cannot run: it runs here as in float32 training.
    dtype = torch.promote_types(probabilities.dtype, torch.float32)
    probabilities, pixel_boxes = probabilities.to(dtype), pixel_boxes.to(dtype)
    set_images = num_sets * batch
    gt_boxes = pad_sequence([gts.bboxes.to(dtype) for gts in batch_gt_instances], batch_first=True)
    gt_labels = pad_sequence([gts.labels for gts in batch_gt_instances], batch_first=True)
    most_gts = max(gt_boxes.shape[1], 1)
    most_matches = max(int(np.bincount(matches.set_image, minlength=set_images).max(initial=0)), 1)
    host = torch.from_numpy(np.stack([matches.set_image, matches.query, matches.gt, matches.place]))
    set_image, query, gt, place = _to_device_without_blocking(host, device)
    image = set_image % batch
    flat_query = set_image * num_queries + query
    flat_gt = image * gt_boxes.shape[1] + gt
    flat_probabilities = probabilities.reshape(-1, num_classes)
    flat_boxes = pixel_boxes.reshape(-1, 4)
    matched_gt_boxes = gt_boxes.reshape(-1, 4)[flat_gt]
    matched_labels = gt_labels.reshape(-1)[flat_gt]

    with torch.autocast(device.type, enabled=False):
        with torch.no_grad():
            # TopkHungarianAssigner.assign's overlaps and alignment metrics of the matched pairs (its (query, gt)
            # tables hold the same values), then DDQAuxLoss._get_target_single's normalisation per gt.
            alpha, beta = _alignment_hyperparameters(aux_loss.assigner)
            ious = bbox_overlaps_without_sync(flat_boxes[flat_query].detach(), matched_gt_boxes, is_aligned=True)
            metrics = flat_probabilities[flat_query, matched_labels].detach() ** alpha * ious ** beta
            segment = set_image * most_gts + gt
            metric_max = _segment_max(metrics, segment, set_images * most_gts)[segment]
            iou_max = _segment_max(ious, segment, set_images * most_gts)[segment]
            alignment = metrics / (metric_max + _METRIC_FLOOR) * iou_max
            targets = torch.zeros_like(flat_probabilities).index_put((flat_query, matched_labels), alignment)
            has_gts = _to_device_without_blocking(torch.tensor([len(gts) > 0 for gts in batch_gt_instances]),
                                                  device).to(dtype)
        # QualityFocalLoss on probabilities: against the alignment at a positive's label, 0 elsewhere (where
        # |0 - p| ** beta is stock's p ** beta bitwise), per query summed over the classes, weighted per image.
        loss_cls = aux_loss.loss_cls
        elements = F.binary_cross_entropy(flat_probabilities, targets, reduction="none") * (
            targets - flat_probabilities).abs().pow(loss_cls.beta)
        per_query = elements.sum(-1).view(num_sets, batch, num_queries) * has_gts.view(1, batch, 1)
        cls_sums = loss_cls.loss_weight * (per_query.sum(-1) / (1.0 + _AVG_FACTOR_EPS))
        # GIoU of the positives, weighted by their alignment, summed per set and image.
        loss_bbox = aux_loss.loss_bbox
        giou = bbox_overlaps_without_sync(flat_boxes[flat_query], matched_gt_boxes, mode="giou", is_aligned=True,
                                          eps=loss_bbox.eps)
        slots = set_image * most_matches + place
        bbox_sums = loss_bbox.loss_weight * (_placed((1 - giou) * alignment, slots, set_images, most_matches).sum(-1)
                                             / (1.0 + _AVG_FACTOR_EPS)).view(num_sets, batch)
        # Stock's loss of a set and image without positives is its boxes' sum times 0: their gradients are zeros,
        # not absent (an optimizer steps a parameter with a zero gradient, and skips one without).
        bbox_sums = bbox_sums + pixel_boxes.sum(dim=(-2, -1)) * 0
        # The normalisers: per image the sum of its alignment metrics (over every query, and over the positives),
        # summed over the images as Python's sum adds them, averaged over ranks, at least 1.
        cls_factors = alignment.new_zeros(set_images * num_queries).index_put((flat_query,), alignment).view(
            num_sets, batch, num_queries).sum(-1)
        bbox_factors = _placed(alignment, slots, set_images, most_matches).sum(-1).view(num_sets, batch)
        totals = [_sum_in_order(cls_factors), _sum_in_order(bbox_factors)]
        # mmdet's reduce_mean: the mean over ranks in distributed training (one all-reduce for every set here).
        cls_total, bbox_total = reduce_mean(torch.stack(totals)).clamp(min=1)
    return [dict(aux_loss_cls=[cls_sums[s, b] / cls_total[s] for b in range(batch)],
                 aux_loss_bbox=[bbox_sums[s, b] / bbox_total[s] for b in range(batch)]) for s in range(num_sets)]


def _sum_in_order(per_image: torch.Tensor) -> torch.Tensor:
    """``(S, B)`` summed over the images one after another, as Python's ``sum`` adds stock's per-image tensors."""
    total = per_image[:, 0]
    for image in range(1, per_image.shape[1]):
        total = total + per_image[:, image]
    return total


def dense_sets(dense_cls_scores: torch.Tensor, dense_bbox_preds: torch.Tensor, aux_enc_cls_scores: torch.Tensor,
               aux_enc_bbox_preds: torch.Tensor, batch_img_metas: Sequence[dict]) -> Tuple[torch.Tensor, torch.Tensor]:
    """The dense sets as ``DDQDETRHead`` hands them to ``DDQAuxLoss``: every decoder layer's dense queries
    (``(L, B, N, C)`` logits, ``(L, B, N, 4)`` normalized cx-cy-w-h boxes), then the encoder's (``(B, N, ...)``),
    as ``(L + 1, B, N, C)`` probabilities and ``(L + 1, B, N, 4)`` x1-y1-x2-y2 boxes in pixels."""
    from mmdet.structures.bbox import bbox_cxcywh_to_xyxy
    probabilities = torch.cat([dense_cls_scores, aux_enc_cls_scores[None]]).sigmoid()
    boxes = bbox_cxcywh_to_xyxy(torch.cat([dense_bbox_preds, aux_enc_bbox_preds[None]]))
    # Stock scales the x and y columns of each image by its width and height (Python numbers): the same products.
    sizes = torch.tensor([[meta["img_shape"][1], meta["img_shape"][0]] * 2 for meta in batch_img_metas],
                         dtype=boxes.dtype)
    return probabilities, boxes * _to_device_without_blocking(sizes, boxes.device)[None, :, None]
