"""The ``batched_losses`` fast path: every decoder layer's DETR loss of a step in one pass.

mmdet 3.3.0's ``DETRHead.loss_by_feat`` calls ``loss_by_feat_single`` once per decoder layer, and each call builds
its targets image by image (``_get_targets_single``) and runs the classification, L1 and GIoU losses on its own:
about 250 small tensor operations per layer in the forward and as many autograd nodes in the backward, where the
step is bound by how fast the host issues them. With the assignments solved ahead (``batched_matching``), the
targets of every layer are gathers from one padded table of each image's gt boxes, and the losses are elementwise
over every layer's queries followed by one sum per layer: a few dozen operations for all layers together.

Same losses as the stock per-layer calls up to float summation order: each element is computed by the same
formula (mmdet's focal loss with ``reduction='none'``, on the math of mmcv's CUDA kernel without the kernel
launcher's host read of ``target.max()``: :func:`focal_loss_elements`; ``giou_loss`` (its ``eps`` filled on the
device, as in :func:`.matching.bbox_overlaps_without_sync`), ``|pred - target|``), only the per-layer sums run over
a ``(layers, ...)`` view, and the normalisers are the same integers (``sync_free_losses``'s host-side
rule; in distributed training one all-reduce for every layer's counts instead of two per layer). The GIoU and L1
loss modules' ``torch.any(weight > 0)`` host syncs are not taken: with no positive in a layer both sums are zero,
as stock returns.

Only heads whose losses are exactly mmdet's ``FocalLoss`` (sigmoid, not pre-activated), ``L1Loss`` and
``GIoULoss`` are batched; a ``loss_by_feat_single`` call the pass did not foresee (the two-stage encoder's binary
proposals, another head) runs as before.

The two-stage Deformable-DETR's encoder loss matches the proposals against the gts relabelled as class 0 (a copy
made inside ``loss_by_feat``); the pass makes the same relabelled copy, matches the proposals against it in the
step's one matching pass (the decoder layers' cost matrices and these reach the host in one copy) and computes that
loss ahead too.
DINO's denoising losses need no matching (their targets come from the gts and the denoising layout): its
``loss_dn`` builds them once and computes every layer's losses in one pass (:func:`denoising_layer_losses`).
"""
from __future__ import annotations

import functools
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from ..mmcv_lite import sigmoid_focal_loss_backward, sigmoid_focal_loss_forward
from .matching import _prediction_key, _to_device_without_blocking, bbox_overlaps_without_sync, image_size_factor

# mmdet's weight_reduce_loss divides by (avg_factor + this) whatever the dtype.
_AVG_FACTOR_EPS = torch.finfo(torch.float32).eps


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def batchable_head(head) -> bool:
    """Whether ``head``'s losses are the stock focal/L1/GIoU modules whose per-layer math this pass reproduces."""
    from mmdet.models.dense_heads import DETRHead
    # A head with its own targets or per-layer loss (Grounding-DINO's text-conditioned classification) means
    # something else by the same scores: :mod:`.grounding_dino_losses` batches that one.
    stock_layer_loss = all(getattr(type(head), name, None) is getattr(DETRHead, name)
                           for name in ("loss_by_feat_single", "_get_targets_single"))
    return stock_layer_loss and stock_loss_modules(head)


def stock_loss_modules(head) -> bool:
    """Whether ``head``'s losses are mmdet's sigmoid ``FocalLoss``, ``L1Loss`` and ``GIoULoss``, mean-reduced."""
    from mmdet.models.losses import FocalLoss, GIoULoss, L1Loss
    loss_cls = getattr(head, "loss_cls", None)
    return (type(loss_cls) is FocalLoss and loss_cls.use_sigmoid and not loss_cls.activated
            and type(getattr(head, "loss_bbox", None)) is L1Loss
            and type(getattr(head, "loss_iou", None)) is GIoULoss
            and getattr(loss_cls, "reduction", "mean") == "mean"
            and head.loss_bbox.reduction == "mean" and head.loss_iou.reduction == "mean")


