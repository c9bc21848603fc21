"""All of a step's Hungarian matching in one pass (``batched_matching``), on the fewer-syncs assign of :mod:`.matching`.

``batched_matching``: mmdet still matches one (decoder layer, image) pair at a time, each with its own cost-term
kernels and its own device-to-host copy that waits for the GPU. Before a DETR head's ``loss_by_feat`` runs, the
fast path computes the cost matrices of every decoder layer of every image in one pass (the cost terms are
row-wise, so stacking the layers' queries as rows gives each layer's matrix; for mmdet's focal, box-L1 and IoU
costs the images are stacked too, their gts padded to the most of any, and each image's block is its own matrix:
bitwise in float64, within one rounding of an element in float32 on the CPU, whose vectorised ``log``/``pow`` may
round an element apart in another layout), copies all of them to the host in one transfer, and solves every
assignment; the per-layer ``assign`` calls then find their result ready. Where the host builds the cost terms, one
pass for all images launches a quarter of the kernels of one pass per image and group. With
``batched_losses`` the two-stage encoder's proposals join the same pass and copy. A call the pass did not foresee
(another head; the proposals without ``batched_losses``) runs as before.
"""
from __future__ import annotations

import inspect
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn
from torch.profiler import record_function

from .matching import (_PredictionKey, _bbox_l1_cost, _cost_matrix, _detr_heads, _iou_cost, _prediction_key, _solve,
                       host_solves, image_size_factor, image_size_factors)

__all__ = ["LaunchedCosts", "costs_to_host", "enable_batched_matching", "focal_cost", "launch_costs", "solve_ahead",
           "solve_launched_costs"]


def solve_ahead(assigner, prediction_sets, batch_gt_instances, batch_img_metas,
                extra_groups: Sequence[Tuple[Sequence, Sequence]] = ()) -> Dict[_PredictionKey, np.ndarray]:
    """Solve every assignment of ``prediction_sets`` at once: one cost pass per image, one device-to-host copy.

    Args:
        assigner: the head's ``HungarianAssigner`` (its ``match_costs`` are used as ``assign`` uses them).
        prediction_sets: ``(cls_scores, bbox_preds)`` pairs shaped ``(num_layers, batch, num_queries, C)`` and
            ``(num_layers, batch, num_queries, 4)`` (normalized cx, cy, w, h), as the heads' ``loss_by_feat`` get
            them; a set may also be ``(batch, num_queries, ...)`` (one layer).
        batch_gt_instances, batch_img_metas: as ``loss_by_feat`` gets them.
        extra_groups: more ``(prediction_sets, batch_gt_instances)`` matched in the same pass and copy (the
            two-stage encoder's proposals against their relabelled gts).

    Returns:
        ``gt_inds`` on the host per (scores view, gt instances) that ``assign`` will be called with.
    """
    # This pass is the step's matching (the assign calls after it only look results up; with batched_losses none
    # is made): a "matching" range, as the benchmark names each assign, split into the fewer-syncs assign's parts.
    with record_function("deform_plugin::matching"):
        costs = launch_costs(assigner, prediction_sets, batch_gt_instances, batch_img_metas, extra_groups)
        return solve_launched_costs(costs)


class LaunchedCosts(NamedTuple):
    """A pass's cost matrices, flattened per block, and per block its images' (gt instances, views) and shape."""
    flat_costs: List[torch.Tensor]
    blocks: List[Tuple[list, Tuple[int, int, int]]]

    @property
    def num_elements(self) -> int:
        """How many cost elements the pass copies to the host."""
        return sum(cost.numel() for cost in self.flat_costs)


