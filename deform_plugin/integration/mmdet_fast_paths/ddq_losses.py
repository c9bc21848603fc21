"""DDQ-DETR's training losses in one pass, with all of a step's matching in one copy to the host
(``batched_matching`` and ``batched_losses`` together, on a ``DDQDETRHead``).

mmdet 3.3.0's ``DDQDETRHead.loss`` computes, layer by layer and image by image:

- the distinct queries' DETR losses (focal, L1, GIoU after a Hungarian matching): at each decoder layer after the
  first only the queries that the decoder's NMS before it kept (``distinct_query_mask``), selected with a boolean
  index (a host sync per image and layer);
- the encoder's top-k proposals' and the denoising queries' DETR losses, as DINO's head;
- ``DDQAuxLoss`` on the dense queries of every decoder layer and of the encoder (:mod:`.ddq_aux_loss`).

With a few hundred host syncs per step, the step is bound by how fast the host issues and waits. Here the cost
matrices of every decoder layer's distinct queries (over all the layer's queries: each cost term is row-wise), of
the encoder's proposals and of every dense set, and the decoder's distinct-query masks, reach the host in one copy;
each layer's Hungarian assignment is solved on its distinct queries' rows, as stock selects them, and every loss is
computed in one pass: the distinct queries' with the other queries weighted 0 (:func:`.batched_losses.layer_losses`),
the encoder's and the denoising ones as ``batched_losses`` computes DINO's, the dense ones in
:func:`.ddq_aux_loss.dense_losses`. The same losses as stock up to float summation order; the same result keys, in
stock's order.

The replaced method is the head's ``loss`` (the encoder's dense loss is computed there, outside ``loss_by_feat``),
on heads whose methods are all mmdet 3.3.0's and whose losses are the modules this pass reproduces; other heads are
left alone.
"""
from __future__ import annotations

from typing import Dict

import numpy as np
import torch
from torch import nn

from .batched_losses import batchable_head, denoising_layer_losses, layer_losses
from .batched_matching import costs_to_host, launch_costs, solve_launched_costs
from .ddq_aux_loss import batchable_aux_loss, dense_losses, dense_sets, launch_dense_costs, solve_dense_costs
from .matching import _prediction_key

_STOCK_HEAD_METHODS = ("loss", "loss_by_feat", "loss_for_distinct_queries", "_loss_for_distinct_queries_single",
                       "forward")
_STOCK_DINO_METHODS = ("split_outputs", "loss_dn", "_loss_dn_single", "get_dn_targets", "_get_dn_targets_single")


def batchable_ddq_head(head) -> bool:
    """Whether ``head`` is a ``DDQDETRHead`` with mmdet 3.3.0's methods, a ``HungarianAssigner``, mmdet's focal,
    L1 and GIoU losses and a ``DDQAuxLoss`` this pass reproduces (:func:`.ddq_aux_loss.batchable_aux_loss`)."""
    from mmdet.models.dense_heads import DDQDETRHead, DINOHead
    from mmdet.models.task_modules.assigners import HungarianAssigner
    return (isinstance(head, DDQDETRHead)
            and all(getattr(type(head), name) is getattr(DDQDETRHead, name) for name in _STOCK_HEAD_METHODS)
            and all(getattr(type(head), name) is getattr(DINOHead, name) for name in _STOCK_DINO_METHODS)
            and type(getattr(head, "assigner", None)) is HungarianAssigner and batchable_head(head)
            and batchable_aux_loss(getattr(head, "aux_loss_for_dense", None)))


def distinct_selection(head, num_layers: int, batch: int, num_queries: int, device) -> torch.Tensor:
    """``(L, B, Q)`` bools: the queries ``_loss_for_distinct_queries_single`` takes at each decoder layer, as mmdet
    3.3.0 reads them: every query at the first, at a later one row 0 of the image's first attention head in the
    mask that the decoder's query selection before that layer left (``distinct_query_mask``)."""
    masks, num_heads = head.cache_dict["distinct_query_mask"], head.cache_dict["num_heads"]
    rows = [torch.ones(batch, num_queries, dtype=torch.bool, device=device)]
    rows += [masks[layer - 1][::num_heads, 0] for layer in range(1, num_layers)]
    return torch.stack(rows)