class _SigmoidFocalLossElements(torch.autograd.Function):
    """mmcv's ``SigmoidFocalLossFunction`` with ``reduction='none'`` and no class weight, computed by the kernel's
    formula in tensor operations (deform_plugin's mmcv-lite stand-in of ``sigmoid_focal_loss_forward`` and
    ``_backward``): mmcv's CUDA launcher reads ``target.max()`` on the host to check the labels, a sync per call
    that under DDP waits for the other rank (it comes after the loss normalisers' all-reduce)."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, labels: torch.Tensor, gamma: float, alpha: float) -> torch.Tensor:
        output = torch.empty_like(scores)
        sigmoid_focal_loss_forward(scores, labels, scores.new_empty(0), output, gamma=gamma, alpha=alpha)
        ctx.save_for_backward(scores, labels)
        ctx.gamma, ctx.alpha = gamma, alpha
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        scores, labels = ctx.saved_tensors
        grad_scores = torch.empty_like(scores)
        sigmoid_focal_loss_backward(scores, labels, scores.new_empty(0), grad_scores, gamma=ctx.gamma, alpha=ctx.alpha)
        return grad_scores * grad, None, None, None


def focal_loss_elements(loss_cls, scores: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``loss_cls(scores, labels, weights, reduction_override='none')`` of mmdet's sigmoid ``FocalLoss`` (labels
    ``(N,)``, ``num_classes`` for background; weights ``(N,)``) without a host read: on CUDA mmdet calls mmcv's
    compiled kernel, whose formula this computes; bf16 scores in float32 as deform_plugin's focal-loss patch passes
    them to that kernel (it has no bf16 version)."""
    # The labels need no check here: they are the gts' labels (or background), with which the matching pass has
    # already indexed the class scores (an out-of-range label fails there, in stock's path too).
    if scores.dtype == torch.bfloat16:
        scores = scores.float()
    elements = _SigmoidFocalLossElements.apply(scores.contiguous(), labels.long().contiguous(),
                                               float(loss_cls.gamma), float(loss_cls.alpha))
    return loss_cls.loss_weight * (elements * weights.view(-1, 1))


def _padded_targets(batch_gt_instances, factors: torch.Tensor, num_classes: int):
    """Per image, row 0 for background (label ``num_classes``, zero box) then its gts: normalized (cx, cy, w, h)
    boxes ``(B, 1 + T, 4)`` and labels ``(B, 1 + T)``, T the largest gt count, as ``_get_targets_single`` makes
    each positive's target (``bbox_xyxy_to_cxcywh(gt / factor)``)."""
    from mmdet.structures.bbox import bbox_xyxy_to_cxcywh
    most = max(len(gts) for gts in batch_gt_instances)
    boxes, labels = [], []
    for image, gts in enumerate(batch_gt_instances):
        gt_boxes = gts.bboxes
        pad = most - len(gts)
        normalized = bbox_xyxy_to_cxcywh(gt_boxes / factors[image]).to(gt_boxes.dtype)
        boxes.append(torch.cat([normalized.new_zeros(1, 4), normalized, normalized.new_zeros(pad, 4)]))
        labels.append(torch.cat([gts.labels.new_full((1,), num_classes), gts.labels.long(),
                                 gts.labels.new_full((pad,), num_classes)]))
    return torch.stack(boxes), torch.stack(labels)


def _host_gt_inds(solved: Dict, scores: torch.Tensor, batch_gt_instances) -> Optional[np.ndarray]:
    """``(L, B, Q)`` per-query gt index (1-based, 0 background) of each layer and image, or None if a layer of an
    image with gts was not solved ahead."""
    num_layers, batch, num_queries = scores.shape[:3]
    gt_inds = np.zeros((num_layers, batch, num_queries), dtype=np.int64)
    for image, gts in enumerate(batch_gt_instances):
        if len(gts) == 0:
            continue  # assign's edge case: every query is background
        for layer in range(num_layers):
            host = solved.get(_prediction_key(scores[layer, image], gts))
            if host is None:
                return None
            gt_inds[layer, image] = host
    return gt_inds


