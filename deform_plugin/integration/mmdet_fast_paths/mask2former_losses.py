"""Mask2Former's losses with every assignment of a step solved in one pass (``batched_matching`` on its head).

mmdet 3.3.0's ``MaskFormerHead.loss_by_feat`` runs ``Mask2FormerHead._loss_by_feat_single`` once per decoder layer
(10 in the R50 config), and that builds its targets image by image: per (layer, image) a cost matrix copied to the
host (a wait for the GPU), two ``nonzero()`` calls in the sampler, then per layer a boolean selection of the matched
masks and a ``max()`` on a device tensor: about 70 host syncs per step, each of which drains the GPU's queue while
the host then issues the next small kernels alone.

Here, as ``loss_by_feat`` of a Mask2Former head: the cost matrices of every (layer, image) pair are built on the
same sampled points, copied to the host in one transfer and solved; the matched query and gt indices reach the
device in one non-blocking copy; the targets and losses are indexed instead of boolean-selected. The normaliser
(matched masks, at least one per image, averaged over ranks) is the same integer in every layer: it is computed on
the host and all-reduced once. The eager tail is host-bound (the network's forward and backward replay from CUDA
graphs), so the layers are batched where mmdet's arithmetic allows it: an image's cost matrices of every layer at
once (mmdet's ``ClassificationCost``, sigmoid ``CrossEntropyLossCost`` and ``DiceCost`` with a layer dimension;
other cost terms: the assigner's own calls per layer), and the dice and mask losses of every layer at once when
every gt is matched in every layer (mmdet's ``DiceLoss`` and sigmoid ``CrossEntropyLoss`` arithmetic; otherwise
the head's own loss modules per layer), and the classification losses of every layer at once (mmdet's
class-weighted softmax ``CrossEntropyLoss``; another loss module runs per layer).

Exact: mmdet draws the random sample points layer by layer (each image's matching points, then the loss's
oversampled and random points); this pass draws the same tensors in the same order before it starts, so a seeded
step gets the same numbers, the same assignments and the same losses up to float rounding (test).
"""
from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch.profiler import record_function

from .batched_matching import costs_to_host
from .mask2former_targets import enable_mask2former_sync_free_targets
from .matching import _cost_matrix, _solve, _to_device_without_blocking, host_solves


class _StockDraws:
    """The random points of one step, drawn in mmdet's order: per layer, each image's matching points, then (when
    the batch has gts) the loss's oversampled points and its random points."""

    def __init__(self, head, num_layers: int, num_images: int, num_masks: int, device: torch.device):
        num_sampled = int(head.num_points * head.oversample_ratio)
        num_random = head.num_points - int(head.importance_sample_ratio * head.num_points)
        self.matching: List[List[torch.Tensor]] = []
        self.oversampled: List[Optional[torch.Tensor]] = []
        self.random: List[Optional[torch.Tensor]] = []
        for _ in range(num_layers):
            self.matching.append([torch.rand((1, head.num_points, 2), device=device) for _ in range(num_images)])
            if num_masks == 0:  # mmdet returns before sampling the loss's points
                self.oversampled.append(None)
                self.random.append(None)
                continue
            self.oversampled.append(torch.rand(num_masks, num_sampled, 2, device=device))
            self.random.append(torch.rand(num_masks, num_random, 2, device=device) if num_random > 0 else None)