def launch_costs(assigner, prediction_sets, batch_gt_instances, batch_img_metas,
                 extra_groups: Sequence[Tuple[Sequence, Sequence]] = ()) -> LaunchedCosts:
    """:func:`solve_ahead`'s first half (same arguments): the cost terms, queued without waiting for the device."""
    from mmdet.structures.bbox import bbox_cxcywh_to_xyxy
    from mmengine.structures import InstanceData

    flat_costs, blocks = [], []
    with record_function("deform_plugin::matching.cost_terms"):
        for sets, group_gt_instances in [(prediction_sets, batch_gt_instances), *extra_groups]:
            sets = [(s, b) if s.dim() == 4 else (s[None], b[None]) for s, b in sets]
            problems = []  # (gt instances, img meta, views) of each image with gts
            for image, (gt_instances, img_meta) in enumerate(zip(group_gt_instances, batch_img_metas)):
                if len(gt_instances) == 0:
                    continue  # assign's own edge case needs no cost matrix
                views = [(scores[layer, image], bboxes[layer, image]) for scores, bboxes in sets
                         for layer in range(scores.shape[0])]
                problems.append((gt_instances, img_meta, views))
            if len(problems) > 1 and _batchable(assigner):
                cost = _batched_cost_matrices(assigner, problems)
                flat_costs.append(cost.reshape(-1))
                blocks.append(([(gt_instances, views) for gt_instances, _, views in problems], cost.shape))
                continue
            for gt_instances, img_meta, views in problems:
                scores = torch.cat([s for s, _ in views])
                factor = image_size_factor(img_meta, views[0][1])
                bboxes = bbox_cxcywh_to_xyxy(torch.cat([b for _, b in views])) * factor
                pred_instances = InstanceData(scores=scores, bboxes=bboxes)
                cost = _cost_matrix(assigner, pred_instances, gt_instances, img_meta)
                flat_costs.append(cost.reshape(-1))
                blocks.append(([(gt_instances, views)], (1,) + tuple(cost.shape)))
    return LaunchedCosts(flat_costs, blocks)


def solve_launched_costs(costs: LaunchedCosts, host: Optional[np.ndarray] = None,
                         selected_rows: Optional[Dict[_PredictionKey, np.ndarray]] = None
                         ) -> Dict[_PredictionKey, np.ndarray]:
    """:func:`solve_ahead`'s second half: the one copy to the host (it waits for the device), then the solves.

    ``host``: the pass's costs, copied already (the start of a larger copy made with :func:`costs_to_host`).
    ``selected_rows``: per prediction set (keyed as ``assign`` would see it) that is matched on some of its queries
    only (DDQ-DETR's distinct queries), those queries (bools on the host): the assignment is solved on their rows,
    as ``assign`` would see them selected, and the other queries get gt index -1 (no target, no loss)."""
    if not costs.flat_costs:
        return {}
    if host is None:
        with record_function("deform_plugin::matching.wait_and_copy_to_host"):
            host = costs_to_host(costs.flat_costs)
    selected_rows = selected_rows or {}
    solved = {}
    with host_solves():
        offset = 0
        for images, (count, rows, cols) in costs.blocks:
            block = host[offset:offset + count * rows * cols].reshape(count, rows, cols)
            offset += count * rows * cols
            for cost, (gt_instances, views) in zip(block, images):
                cost = cost[:, :len(gt_instances)]  # a batched block pads the gts to the most of its images
                row = 0
                for scores, _ in views:
                    key = _prediction_key(scores, gt_instances)
                    view_cost = cost[row:row + scores.shape[0]]
                    selected = selected_rows.get(key)
                    if selected is None:
                        solved[key] = _solve(view_cost)
                    else:
                        gt_inds = np.full(scores.shape[0], -1, dtype=np.int64)
                        gt_inds[selected] = _solve(view_cost[selected])
                        solved[key] = gt_inds
                    row += scores.shape[0]
    return solved


def _batchable(assigner) -> bool:
    """Whether every cost term of ``assigner`` has a batched form here (mmdet's own classification, box L1 and IoU
    costs)."""
    from mmdet.models.task_modules.assigners.match_cost import BBoxL1Cost, FocalLossCost, IoUCost
    return all(type(cost) in (BBoxL1Cost, IoUCost) or (type(cost) is FocalLossCost and not cost.binary_input)
               for cost in assigner.match_costs)


def _batched_cost_matrices(assigner, problems) -> torch.Tensor:
    """The cost matrices of several images in one pass: ``(images, rows, most gts)``, each image's gts padded to the
    most of any (the padding columns are cut on the host).

    Every element is computed by the same operations on the same values as :func:`_cost_matrix` computes it for one
    image (the image-size factors broadcast per image, the focal cost gathers each image's labels), so each image's
    block equals its own matrix.
    """
    from mmdet.models.task_modules.assigners.match_cost import BBoxL1Cost, FocalLossCost, IoUCost
    from mmdet.structures.bbox import bbox_cxcywh_to_xyxy
    from torch.nn.utils.rnn import pad_sequence

    scores = torch.stack([torch.cat([s for s, _ in views]) for _, _, views in problems])
    boxes = torch.stack([torch.cat([b for _, b in views]) for _, _, views in problems])
    gt_boxes = pad_sequence([gt.bboxes for gt, _, _ in problems], batch_first=True)
    gt_labels = pad_sequence([gt.labels for gt, _, _ in problems], batch_first=True)
    metas = [meta for _, meta, _ in problems]
    boxes = bbox_cxcywh_to_xyxy(boxes) * image_size_factors(metas, boxes)
    costs = []
    for cost in assigner.match_costs:
        if type(cost) is FocalLossCost:
            costs.append(focal_cost(cost, scores, gt_labels))
        elif type(cost) is BBoxL1Cost:
            costs.append(_bbox_l1_cost(cost, boxes, gt_boxes, metas))
        elif type(cost) is IoUCost:
            costs.append(_iou_cost(cost, boxes, gt_boxes))
        else:
            raise TypeError(f"{type(cost).__name__} has no batched form (see _batchable)")
    return torch.stack(costs).sum(dim=0).detach()


