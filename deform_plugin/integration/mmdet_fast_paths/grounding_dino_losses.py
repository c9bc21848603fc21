"""Grounding-DINO's text-conditioned head under ``hungarian_host_syncs`` and ``batched_losses``, and the switches
that have no exact form for it.

mmdet 3.3.0's ``GroundingDINOHead`` is DINO's head with a classification against text tokens: each query's scores
are its similarities to the caption's tokens (``-inf`` past the caption), a gt's target is its positive map (1 on
the tokens of its class name), and the per-layer loss keeps only the caption's tokens (``masked_select`` with the
text mask) before mmdet's sigmoid focal loss. Matching uses ``BinaryFocalLossCost`` over the same tokens.

- ``batched_matching`` needs nothing of its own: DINO's ``loss_by_feat`` is the head's, and the fewer-syncs
  ``assign`` calls the head's own cost terms on every layer's queries stacked as rows (:mod:`.batched_matching`).
- ``batched_losses`` (:func:`grounding_layer_losses`, :func:`grounding_denoising_losses`): every layer's targets are
  gathers from each image's padded gt boxes and positive maps; the focal loss runs elementwise over all layers'
  queries and every token, the tokens past the caption weighted 0 (their ``-inf`` logits replaced by 0 first, so
  they add exactly nothing and get no gradient, as ``masked_select`` drops them). Each kept element is mmdet's
  ``py_sigmoid_focal_loss`` of the same logit and target; only the sums run in another order, and the normalisers
  are stock's integers. The box losses and normalisers are :mod:`.batched_losses`'.
- ``hungarian_host_syncs`` (:func:`grounding_targets_single_fewer_syncs`): the head's per-layer targets from the
  assignment's host copy, where a call is not batched.
- ``sync_free_losses`` has no exact form here, nor ``cuda_graphs`` while activation checkpointing is on
  (:mod:`.graphed_grounding`): :func:`grounding_refusals` says why, and
  :func:`~deform_plugin.integration.mmdet_fast_paths.apply_fast_paths` refuses them.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import numpy as np
import torch
from torch import nn

from .batched_losses import (_host_gt_inds, _image_factors, _normalised, _padded_targets, box_loss_sums,
                             install_batched_losses, stock_loss_modules)
from .matching import _to_device_without_blocking, assign_with_host_indices, image_size_factor

__all__ = ["enable_grounding_batched_losses", "enable_grounding_host_syncs", "grounding_denoising_losses",
           "grounding_layer_losses", "grounding_refusals"]

# Why a switch has no exact form for Grounding-DINO (the switch's name first in FastPathsHook's message).
GROUNDING_DINO_REFUSALS = {
    "sync_free_losses": "GroundingDINOHead's own per-layer loss selects the caption's tokens with masked_select, "
                        "whose output size is read from the device, and has no sync-free copy here; batched_losses "
                        "computes every layer's loss without host syncs instead",
}


def _grounding_heads(model: nn.Module):
    from mmdet.models.dense_heads import GroundingDINOHead
    return [module for module in model.modules() if isinstance(module, GroundingDINOHead)]


def grounding_refusals(model: nn.Module, selected) -> Dict[str, str]:
    """For each switch of ``selected`` that has no exact form for a Grounding-DINO head of ``model`` (``cuda_graphs``:
    for this detector as configured, :func:`.graphed_grounding.graph_blockers`), why."""
    from mmdet.models.detectors import GroundingDINO
    if not _grounding_heads(model):
        return {}
    refusals = {name: reason for name, reason in GROUNDING_DINO_REFUSALS.items() if name in selected}
    if "cuda_graphs" in selected:
        from .graphed_grounding import graph_blockers
        blockers = [reason for module in model.modules() if isinstance(module, GroundingDINO)
                    for reason in graph_blockers(module)]
        if blockers:
            refusals["cuda_graphs"] = ("the captured backward (torch.autograd.grad) cannot run it: "
                                       + "; ".join(blockers))
    return refusals


def stock_grounding_head(head) -> bool:
    """Whether ``head`` is a ``GroundingDINOHead`` with mmdet 3.3.0's own targets and losses, on the stock loss
    modules."""
    from mmdet.models.dense_heads import DINOHead, GroundingDINOHead
    if not isinstance(head, GroundingDINOHead):
        return False
    own = ("loss", "loss_by_feat_single", "_get_targets_single", "_loss_dn_single", "_get_dn_targets_single")
    inherited = ("loss_by_feat", "loss_dn", "get_dn_targets", "split_outputs")
    return (all(getattr(type(head), name) is getattr(GroundingDINOHead, name) for name in own)
            and all(getattr(type(head), name) is getattr(DINOHead, name) for name in inherited)
            and stock_loss_modules(head))


def _text_mask(head, num_tokens: int) -> torch.Tensor:
    """``(B, num_tokens)`` True on the caption's tokens: the head's ``text_masks`` padded with False, as stock pads
    them."""
    masks = head.text_masks.bool()
    return torch.cat([masks, masks.new_zeros(masks.shape[0], num_tokens - masks.shape[1])], dim=1)


def text_focal_sums(loss_cls, scores: torch.Tensor, labels: torch.Tensor, text_mask: torch.Tensor) -> torch.Tensor:
    """Per layer, the sum of mmdet's sigmoid focal loss (``loss_weight`` included) of ``scores`` against
    ``labels`` ``(L, B, Q, T)`` over the tokens where ``text_mask`` ``(B, T)`` holds."""
    from mmdet.models.losses.focal_loss import py_sigmoid_focal_loss
    num_layers, num_tokens = scores.shape[0], scores.shape[-1]
    keep = text_mask[None, :, None, :].expand_as(scores)
    # The padded tokens' -inf logits would make NaNs (-inf * 0); with 0 instead and weight 0 they add exactly 0.
    logits = torch.where(keep, scores, scores.new_zeros(()))
    elements = py_sigmoid_focal_loss(logits.reshape(-1, num_tokens), labels.reshape(-1, num_tokens),
                                     keep.reshape(-1, num_tokens).to(logits.dtype), gamma=loss_cls.gamma,
                                     alpha=loss_cls.alpha, reduction="none")
    return loss_cls.loss_weight * elements.reshape(num_layers, -1).sum(1)


def _padded_positive_maps(batch_gt_instances, num_tokens: int, device) -> torch.Tensor:
    """``(B, 1 + G, T)``: per image a zero row (background), then its gts' positive maps, zero rows up to the most
    gts of any image."""
    most = max(len(gts) for gts in batch_gt_instances)
    maps = []
    for gts in batch_gt_instances:
        positive = gts.positive_maps.to(torch.float32) if len(gts) else torch.zeros(0, num_tokens, device=device)
        maps.append(torch.cat([positive.new_zeros(1, num_tokens), positive,
                               positive.new_zeros(most - len(gts), num_tokens)]))
    return torch.stack(maps)


def grounding_layer_losses(head, scores: torch.Tensor, bbox_preds: torch.Tensor, batch_gt_instances,
                           batch_img_metas, solved: Dict) -> Optional[List[tuple]]:
    """``GroundingDINOHead.loss_by_feat_single``'s ``(loss_cls, loss_bbox, loss_iou)`` of every layer of ``scores``
    ``(L, B, Q, T)`` and ``bbox_preds`` ``(L, B, Q, 4)`` in one pass, from the assignments in ``solved``; None when
    one is missing (the caller then runs the stock per-layer calls)."""
    host_gt_inds = _host_gt_inds(solved, scores, batch_gt_instances)
    if host_gt_inds is None:
        return None
    num_layers, _, _, num_tokens = scores.shape
    num_pos = (host_gt_inds > 0).reshape(num_layers, -1).sum(1)
    num_neg = (host_gt_inds == 0).reshape(num_layers, -1).sum(1)
    factors = _image_factors(batch_img_metas, bbox_preds)
    target_boxes, _ = _padded_targets(batch_gt_instances, factors, 0)
    rows = _to_device_without_blocking(torch.from_numpy(host_gt_inds), scores.device)  # (L, B, Q)
    bbox_targets = target_boxes.unsqueeze(0).expand(num_layers, -1, -1, -1).gather(
        2, rows.unsqueeze(-1).expand(-1, -1, -1, 4))
    maps = _padded_positive_maps(batch_gt_instances, num_tokens, scores.device)
    labels = maps.unsqueeze(0).expand(num_layers, -1, -1, -1).gather(
        2, rows.unsqueeze(-1).expand(-1, -1, -1, num_tokens))
    cls_sums = text_focal_sums(head.loss_cls, scores, labels, _text_mask(head, num_tokens))
    positive = (rows > 0).to(batch_gt_instances[0].bboxes.dtype)
    l1_sums, iou_sums = box_loss_sums(head, bbox_preds, bbox_targets, positive, factors)
    return _normalised(head, cls_sums, l1_sums, iou_sums, num_pos * 1.0 + num_neg * head.bg_cls_weight, num_pos)


def grounding_denoising_losses(head, scores: torch.Tensor, bbox_preds: torch.Tensor, batch_gt_instances,
                               batch_img_metas, dn_meta) -> Optional[tuple]:
    """DINO's ``loss_dn`` on Grounding-DINO's ``_loss_dn_single``: ``([loss_cls], [loss_bbox], [loss_iou])`` of every
    layer of the denoising ``scores`` ``(L, B, Qdn, T)`` in one pass, the targets built once; None without
    denoising queries (the caller then runs the stock calls)."""
    num_layers, batch, num_queries, num_tokens = scores.shape
    if num_layers == 0 or batch * num_queries == 0:
        return None
    per_image = [_grounding_denoising_targets_single(head, gts, meta, dn_meta)
                 for gts, meta in zip(batch_gt_instances, batch_img_metas)]
    labels, bbox_targets, positive, pos_counts = (list(part) for part in zip(*per_image))
    num_pos = sum(pos_counts)
    num_neg = num_pos  # each positive query's negative twin
    labels = torch.stack(labels).unsqueeze(0).expand(num_layers, -1, -1, -1)
    cls_sums = text_focal_sums(head.loss_cls, scores, labels, _text_mask(head, num_tokens))
    factors = _image_factors(batch_img_metas, bbox_preds)
    l1_sums, iou_sums = box_loss_sums(head, bbox_preds,
                                      torch.stack(bbox_targets).unsqueeze(0).expand(num_layers, -1, -1, -1),
                                      torch.stack(positive).unsqueeze(0).expand(num_layers, -1, -1), factors)
    per_layer = _normalised(head, cls_sums, l1_sums, iou_sums, np.full(num_layers, num_pos + num_neg
                                                                       * head.bg_cls_weight),
                            np.full(num_layers, num_pos))
    return tuple(list(losses) for losses in zip(*per_layer))


def _grounding_denoising_targets_single(head, gt_instances, img_meta, dn_meta):
    # mmdet 3.3.0's GroundingDINOHead._get_dn_targets_single: the labels, box targets and positive weights (stock's
    # bbox_weights rows are all 1 or all 0), the image-size factor copied without blocking.
    from mmdet.structures.bbox import bbox_xyxy_to_cxcywh
    gt_bboxes = gt_instances.bboxes
    num_groups = dn_meta["num_denoising_groups"]
    num_denoising_queries = dn_meta["num_denoising_queries"]
    num_queries_each_group = int(num_denoising_queries / num_groups)
    device = gt_bboxes.device
    count = len(gt_instances)
    gt_index = torch.arange(count, dtype=torch.long, device=device).unsqueeze(0).repeat(num_groups, 1)
    group_start = torch.arange(num_groups, dtype=torch.long, device=device).unsqueeze(1) * num_queries_each_group
    pos_inds = (group_start + gt_index).flatten()
    labels = gt_bboxes.new_zeros((num_denoising_queries, head.max_text_len), dtype=torch.float32)
    bbox_targets = torch.zeros(num_denoising_queries, 4, device=device)
    positive = torch.zeros(num_denoising_queries, device=device)
    if count:
        labels[pos_inds] = gt_instances.positive_maps[gt_index.flatten()]
        positive.index_fill_(0, pos_inds, 1.0)
        factor = image_size_factor(img_meta, gt_bboxes)
        bbox_targets[pos_inds] = bbox_xyxy_to_cxcywh(gt_bboxes / factor).repeat([num_groups, 1])
    return labels, bbox_targets, positive, count * num_groups


def grounding_targets_single_fewer_syncs(self, cls_score, bbox_pred, gt_instances, img_meta):
    """mmdet 3.3.0's ``GroundingDINOHead._get_targets_single`` taking the positive/negative queries from the
    assignment's host copy (stock finds them with two ``nonzero()`` syncs) and the size factor without blocking."""
    from mmdet.structures.bbox import bbox_xyxy_to_cxcywh
    num_bboxes = bbox_pred.size(0)
    assign_result, factor, bbox_pred, pos_inds, neg_inds = assign_with_host_indices(
        self, cls_score, bbox_pred, gt_instances, img_meta)
    gt_bboxes = gt_instances.bboxes
    pos_assigned_gt_inds = assign_result.gt_inds[pos_inds] - 1
    labels = gt_bboxes.new_full((num_bboxes, self.max_text_len), 0, dtype=torch.float32)
    labels[pos_inds] = gt_instances.positive_maps[pos_assigned_gt_inds]
    label_weights = gt_bboxes.new_ones(num_bboxes)
    bbox_targets = torch.zeros_like(bbox_pred, dtype=gt_bboxes.dtype)
    bbox_weights = torch.zeros_like(bbox_pred, dtype=gt_bboxes.dtype)
    bbox_weights.index_fill_(0, pos_inds, 1.0)  # `[pos_inds] = 1.0` copies the scalar with a blocking copy
    bbox_targets[pos_inds] = bbox_xyxy_to_cxcywh(gt_bboxes[pos_assigned_gt_inds.long(), :] / factor)
    return labels, label_weights, bbox_targets, bbox_weights, pos_inds, neg_inds


def enable_grounding_host_syncs(model: nn.Module) -> int:
    """Give every stock Grounding-DINO head of ``model`` the targets of :func:`grounding_targets_single_fewer_syncs`
    (with ``hungarian_host_syncs``); returns how many changed."""
    heads = [head for head in _grounding_heads(model) if stock_grounding_head(head)]
    for head in heads:
        head._get_targets_single = grounding_targets_single_fewer_syncs.__get__(head)
    return len(heads)


def enable_grounding_batched_losses(head) -> bool:
    """Give one stock Grounding-DINO head whose matching is solved ahead every layer's losses (denoising ones too)
    in one pass; False for other heads, or where it has them already."""
    if not stock_grounding_head(head):
        return False
    return install_batched_losses(head, grounding_layer_losses, grounding_denoising_losses)