def _solve_every_layer(head, all_cls_scores, all_mask_preds, batch_gt_instances, batch_img_metas,
                       draws: _StockDraws) -> List[List[np.ndarray]]:
    """Per layer and image, the per-query ``gt_inds`` (1-based, 0 for background) of mmdet's assignment."""
    from mmcv.ops import point_sample
    from mmengine.structures import InstanceData

    num_layers, num_queries = len(all_cls_scores), all_cls_scores[0].shape[1]
    solved = [[np.zeros(num_queries, dtype=np.int64) for _ in batch_gt_instances] for _ in range(num_layers)]
    with record_function("deform_plugin::matching"):
        flat_costs, blocks = [], []
        with record_function("deform_plugin::matching.cost_terms"):
            for image, (gt_instances, img_meta) in enumerate(zip(batch_gt_instances, batch_img_metas)):
                num_gts = len(gt_instances)
                if num_gts == 0:
                    continue  # the assigner's edge case: every query is background
                # Every layer's points at once: a grid of (layers x points) samples each gt mask like mmdet's
                # per-layer calls (the same bilinear weights per point).
                coords = torch.cat([draws.matching[layer][image] for layer in range(num_layers)], dim=1)
                gt_points = point_sample(gt_instances.masks.unsqueeze(0).float(), coords)[0]
                gt_points = gt_points.view(num_gts, num_layers, -1)
                mask_points = [point_sample(all_mask_preds[layer][image:image + 1], draws.matching[layer][image])[0]
                               for layer in range(num_layers)]
                costs = _layered_cost_matrices(
                    head.assigner, torch.stack([all_cls_scores[layer][image] for layer in range(num_layers)]),
                    torch.stack(mask_points), gt_instances.labels, gt_points.transpose(0, 1))
                if costs is not None:
                    flat_costs.append(costs.reshape(-1))
                    blocks += [(layer, image, costs.shape[1:]) for layer in range(num_layers)]
                    continue
                for layer in range(num_layers):
                    pred_instances = InstanceData(scores=all_cls_scores[layer][image], masks=mask_points[layer])
                    sampled_gts = InstanceData(labels=gt_instances.labels, masks=gt_points[:, layer])
                    cost = _cost_matrix(head.assigner, pred_instances, sampled_gts, img_meta)
                    flat_costs.append(cost.reshape(-1))
                    blocks.append((layer, image, cost.shape))
        if not flat_costs:
            return solved
        with record_function("deform_plugin::matching.wait_and_copy_to_host"):
            host = costs_to_host(flat_costs)
        with host_solves():
            offset = 0
            for layer, image, (rows, cols) in blocks:
                solved[layer][image] = _solve(host[offset:offset + rows * cols].reshape(rows, cols))
                offset += rows * cols
    return solved


def _layered_cost_matrices(assigner, scores: torch.Tensor, mask_points: torch.Tensor, gt_labels: torch.Tensor,
                           gt_points: torch.Tensor) -> Optional[torch.Tensor]:
    """Every layer's cost matrix of one image at once, ``(layers, queries, gts)``: mmdet 3.3.0's
    ``ClassificationCost``, ``CrossEntropyLossCost`` (sigmoid) and ``DiceCost`` with a layer dimension in front
    (batched ``einsum`` where mmdet makes one per layer), summed as ``HungarianAssigner.assign`` sums them. None if
    the assigner has other cost terms.

    ``scores``: ``(layers, queries, classes + 1)`` logits; ``mask_points``: ``(layers, queries, points)`` mask logits
    at each layer's points; ``gt_points``: ``(layers, gts, points)`` the gt masks at the same points.
    """
    from mmdet.models.task_modules.assigners.match_cost import ClassificationCost, CrossEntropyLossCost, DiceCost
    costs = []
    for match_cost in assigner.match_costs:
        kind = type(match_cost)
        if kind is ClassificationCost:
            cost = -scores.softmax(-1)[..., gt_labels]
        elif kind is CrossEntropyLossCost and match_cost.use_sigmoid:
            preds, gts = mask_points.float(), gt_points.float()
            positive = F.binary_cross_entropy_with_logits(preds, torch.ones_like(preds), reduction="none")
            negative = F.binary_cross_entropy_with_logits(preds, torch.zeros_like(preds), reduction="none")
            cost = torch.einsum("lnc,lmc->lnm", positive, gts) + torch.einsum("lnc,lmc->lnm", negative, 1 - gts)
            cost = cost / preds.shape[-1]
        elif kind is DiceCost:
            preds = mask_points.sigmoid() if match_cost.pred_act else mask_points
            gts = gt_points.float()
            numerator = 2 * torch.einsum("lnc,lmc->lnm", preds, gts)
            if match_cost.naive_dice:
                denominator = preds.sum(-1)[..., :, None] + gts.sum(-1)[..., None, :]
            else:
                denominator = preds.pow(2).sum(-1)[..., :, None] + gts.pow(2).sum(-1)[..., None, :]
            cost = 1 - (numerator + match_cost.eps) / (denominator + match_cost.eps)
        else:
            return None
        costs.append(cost * match_cost.weight)
    return torch.stack(costs).sum(dim=0).detach()