def focal_cost(match_cost, scores: torch.Tensor, gt_labels: torch.Tensor) -> torch.Tensor:
    """mmdet 3.3.0's ``FocalLossCost`` (``binary_input=False``) of ``(images, rows, C)`` scores against each image's
    ``(images, T)`` gt labels: ``(images, rows, T)``, each element by mmdet's arithmetic."""
    probabilities = scores.sigmoid()
    negative = -(1 - probabilities + match_cost.eps).log() * (1 - match_cost.alpha) * probabilities.pow(
        match_cost.gamma)
    positive = -(probabilities + match_cost.eps).log() * match_cost.alpha * (1 - probabilities).pow(match_cost.gamma)
    labels = gt_labels[:, None, :].expand(-1, scores.shape[1], -1)
    return (positive.gather(2, labels) - negative.gather(2, labels)) * match_cost.weight


def costs_to_host(flat_costs: Sequence[torch.Tensor]) -> np.ndarray:
    """The step's cost matrices, flattened and concatenated, in one device-to-host copy (it waits for the GPU)."""
    return torch.cat([c.to(flat_costs[0].dtype) for c in flat_costs]).cpu().numpy()


def _loss_by_feat_solving_ahead(head):
    """``head.loss_by_feat`` that solves the decoder layers' assignments (and DINO's encoder's) before it runs."""
    from mmdet.models.dense_heads import DINOHead

    loss_by_feat = head.loss_by_feat  # the class's bound method
    signature = inspect.signature(loss_by_feat)

    def loss_by_feat_solving_ahead(*args, **kwargs):
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        arguments = call.arguments
        scores, bboxes = arguments["all_layers_cls_scores"], arguments["all_layers_bbox_preds"]
        sets = []
        if isinstance(head, DINOHead):
            matching_scores, matching_bboxes, _, _ = head.split_outputs(scores, bboxes, arguments["dn_meta"])
            sets.append((matching_scores, matching_bboxes))
            # DINO matches its encoder's proposals against the same gt instances as the decoder layers.
            if arguments.get("enc_cls_scores") is not None:
                sets.append((arguments["enc_cls_scores"], arguments["enc_bbox_preds"]))
        else:
            sets.append((scores, bboxes))
        # A later fast path (batched_losses) may add prediction sets it matches itself (against gts of its own) and
        # use the solved assignments before the per-layer losses run.
        extra_matching = getattr(head, "extra_matching_groups", None)
        extra_groups = extra_matching(arguments) if extra_matching is not None else []
        head.assigner.solved_ahead = solve_ahead(head.assigner, sets, arguments["batch_gt_instances"],
                                                 arguments["batch_img_metas"], extra_groups)
        prepare_layer_losses = getattr(head, "prepare_layer_losses", None)
        try:
            if prepare_layer_losses is not None:
                prepare_layer_losses(sets, arguments, head.assigner.solved_ahead, extra_groups)
            return loss_by_feat(*args, **kwargs)
        finally:
            # Storage addresses are reused by later steps: a solution must never outlive its step.
            head.assigner.solved_ahead = {}
            if prepare_layer_losses is not None:
                head.losses_ahead = {}

    return loss_by_feat_solving_ahead


def enable_batched_matching(model: nn.Module) -> int:
    """Solve each step's assignments ahead, in one pass, for every DETR-family head with mmdet's own
    ``loss_by_feat`` and a fewer-syncs ``HungarianAssigner`` (see :func:`enable_hungarian_host_syncs`, which this
    needs). Returns the number of heads changed."""
    changed = 0
    for head in _detr_heads(model, "loss_by_feat"):
        assigner = getattr(head, "assigner", None)
        if assigner is not None and "assign" in vars(assigner) and "loss_by_feat" not in vars(head):
            head.loss_by_feat = _loss_by_feat_solving_ahead(head)
            changed += 1
    return changed