def ddq_losses_in_one_pass(head, all_layers_cls_scores: torch.Tensor, all_layers_bbox_preds: torch.Tensor,
                           enc_cls_scores: torch.Tensor, enc_bbox_preds: torch.Tensor,
                           aux_enc_cls_scores: torch.Tensor, aux_enc_bbox_preds: torch.Tensor, batch_gt_instances,
                           batch_img_metas, dn_meta: dict) -> Dict[str, object]:
    """``DDQDETRHead.loss``'s losses from the head's outputs (``head(hidden_states, references)``), the encoder's
    top-k and dense outputs, the batch's gts and metas and the denoising layout (see the module)."""
    matching_scores, matching_bboxes, denoising_scores, denoising_bboxes = head.split_outputs(
        all_layers_cls_scores, all_layers_bbox_preds, dn_meta)
    num_dense = dn_meta["num_dense_queries"]
    distinct_scores, distinct_bboxes = matching_scores[:, :, :-num_dense], matching_bboxes[:, :, :-num_dense]
    probabilities, pixel_boxes = dense_sets(matching_scores[:, :, -num_dense:], matching_bboxes[:, :, -num_dense:],
                                            aux_enc_cls_scores, aux_enc_bbox_preds, batch_img_metas)
    num_layers, batch, num_queries = distinct_scores.shape[:3]

    # The step's matching: every cost matrix and the distinct-query masks in one copy to the host.
    selection = distinct_selection(head, num_layers, batch, num_queries, distinct_scores.device)
    one_to_one = launch_costs(head.assigner, [(distinct_scores, distinct_bboxes), (enc_cls_scores, enc_bbox_preds)],
                              batch_gt_instances, batch_img_metas)
    one_to_k = launch_dense_costs(head.aux_loss_for_dense, probabilities, pixel_boxes, batch_gt_instances,
                                  batch_img_metas)
    dense_flat = [] if one_to_k.flat is None else [one_to_k.flat]
    host = costs_to_host(one_to_one.flat_costs + dense_flat + [selection.reshape(-1)])
    ends = np.cumsum([one_to_one.num_elements, one_to_k.num_elements])
    selected = host[ends[1]:].reshape(num_layers, batch, num_queries) > 0
    selected_rows = {_prediction_key(distinct_scores[layer, image], gts): selected[layer, image]
                     for layer in range(num_layers) for image, gts in enumerate(batch_gt_instances)}
    solved = solve_launched_costs(one_to_one, host[:ends[0]], selected_rows)
    matches = solve_dense_costs(head.aux_loss_for_dense, one_to_k, host[ends[0]:ends[1]], batch_gt_instances,
                                num_layers + 1, probabilities.shape[2])

    losses = {}
    distinct = layer_losses(head, distinct_scores, distinct_bboxes, batch_gt_instances, batch_img_metas, solved,
                            selected)
    encoder = layer_losses(head, enc_cls_scores[None], enc_bbox_preds[None], batch_gt_instances, batch_img_metas,
                           solved)
    if distinct is None or encoder is None:  # every image with gts was solved above
        raise RuntimeError("DDQ-DETR's one-pass losses found an assignment missing")
    _add_layer_losses(losses, distinct, "")
    for name, value in zip(("loss_cls", "loss_bbox", "loss_iou"), encoder[0]):
        losses[f"enc_{name}"] = value
    denoising = denoising_layer_losses(head, denoising_scores, denoising_bboxes, batch_gt_instances,
                                       batch_img_metas, dn_meta)
    if denoising is None:  # no denoising queries: stock's own calls
        denoising = head.loss_dn(denoising_scores, denoising_bboxes, batch_gt_instances=batch_gt_instances,
                                 batch_img_metas=batch_img_metas, dn_meta=dn_meta)
    _add_layer_losses(losses, list(zip(*denoising)), "dn_")
    dense = dense_losses(head.aux_loss_for_dense, probabilities, pixel_boxes, matches, batch_gt_instances,
                         batch_img_metas)
    for layer, layer_losses_ in enumerate(dense[:-1]):
        losses.update({f"{layer}_aux_{name}": value for name, value in layer_losses_.items()})
    losses.update({f"aux_enc_{name}": value for name, value in dense[-1].items()})
    return losses


def _add_layer_losses(losses: dict, per_layer, prefix: str) -> None:
    """Stock's keys for per-layer ``(loss_cls, loss_bbox, loss_iou)``: the last layer's unnumbered, then ``d0.``..."""
    names = [f"{prefix}loss_cls", f"{prefix}loss_bbox", f"{prefix}loss_iou"]
    losses.update(zip(names, per_layer[-1]))
    for layer, values in enumerate(per_layer[:-1]):
        losses.update({f"d{layer}.{name}": value for name, value in zip(names, values)})


def _one_pass_loss(head):
    """``head.loss`` computing its losses in :func:`ddq_losses_in_one_pass`; calls it was not foreseen for (no
    denoising or dense queries) run as before."""
    stock_loss = head.loss

    def loss(hidden_states, references, enc_outputs_class, enc_outputs_coord, batch_data_samples, dn_meta,
             aux_enc_outputs_class=None, aux_enc_outputs_coord=None):
        if dn_meta is None or "num_dense_queries" not in dn_meta or aux_enc_outputs_class is None:
            return stock_loss(hidden_states, references, enc_outputs_class, enc_outputs_coord, batch_data_samples,
                              dn_meta, aux_enc_outputs_class, aux_enc_outputs_coord)
        batch_gt_instances = [sample.gt_instances for sample in batch_data_samples]
        batch_img_metas = [sample.metainfo for sample in batch_data_samples]
        all_layers_cls_scores, all_layers_bbox_preds = head(hidden_states, references)
        return ddq_losses_in_one_pass(head, all_layers_cls_scores, all_layers_bbox_preds, enc_outputs_class,
                                      enc_outputs_coord, aux_enc_outputs_class, aux_enc_outputs_coord,
                                      batch_gt_instances, batch_img_metas, dn_meta)

    return loss


def enable_ddq_one_pass_losses(model: nn.Module) -> int:
    """Give every DDQ-DETR head of ``model`` that this pass reproduces (:func:`batchable_ddq_head`) the one-pass
    ``loss``; returns how many heads changed."""
    changed = 0
    for module in model.modules():
        if "loss" not in vars(module) and batchable_ddq_head(module):
            module.loss = _one_pass_loss(module)
            changed += 1
    return changed