def _matched_indices(solved: List[List[np.ndarray]], num_queries: int, gt_offsets: List[int], device):
    """Per layer, the flat (image * queries + query) indices of the matched queries in mmdet's boolean-selection
    order, the matched gts' indices into the batch's concatenated gts, and how many images matched nothing: one
    non-blocking copy for every layer."""
    queries, gts, counts, empty_images = [], [], [], []
    for per_image in solved:
        layer_queries, layer_gts, empty = [], [], 0
        for image, gt_inds in enumerate(per_image):
            matched = np.flatnonzero(gt_inds > 0)  # sorted, as the sampler's nonzero().unique()
            layer_queries.append(image * num_queries + matched)
            layer_gts.append(gt_offsets[image] + gt_inds[matched] - 1)
            empty += len(matched) == 0
        queries.append(np.concatenate(layer_queries))
        gts.append(np.concatenate(layer_gts))
        counts.append(len(queries[-1]))
        empty_images.append(empty)
    both = _to_device_without_blocking(torch.from_numpy(np.concatenate(queries + gts).astype(np.int64)), device)
    total = sum(counts)
    query_splits = both[:total].split(counts)
    gt_splits = both[total:].split(counts)
    return list(zip(query_splits, gt_splits)), counts, empty_images


def _uncertain_points(head, mask_preds: torch.Tensor, oversampled: torch.Tensor, random: Optional[torch.Tensor]):
    """mmdet's ``get_uncertain_point_coords_with_randomness`` on points drawn ahead."""
    from mmcv.ops import point_sample
    from mmdet.models.utils.point_sample import get_uncertainty

    num_masks, num_sampled = oversampled.shape[:2]
    num_uncertain = int(head.importance_sample_ratio * head.num_points)
    uncertainties = get_uncertainty(point_sample(mask_preds, oversampled), None)
    idx = torch.topk(uncertainties[:, 0, :], k=num_uncertain, dim=1)[1]
    idx += num_sampled * torch.arange(num_masks, dtype=torch.long, device=mask_preds.device)[:, None]
    coords = oversampled.view(-1, 2)[idx.view(-1), :].view(num_masks, num_uncertain, 2)
    if random is not None:
        coords = torch.cat((coords, random), dim=1)
    return coords