def _image_factors(batch_img_metas, bbox_preds: torch.Tensor) -> torch.Tensor:
    """``(B, 4)`` (w, h, w, h) of each image, the factors stock builds per image with ``new_tensor``."""
    sizes = torch.tensor([[meta["img_shape"][1], meta["img_shape"][0]] * 2 for meta in batch_img_metas],
                         dtype=bbox_preds.dtype)
    return _to_device_without_blocking(sizes, bbox_preds.device)


def layer_losses(head, scores: torch.Tensor, bbox_preds: torch.Tensor, batch_gt_instances, batch_img_metas,
                 solved: Dict, selected: Optional[np.ndarray] = None
                 ) -> Optional[List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """``loss_by_feat_single``'s ``(loss_cls, loss_bbox, loss_iou)`` of every layer of ``scores`` ``(L, B, Q, C)``
    and ``bbox_preds`` ``(L, B, Q, 4)`` in one pass, from the assignments in ``solved``; None when an assignment
    is missing (the caller then runs the stock per-layer calls). ``selected`` (``(L, B, Q)`` bools on the host;
    None: every query): the queries each layer's loss takes, as though the others had been cut out (DDQ-DETR's
    distinct queries); the others are weighted 0 and counted nowhere."""
    host_gt_inds = _host_gt_inds(solved, scores, batch_gt_instances)
    if host_gt_inds is None:
        return None
    if selected is not None:
        host_gt_inds = np.where(selected, host_gt_inds, -1)
    num_layers, batch, num_queries, num_classes = scores.shape
    device = scores.device
    num_pos = (host_gt_inds > 0).reshape(num_layers, -1).sum(1)
    num_neg = (host_gt_inds == 0).reshape(num_layers, -1).sum(1)

    factors = _image_factors(batch_img_metas, bbox_preds)  # (B, 4): w, h, w, h
    gt_dtype = batch_gt_instances[0].bboxes.dtype
    target_boxes, target_labels = _padded_targets(batch_gt_instances, factors, head.num_classes)
    # (L, B, Q) gt index per query, row 0 (background) for the queries left out
    rows = _to_device_without_blocking(torch.from_numpy(np.maximum(host_gt_inds, 0)), device)
    labels = target_labels.unsqueeze(0).expand(num_layers, -1, -1).gather(2, rows)
    bbox_targets = target_boxes.unsqueeze(0).expand(num_layers, -1, -1, -1).gather(
        2, rows.unsqueeze(-1).expand(-1, -1, -1, 4))
    positive = (rows > 0).to(gt_dtype)

    # Classification: mmdet's focal loss per element (loss_weight included), summed per layer.
    cls_avg = num_pos * 1.0 + num_neg * head.bg_cls_weight
    flat_scores = scores.reshape(-1, num_classes)
    if selected is None:
        label_weights = flat_scores.new_ones(flat_scores.shape[0], dtype=gt_dtype)
    else:
        label_weights = _to_device_without_blocking(torch.from_numpy(host_gt_inds.reshape(-1) >= 0), device).to(
            gt_dtype)
    cls_elements = focal_loss_elements(head.loss_cls, flat_scores, labels.reshape(-1), label_weights)
    cls_sums = cls_elements.reshape(num_layers, -1).sum(1)

    l1_sums, iou_sums = box_loss_sums(head, bbox_preds, bbox_targets, positive, factors)
    return _normalised(head, cls_sums, l1_sums, iou_sums, cls_avg, num_pos)


def box_loss_sums(head, bbox_preds: torch.Tensor, bbox_targets: torch.Tensor, positive: torch.Tensor,
                  factors: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per layer, the weighted sums of stock's normalized L1 and pixel-space GIoU elements (``loss_weight``
    included) of ``bbox_preds`` and ``bbox_targets`` ``(L, B, Q, 4)``; ``positive`` ``(L, B, Q)`` weighs each
    query, ``factors`` ``(B, 4)`` are the images' (w, h, w, h)."""
    from mmdet.structures.bbox import bbox_cxcywh_to_xyxy
    num_layers = bbox_preds.shape[0]
    image_factors = factors[None, :, None]
    pixel_preds = (bbox_cxcywh_to_xyxy(bbox_preds) * image_factors).reshape(-1, 4)
    pixel_targets = (bbox_cxcywh_to_xyxy(bbox_targets) * image_factors).reshape(-1, 4)
    # mmdet's giou_loss with reduction='none': 1 - the aligned GIoU (its eps filled on the device, not copied).
    iou_elements = 1 - bbox_overlaps_without_sync(pixel_preds, pixel_targets, mode="giou", is_aligned=True,
                                                  eps=head.loss_iou.eps)
    iou_sums = head.loss_iou.loss_weight * (iou_elements * positive.reshape(-1)).reshape(num_layers, -1).sum(1)
    l1_elements = torch.abs(bbox_preds - bbox_targets) * positive.unsqueeze(-1)
    l1_sums = head.loss_bbox.loss_weight * l1_elements.reshape(num_layers, -1).sum(1)
    return l1_sums, iou_sums


def _normalised(head, cls_sums: torch.Tensor, l1_sums: torch.Tensor, iou_sums: torch.Tensor, cls_avg: np.ndarray,
                num_pos: np.ndarray) -> List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per layer ``(loss_cls, loss_bbox, loss_iou)``: each layer's sums divided by its normalisers as stock divides
    them (``cls_avg`` and ``num_pos`` per layer, on the host), in stock's shapes; in distributed training the counts
    are averaged over ranks in one all-reduce. The box losses are 0-dim, as stock's: it divides them by a Python
    number (in distributed training the ``.item()`` of the averaged count, a host sync that this path does not make).
    """
    from mmdet.utils import reduce_mean
    num_layers = cls_sums.shape[0]
    distributed = _distributed()
    if distributed:
        # One non-blocking copy of every count (new_tensor would wait for the GPU); the same values.
        counts = torch.from_numpy(np.stack([cls_avg, num_pos, np.maximum(cls_avg, 1)]).astype(np.float64))
        counts = _to_device_without_blocking(counts.to(cls_sums.dtype), cls_sums.device)
        cls_mean, pos_mean = reduce_mean(counts[:2]).clamp(min=1)
        cls_divisor = (cls_mean if head.sync_cls_avg_factor else counts[2]) + _AVG_FACTOR_EPS
        pos_divisor = pos_mean + _AVG_FACTOR_EPS
    else:
        host_divisors = torch.from_numpy(np.stack([np.maximum(cls_avg, 1), np.maximum(num_pos, 1)]).astype(np.float64)
                                         + _AVG_FACTOR_EPS)
        cls_divisor, pos_divisor = _to_device_without_blocking(host_divisors.to(cls_sums.dtype), cls_sums.device)
    loss_cls = cls_sums / cls_divisor
    loss_bbox = l1_sums / pos_divisor
    loss_iou = iou_sums / pos_divisor
    # Stock shapes: under sync_cls_avg_factor, loss_cls has the shape of its normaliser, a 1-element tensor unless
    # ``max(normaliser, 1)`` picked the Python 1 (in distributed training the mean of the ranks' counts is >= 1
    # unless no rank has a positive; only stock's host sync could tell, so this path keeps the dimension).
    cls_keeps_dim = [head.sync_cls_avg_factor and (distributed or cls_avg[layer] >= 1) for layer in range(num_layers)]
    return [(loss_cls[layer:layer + 1] if cls_keeps_dim[layer] else loss_cls[layer],
             loss_bbox[layer], loss_iou[layer]) for layer in range(num_layers)]


def proposal_matching_groups(head, arguments: dict) -> list:
    """The two-stage encoder's proposals with the class-0 copies of the gts that ``loss_by_feat`` matches them
    against, as one ``(prediction_sets, batch_gt_instances)`` group for the step's matching pass (none for other
    heads)."""
    if not arguments["batch_gt_instances"] or not _two_stage_proposals(head, arguments):
        return []
    proposal_gts = [_relabelled_as_class_0(gts) for gts in arguments["batch_gt_instances"]]
    return [([(arguments["enc_cls_scores"], arguments["enc_bbox_preds"])], proposal_gts)]


def solve_losses_ahead(head, prediction_sets: Sequence[Tuple[torch.Tensor, torch.Tensor]], arguments: dict,
                       solved: Dict, proposal_groups: Sequence = (), layer_losses_of=None) -> Dict:
    """Every layer's losses of each ``(scores, bboxes)`` set, keyed as ``loss_by_feat_single`` will see the layer;
    ``arguments`` are those of the head's ``loss_by_feat`` call. ``proposal_groups`` (from
    :func:`proposal_matching_groups`) were solved in the same pass: their losses are found by their scores alone.
    ``layer_losses_of`` computes them (:func:`layer_losses`'s signature; it is the default)."""
    layer_losses_of = layer_losses_of or layer_losses
    batch_gt_instances, batch_img_metas = arguments["batch_gt_instances"], arguments["batch_img_metas"]
    ahead = {}
    if not batch_gt_instances:
        return ahead
    for scores, bboxes in prediction_sets:
        _add_layer_losses(ahead, head, scores, bboxes, batch_gt_instances, batch_img_metas, solved,
                          _gts_key(batch_gt_instances), layer_losses_of)
    for sets, proposal_gts in proposal_groups:
        for scores, bboxes in sets:
            _add_layer_losses(ahead, head, scores, bboxes, proposal_gts, batch_img_metas, solved, _PROPOSALS_KEY,
                              layer_losses_of)
    return ahead


# loss_by_feat makes the relabelled proposal gts itself: the encoder's losses are found by its scores alone.
_PROPOSALS_KEY = ("two-stage proposals",)


def _gts_key(batch_gt_instances) -> tuple:
    return (id(batch_gt_instances),)


def _add_layer_losses(ahead, head, scores, bboxes, batch_gt_instances, batch_img_metas, solved, gts_key,
                      layer_losses_of):
    if scores.dim() == 3:
        scores, bboxes = scores[None], bboxes[None]
    losses = layer_losses_of(head, scores, bboxes, batch_gt_instances, batch_img_metas, solved)
    if losses is not None:
        for layer, layer_result in enumerate(losses):
            ahead[_prediction_key(scores[layer], None) + gts_key] = layer_result


def _two_stage_proposals(head, arguments: dict) -> bool:
    # DINO matches its encoder against the gts as they are (a prediction set of its own); Deformable-DETR's
    # two-stage encoder against class-0 copies.
    from mmdet.models.dense_heads import DINOHead
    return not isinstance(head, DINOHead) and arguments.get("enc_cls_scores") is not None


def _relabelled_as_class_0(gt_instances):
    relabelled = gt_instances.clone()
    relabelled.labels = torch.zeros_like(gt_instances.labels)
    return relabelled


def _loss_by_feat_single_from_ahead(head):
    """``head.loss_by_feat_single`` that returns a layer's losses computed ahead, else runs as before."""
    loss_by_feat_single = head.loss_by_feat_single

    def loss_by_feat_single_from_ahead(cls_scores, bbox_preds, batch_gt_instances, batch_img_metas):
        ahead = getattr(head, "losses_ahead", None)
        if ahead:
            scores_key = _prediction_key(cls_scores, None)
            found = ahead.get(scores_key + _gts_key(batch_gt_instances), ahead.get(scores_key + _PROPOSALS_KEY))
            if found is not None:
                return found
        return loss_by_feat_single(cls_scores, bbox_preds, batch_gt_instances=batch_gt_instances,
                                   batch_img_metas=batch_img_metas)

    return loss_by_feat_single_from_ahead


def denoising_layer_losses(head, scores: torch.Tensor, bbox_preds: torch.Tensor, batch_gt_instances,
                           batch_img_metas, dn_meta) -> Optional[Tuple[List[torch.Tensor], ...]]:
    """DINO's ``loss_dn``: ``([loss_cls], [loss_bbox], [loss_iou])`` of every layer of the denoising ``scores``
    ``(L, B, Qdn, C)`` and ``bbox_preds`` ``(L, B, Qdn, 4)`` in one pass; None where there are no denoising queries
    (the caller then runs the stock calls).

    The denoising targets depend on the gts and ``dn_meta`` only, not on the predictions: stock builds the same
    targets once per layer; here they are built once (:func:`_denoising_targets`, without its blocking copies).
    Each element is stock's formula, the per-layer sums run over a ``(layers, ...)`` view, and the box normaliser
    stays on the host (stock's ``.item()`` per layer)."""
    from mmdet.structures.bbox import bbox_cxcywh_to_xyxy

    num_layers, batch, num_queries, num_classes = scores.shape
    if num_layers == 0 or batch * num_queries == 0:
        return None
    (labels_list, label_weights_list, bbox_targets_list, bbox_weights_list, num_pos,
     num_neg) = _denoising_targets(head, batch_gt_instances, batch_img_metas, dn_meta)
    labels = torch.cat(labels_list, 0)
    label_weights = torch.cat(label_weights_list, 0)
    bbox_targets = torch.cat(bbox_targets_list, 0).view(batch, num_queries, 4)
    bbox_weights = torch.cat(bbox_weights_list, 0).view(batch, num_queries, 4)

    cls_avg = num_pos * 1.0 + num_neg * head.bg_cls_weight
    cls_elements = focal_loss_elements(head.loss_cls, scores.reshape(-1, num_classes), labels.repeat(num_layers),
                                       label_weights.repeat(num_layers))
    cls_sums = cls_elements.reshape(num_layers, -1).sum(1)

    image_factors = _image_factors(batch_img_metas, bbox_preds)[None, :, None]  # (1, B, 1, 4)
    pixel_preds = (bbox_cxcywh_to_xyxy(bbox_preds) * image_factors).reshape(-1, 4)
    pixel_targets = (bbox_cxcywh_to_xyxy(bbox_targets)[None] * image_factors).expand(num_layers, -1, -1, -1)
    iou_weights = bbox_weights.mean(-1)  # GIoULoss averages a (N, 4) weight over its last dimension
    iou_elements = 1 - bbox_overlaps_without_sync(pixel_preds, pixel_targets.reshape(-1, 4), mode="giou",
                                                  is_aligned=True, eps=head.loss_iou.eps)
    iou_sums = head.loss_iou.loss_weight * (iou_elements.reshape(num_layers, batch, num_queries)
                                            * iou_weights).reshape(num_layers, -1).sum(1)
    l1_sums = head.loss_bbox.loss_weight * (torch.abs(bbox_preds - bbox_targets) * bbox_weights).reshape(
        num_layers, -1).sum(1)

    per_layer = _normalised(head, cls_sums, l1_sums, iou_sums, np.full(num_layers, cls_avg),
                            np.full(num_layers, num_pos))
    return tuple(list(losses) for losses in zip(*per_layer))


def _denoising_targets(head, batch_gt_instances, batch_img_metas, dn_meta):
    """mmdet 3.3.0's ``DINOHead.get_dn_targets`` (per-image lists, total positive and negative counts), each image's
    size factor copied without blocking (mmdet's ``new_tensor`` waits for the GPU); the same values."""
    per_image = [_denoising_targets_single(head, gt_instances, img_meta, dn_meta)
                 for gt_instances, img_meta in zip(batch_gt_instances, batch_img_metas)]
    labels, label_weights, bbox_targets, bbox_weights, pos_inds, neg_inds = (list(part) for part in zip(*per_image))
    return (labels, label_weights, bbox_targets, bbox_weights, sum(inds.numel() for inds in pos_inds),
            sum(inds.numel() for inds in neg_inds))


def _denoising_targets_single(head, gt_instances, img_meta, dn_meta):
    # mmdet 3.3.0's DINOHead._get_dn_targets_single; only the factor (and the empty index tensors) are made otherwise.
    from mmdet.structures.bbox import bbox_xyxy_to_cxcywh
    gt_bboxes, gt_labels = gt_instances.bboxes, gt_instances.labels
    num_groups = dn_meta["num_denoising_groups"]
    num_denoising_queries = dn_meta["num_denoising_queries"]
    num_queries_each_group = int(num_denoising_queries / num_groups)
    device = gt_bboxes.device
    if len(gt_labels) > 0:
        t = torch.arange(len(gt_labels), dtype=torch.long, device=device).unsqueeze(0).repeat(num_groups, 1)
        pos_assigned_gt_inds = t.flatten()
        pos_inds = torch.arange(num_groups, dtype=torch.long, device=device)
        pos_inds = (pos_inds.unsqueeze(1) * num_queries_each_group + t).flatten()
    else:
        pos_inds = pos_assigned_gt_inds = torch.zeros(0, dtype=torch.long, device=device)
    neg_inds = pos_inds + num_queries_each_group // 2
    labels = gt_bboxes.new_full((num_denoising_queries,), head.num_classes, dtype=torch.long)
    labels[pos_inds] = gt_labels[pos_assigned_gt_inds]
    label_weights = gt_bboxes.new_ones(num_denoising_queries)
    bbox_targets = torch.zeros(num_denoising_queries, 4, device=device)
    bbox_weights = torch.zeros(num_denoising_queries, 4, device=device)
    # index_fill_, not `bbox_weights[pos_inds] = 1.0`: torch <= 2.11 copies that Python scalar to the GPU with a
    # blocking copy (a host sync per image); the same rows are set.
    bbox_weights.index_fill_(0, pos_inds, 1.0)
    factor = image_size_factor(img_meta, gt_bboxes)
    bbox_targets[pos_inds] = bbox_xyxy_to_cxcywh(gt_bboxes / factor).repeat([num_groups, 1])
    return labels, label_weights, bbox_targets, bbox_weights, pos_inds, neg_inds


def _batched_loss_dn(head, denoising_losses_of):
    """``head.loss_dn`` computing every layer's denoising losses in one pass (``denoising_losses_of``, with
    :func:`denoising_layer_losses`'s signature), else as before."""
    loss_dn = head.loss_dn

    def batched_loss_dn(all_layers_denoising_cls_scores, all_layers_denoising_bbox_preds, batch_gt_instances,
                        batch_img_metas, dn_meta):
        losses = denoising_losses_of(head, all_layers_denoising_cls_scores, all_layers_denoising_bbox_preds,
                                        batch_gt_instances, batch_img_metas, dn_meta)
        if losses is None:
            return loss_dn(all_layers_denoising_cls_scores, all_layers_denoising_bbox_preds, batch_gt_instances,
                           batch_img_metas, dn_meta)
        return losses

    return batched_loss_dn


def _stock_denoising_losses(head) -> bool:
    from mmdet.models.dense_heads import DINOHead
    return isinstance(head, DINOHead) and all(getattr(type(head), name) is getattr(DINOHead, name) for name in (
        "loss_dn", "_loss_dn_single", "get_dn_targets", "_get_dn_targets_single"))


def enable_batched_losses(head) -> bool:
    """Give one head whose matching is solved ahead (``batched_matching``) the batched per-layer losses (and
    DINO's denoising losses in one pass); False if its losses are not the stock modules this pass reproduces, or
    it has them already."""
    if not batchable_head(head):
        return False
    # This module's functions, looked up at each call.
    denoising = (lambda *args: denoising_layer_losses(*args)) if _stock_denoising_losses(head) else None
    return install_batched_losses(head, None, denoising)


def install_batched_losses(head, layer_losses_of=None, denoising_losses_of=None) -> bool:
    """Make ``head``'s per-layer losses come from one pass (``layer_losses_of``, :func:`layer_losses`'s signature;
    None: that function) over the assignments solved ahead, and its denoising losses from ``denoising_losses_of``
    where given; False if it has them already."""
    if "prepare_layer_losses" in vars(head):
        return False

    def prepare_layer_losses(prediction_sets, arguments, solved, extra_groups=()):
        head.losses_ahead = solve_losses_ahead(head, prediction_sets, arguments, solved, extra_groups,
                                               layer_losses_of)

    head.loss_by_feat_single = _loss_by_feat_single_from_ahead(head)
    head.extra_matching_groups = functools.partial(proposal_matching_groups, head)
    head.prepare_layer_losses = prepare_layer_losses
    if denoising_losses_of is not None:
        head.loss_dn = _batched_loss_dn(head, denoising_losses_of)
    return True