def _mask_losses_of_every_layer(head, all_mask_preds, matched, counts: List[int], all_gt_masks: torch.Tensor,
                                draws: _StockDraws, normalisers):
    """Every layer's dice and mask losses in one pass: mmdet 3.3.0's ``DiceLoss`` (sigmoid) and sigmoid
    ``CrossEntropyLoss`` arithmetic on the same points, with a layer dimension in front. Each (1,) loss equals
    mmdet's per-layer call up to float summation order.

    Each gt mask is point-sampled once, at its points of every layer (mmdet samples each layer's matched gt masks
    anew). That needs every gt matched in every layer, as Hungarian matching does while the queries outnumber the
    gts; otherwise, or for loss modules other than mmdet's, this returns None and the caller runs mmdet's per-layer
    arithmetic.
    """
    from mmcv.ops import point_sample
    from mmdet.models.losses import CrossEntropyLoss, DiceLoss
    from mmdet.models.losses.cross_entropy_loss import binary_cross_entropy
    num_layers, num_gts = len(all_mask_preds), all_gt_masks.shape[0]
    loss_dice, loss_mask = head.loss_dice, head.loss_mask
    if (num_gts == 0 or any(count != num_gts for count in counts)
            or type(loss_dice) is not DiceLoss or not (loss_dice.use_sigmoid and loss_dice.activate)
            or loss_dice.reduction != "mean"
            or type(loss_mask) is not CrossEntropyLoss or not loss_mask.use_sigmoid
            or loss_mask.cls_criterion is not binary_cross_entropy or loss_mask.class_weight is not None
            or loss_mask.reduction != "mean"):
        return None
    gt_inds = torch.stack([gts for _, gts in matched])                      # (layers, gts): a permutation each
    matched_preds = torch.stack([preds.flatten(0, 1)[queries] for preds, (queries, _) in zip(all_mask_preds, matched)])
    flat_preds = matched_preds.flatten(0, 1).unsqueeze(1)                    # (layers * gts, 1, H, W)
    oversampled = torch.stack(draws.oversampled).flatten(0, 1)
    random = None if draws.random[0] is None else torch.stack(draws.random).flatten(0, 1)
    with torch.no_grad():
        coords = _uncertain_points(head, flat_preds, oversampled, random)      # (layers * gts, points, 2)
        num_points = coords.shape[1]
        layer_ids = torch.arange(num_layers, device=coords.device)[:, None]
        by_gt = coords.new_empty(num_gts, num_layers, num_points, 2)
        by_gt[gt_inds, layer_ids] = coords.view(num_layers, num_gts, num_points, 2)
        sampled = point_sample(all_gt_masks.unsqueeze(1).float(), by_gt.view(num_gts, -1, 2))
        point_targets = sampled.view(num_gts, num_layers, num_points)[gt_inds, layer_ids]
    point_preds = point_sample(flat_preds, coords).view(num_layers, num_gts, num_points)
    avg_factors = torch.cat(list(normalisers))                               # (layers,)
    eps = torch.finfo(torch.float32).eps                                     # weight_reduce_loss's

    probabilities = point_preds.sigmoid()
    overlap = torch.sum(probabilities * point_targets, -1)
    if loss_dice.naive_dice:
        dice = (2 * overlap + loss_dice.eps) / (torch.sum(probabilities, -1) + torch.sum(point_targets, -1)
                                                + loss_dice.eps)
    else:
        dice = (2 * overlap) / (torch.sum(probabilities * probabilities, -1) + loss_dice.eps
                                + torch.sum(point_targets * point_targets, -1) + loss_dice.eps)
    losses_dice = loss_dice.loss_weight * ((1 - dice).sum(-1) / (avg_factors + eps))

    ignore_index = -100 if loss_mask.ignore_index is None else loss_mask.ignore_index
    valid = ((point_targets >= 0) & (point_targets != ignore_index)).float()
    bce = F.binary_cross_entropy_with_logits(point_preds, point_targets.float(), reduction="none")
    losses_mask = loss_mask.loss_weight * ((bce * valid).flatten(1).sum(-1)
                                           / (avg_factors * head.num_points + eps))
    return list(losses_dice.split(1)), list(losses_mask.split(1))


def _classification_losses_of_every_layer(head, all_cls_scores, labels: torch.Tensor, label_weights: torch.Tensor,
                                          class_weight: torch.Tensor) -> Optional[List[torch.Tensor]]:
    """Every layer's classification loss in one pass: mmdet 3.3.0's softmax ``CrossEntropyLoss`` with the head's
    class weights (``cross_entropy``, then the weighted sum over the layer's queries divided by the layer's summed
    class weights), with a layer dimension in front; ``labels``: ``(layers, images * queries)``. None for another
    loss module (the caller runs it per layer)."""
    loss_cls = head.loss_cls
    if not _weighted_softmax_cross_entropy(head) or loss_cls.reduction != "mean":
        return None
    scores = torch.stack([cls_scores.flatten(0, 1) for cls_scores in all_cls_scores])
    ignore_index = -100 if loss_cls.ignore_index is None else loss_cls.ignore_index
    loss = F.cross_entropy(scores.flatten(0, 1), labels.flatten(), weight=class_weight, reduction="none",
                           ignore_index=ignore_index).view(labels.shape)
    avg_factors = class_weight[labels].sum(-1)
    eps = torch.finfo(torch.float32).eps  # weight_reduce_loss's
    return list((loss_cls.loss_weight * ((loss * label_weights.float()).sum(-1) / (avg_factors + eps))).unbind(0))


def _weighted_softmax_cross_entropy(head) -> bool:
    """Whether the head's classification loss is mmdet's softmax ``CrossEntropyLoss`` with the head's class
    weights (whose arithmetic the fast paths run with those weights already on the device)."""
    from mmdet.models.losses import CrossEntropyLoss
    from mmdet.models.losses.cross_entropy_loss import cross_entropy
    loss_cls = head.loss_cls
    return (type(loss_cls) is CrossEntropyLoss and loss_cls.cls_criterion is cross_entropy
            and loss_cls.class_weight is not None and list(loss_cls.class_weight) == list(head.class_weight))


def _classification_loss(head, scores, labels, label_weights, class_weight, avg_factor):
    """``head.loss_cls(scores, labels, label_weights, avg_factor=...)``; for mmdet's softmax ``CrossEntropyLoss``
    with the head's class weights, its own criterion given those weights already on the device."""
    from mmdet.models.losses.cross_entropy_loss import cross_entropy
    loss_cls = head.loss_cls
    if not _weighted_softmax_cross_entropy(head):
        return loss_cls(scores, labels, label_weights, avg_factor=avg_factor)
    return loss_cls.loss_weight * cross_entropy(
        scores, labels, label_weights, class_weight=class_weight, reduction=loss_cls.reduction, avg_factor=avg_factor,
        ignore_index=loss_cls.ignore_index, avg_non_ignore=loss_cls.avg_non_ignore)


def mask2former_loss_by_feat_batched(self, all_cls_scores, all_mask_preds, batch_gt_instances: list,
                                     batch_img_metas: List[dict]) -> Dict[str, torch.Tensor]:
    """mmdet 3.3.0's ``MaskFormerHead.loss_by_feat`` of a Mask2Former head, with its matching solved in one pass
    and no other host sync (see the module's docstring)."""
    from mmcv.ops import point_sample
    from mmdet.utils import reduce_mean

    num_layers, num_images = len(all_cls_scores), len(batch_gt_instances)
    num_queries = all_cls_scores[0].shape[1]
    device = all_cls_scores[0].device
    num_gts = [len(gt_instances) for gt_instances in batch_gt_instances]
    # Hungarian matching gives each gt a query while queries last.
    draws = _StockDraws(self, num_layers, num_images, sum(min(n, num_queries) for n in num_gts), device)
    solved = _solve_every_layer(self, all_cls_scores, all_mask_preds, batch_gt_instances, batch_img_metas, draws)
    gt_offsets = np.concatenate([[0], np.cumsum(num_gts)[:-1]]).astype(np.int64).tolist()
    matched, counts, empty_images = _matched_indices(solved, num_queries, gt_offsets, device)
    all_gt_labels = torch.cat([gt_instances.labels for gt_instances in batch_gt_instances])
    all_gt_masks = torch.cat([gt_instances.masks for gt_instances in batch_gt_instances])
    # new_tensor(list) would be a blocking copy (as would mmdet's CrossEntropyLoss make its class weights per call).
    class_weight = _to_device_without_blocking(torch.tensor(self.class_weight, dtype=all_cls_scores[0].dtype), device)
    # mmdet's avg_factor: each image counts its matched masks, at least one.
    avg_factors = torch.tensor([float(count + empty) for count, empty in zip(counts, empty_images)])
    # Every layer's in one all-reduce (mmdet makes one per layer); each stays a (1,) tensor, as mmdet's. A mean of
    # per-rank counts that are each at least the number of images: mmdet's max(., 1) never applies.
    normalisers = reduce_mean(_to_device_without_blocking(avg_factors, device).to(all_cls_scores[0].dtype)).split(1)

    mask_losses = _mask_losses_of_every_layer(self, all_mask_preds, matched, counts, all_gt_masks, draws,
                                              normalisers)
    labels = torch.full((num_layers, num_images * num_queries), self.num_classes, dtype=torch.long, device=device)
    for layer, (query_inds, gt_inds) in enumerate(matched):
        labels[layer, query_inds] = all_gt_labels[gt_inds].long()
    label_weights = all_gt_labels.new_ones((num_images * num_queries,))
    losses_cls = _classification_losses_of_every_layer(self, all_cls_scores, labels, label_weights, class_weight)
    if losses_cls is None:
        losses_cls = [_classification_loss(self, cls_scores.flatten(0, 1), layer_labels, label_weights, class_weight,
                                           avg_factor=class_weight[layer_labels].sum())
                      for cls_scores, layer_labels in zip(all_cls_scores, labels)]

    if mask_losses is not None:
        losses_dice, losses_mask = mask_losses
    else:
        losses_dice, losses_mask = [], []
        for layer in range(num_layers):
            mask_preds = all_mask_preds[layer]
            query_inds, gt_inds = matched[layer]
            matched_preds = mask_preds.flatten(0, 1)[query_inds]
            if counts[layer] == 0:  # mmdet's "zero match"
                losses_dice.append(matched_preds.sum())
                losses_mask.append(matched_preds.sum())
                continue
            mask_targets = all_gt_masks[gt_inds]
            with torch.no_grad():
                coords = _uncertain_points(self, matched_preds.unsqueeze(1), draws.oversampled[layer],
                                           draws.random[layer])
                point_targets = point_sample(mask_targets.unsqueeze(1).float(), coords).squeeze(1)
            point_preds = point_sample(matched_preds.unsqueeze(1), coords).squeeze(1)
            losses_dice.append(self.loss_dice(point_preds, point_targets, avg_factor=normalisers[layer]))
            losses_mask.append(self.loss_mask(point_preds.reshape(-1), point_targets.reshape(-1),
                                              avg_factor=normalisers[layer] * self.num_points))

    loss_dict = dict(loss_cls=losses_cls[-1], loss_mask=losses_mask[-1], loss_dice=losses_dice[-1])
    for layer in range(num_layers - 1):
        loss_dict[f"d{layer}.loss_cls"] = losses_cls[layer]
        loss_dict[f"d{layer}.loss_mask"] = losses_mask[layer]
        loss_dict[f"d{layer}.loss_dice"] = losses_dice[layer]
    return loss_dict


def _batchable_mask2former_head(head) -> bool:
    """A Mask2Former head whose loss pieces are all mmdet's own, with a Hungarian assigner and the pseudo sampler."""
    from mmdet.models.dense_heads import Mask2FormerHead, MaskFormerHead
    from mmdet.models.task_modules.assigners import HungarianAssigner
    from mmdet.models.task_modules.samplers import MaskPseudoSampler
    cls = type(head)
    return (isinstance(head, Mask2FormerHead) and "loss_by_feat" not in vars(head)
            and cls.loss_by_feat is MaskFormerHead.loss_by_feat
            and cls.get_targets is MaskFormerHead.get_targets
            and cls._loss_by_feat_single is Mask2FormerHead._loss_by_feat_single
            and cls._get_targets_single is Mask2FormerHead._get_targets_single
            and isinstance(getattr(head, "assigner", None), HungarianAssigner)
            and type(getattr(head, "sampler", None)) is MaskPseudoSampler)


def enable_mask2former_batched_matching(model: torch.nn.Module) -> int:
    """Give every stock Mask2Former head in ``model`` the one-pass matching and sync-free losses, and the ground truth
    (panoptic stuff classes included) made without host syncs (:mod:`.mask2former_targets`); instance attributes:
    the class stays stock. Returns the number of heads changed."""
    changed = 0
    for module in model.modules():
        if _batchable_mask2former_head(module):
            module.loss_by_feat = mask2former_loss_by_feat_batched.__get__(module)
            enable_mask2former_sync_free_targets(module)
            changed += 1
    return changed
