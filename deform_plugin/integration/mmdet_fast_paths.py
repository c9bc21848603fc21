"""Opt-in, exact fast paths for the parts of an mmdet training step outside MSDA.

This is the one module that knows the private structure these fast paths change (mmcv's ``MultiheadAttention``
brick, mmdet's ``HungarianAssigner``). Nothing here runs unless a config asks for it, through
``deform_plugin.engine.FastPathsHook`` in ``custom_hooks`` (or a tool calling :func:`apply_fast_paths`).

Fast paths:
    ``sdpa_attention``: every mmcv ``MultiheadAttention`` brick (the DETR decoders' self-attention, Mask2Former's
        masked cross- and self-attention) calls ``nn.MultiheadAttention`` with ``need_weights=False``. The stock
        brick leaves ``need_weights=True``, which makes PyTorch compute the softmax matrix explicitly (baddbmm,
        softmax, dropout, bmm) and average it over heads for a return value the brick throws away; with
        ``need_weights=False`` PyTorch calls ``scaled_dot_product_attention`` (fused kernels on CUDA). Same
        parameters, same state-dict keys, same function: the outputs and gradients agree to float rounding. With
        attention dropout > 0 in training mode (Deformable-DETR's decoder: 0.1) the dropout mask is drawn
        differently, so single steps agree only in distribution; eval mode and dropout 0 (DINO, Mask2Former) agree
        to rounding.
    ``hungarian_host_syncs``: mmdet's ``HungarianAssigner.assign`` copies the matched row/column indices to the
        device with two blocking copies and then scatters labels through them; the DETR heads'
        ``_get_targets_single`` then finds the positive and negative queries with two ``nonzero()`` calls (two more
        host syncs per image and decoder layer). The fast path builds the per-query ``gt_inds`` on the host, where
        scipy's result already is, copies it once from pinned memory without blocking, gathers the labels on the
        device, and lets the DETR heads take their sorted positive/negative indices from that host copy (one more
        non-blocking copy). Same cost matrix, same ``linear_sum_assignment`` call, the same integers out: bitwise
        identical assignments and targets.
"""
from __future__ import annotations

import warnings
from typing import Dict, Optional

import torch
from torch import nn
from torch.profiler import record_function

# The mmdet release whose private DETRHead._get_targets_single the fewer-syncs copy below mirrors line for line.
MIRRORED_MMDET_VERSION = "3.3.0"


def check_mirrored_mmdet_version() -> None:
    """Refuse the mmdet-private copies on an mmdet other than the one they mirror, with a clear message."""
    import mmdet
    if mmdet.__version__ != MIRRORED_MMDET_VERSION:
        raise RuntimeError(
            f"deform_plugin's hungarian_host_syncs fast path mirrors mmdet {MIRRORED_MMDET_VERSION}'s private "
            f"DETRHead._get_targets_single, but mmdet {mmdet.__version__} is installed: turn the fast path off "
            "(FastPathsHook(hungarian_host_syncs=False)) or install mmdet==3.3.0")


def _stock_multihead_attention_class():
    from mmcv.cnn.bricks.transformer import MultiheadAttention
    return MultiheadAttention


def _make_sdpa_class():
    stock = _stock_multihead_attention_class()

    class SDPAMultiheadAttention(stock):
        """mmcv's ``MultiheadAttention`` brick calling ``nn.MultiheadAttention`` with ``need_weights=False``.

        Identical parameters and forward semantics; PyTorch then runs ``scaled_dot_product_attention`` instead of
        materialising (and head-averaging) the attention matrix that the stock brick discards.
        """

        def forward(self, query, key=None, value=None, identity=None, query_pos=None, key_pos=None,
                    attn_mask=None, key_padding_mask=None, **kwargs):
            # Mirrors the stock brick's argument handling line for line; only need_weights differs.
            if key is None:
                key = query
            if value is None:
                value = key
            if identity is None:
                identity = query
            if key_pos is None and query_pos is not None:
                if query_pos.shape == key.shape:
                    key_pos = query_pos
                else:
                    warnings.warn(f"position encoding of key is missing in {self.__class__.__name__}.")
            if query_pos is not None:
                query = query + query_pos
            if key_pos is not None:
                key = key + key_pos
            if self.batch_first:
                query = query.transpose(0, 1)
                key = key.transpose(0, 1)
                value = value.transpose(0, 1)
            out = self.attn(query=query, key=key, value=value, attn_mask=attn_mask,
                            key_padding_mask=key_padding_mask, need_weights=False)[0]
            if self.batch_first:
                out = out.transpose(0, 1)
            return identity + self.dropout_layer(self.proj_drop(out))

    SDPAMultiheadAttention.__name__ = SDPAMultiheadAttention.__qualname__ = "SDPAMultiheadAttention"
    return SDPAMultiheadAttention


_sdpa_class = None


def sdpa_multihead_attention_class():
    """The SDPA subclass of mmcv's ``MultiheadAttention`` brick (created on first use, after mmcv is importable)."""
    global _sdpa_class
    if _sdpa_class is None:
        _sdpa_class = _make_sdpa_class()
    return _sdpa_class


def enable_sdpa_attention(model: nn.Module) -> int:
    """Switch every stock mmcv ``MultiheadAttention`` brick in ``model`` to :func:`sdpa_multihead_attention_class`.

    The switch changes the instance's class only: parameters, buffers, hooks and state-dict keys stay as they are,
    so it may run before or after the optimizer and DDP are built. Subclasses of the brick are left alone (their
    forward may differ). Returns the number of modules switched.
    """
    return _switch_class(model, _stock_multihead_attention_class(), sdpa_multihead_attention_class())


def _switch_class(model: nn.Module, old: type, new: type) -> int:
    switched = 0
    for module in model.modules():
        if type(module) is old:
            module.__class__ = new
            switched += 1
    return switched


def disable_sdpa_attention(model: nn.Module) -> int:
    """Undo :func:`enable_sdpa_attention`; returns the number of modules switched back."""
    return _switch_class(model, sdpa_multihead_attention_class(), _stock_multihead_attention_class())


# ---- Hungarian matching -------------------------------------------------------------------------------------------

def _assign_with_fewer_host_syncs(self, pred_instances, gt_instances, img_meta: Optional[dict] = None, **kwargs):
    """``HungarianAssigner.assign`` with the result built on the host and copied once without blocking."""
    import numpy as np
    from mmdet.models.task_modules.assigners.assign_result import AssignResult
    from scipy.optimize import linear_sum_assignment

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

    # The named ranges cost ~1 us each when no profiler runs; under tools/profile_step.py they split matching's host
    # time into launching the cost terms, waiting for the device (the copy is the step's first sync), and scipy.
    with record_function("deform_plugin::matching.cost_terms"):
        costs = [match_cost(pred_instances=pred_instances, gt_instances=gt_instances, img_meta=img_meta)
                 for match_cost in self.match_costs]
        cost = torch.stack(costs).sum(dim=0).detach()
    with record_function("deform_plugin::matching.wait_and_copy_to_host"):
        cost = cost.cpu()
    with record_function("deform_plugin::matching.scipy"):
        matched_rows, matched_cols = linear_sum_assignment(cost)

    host_gt_inds = np.zeros(num_preds, dtype=np.int64)
    host_gt_inds[matched_rows] = matched_cols + 1
    host_gt_inds = torch.from_numpy(host_gt_inds)
    gt_inds = _to_device_without_blocking(host_gt_inds, device)
    # labels[q] = gt_labels[gt_inds[q] - 1] for matched queries, -1 elsewhere: the stock scatter, as a gather.
    matched = gt_inds > 0
    labels = torch.where(matched, gt_labels[(gt_inds - 1).clamp(min=0)].long(), torch.full_like(gt_inds, -1))
    result = AssignResult(num_gts=num_gts, gt_inds=gt_inds, max_overlaps=None, labels=labels)
    # The host copy lets the DETR heads' target builder skip its two nonzero() syncs (see below).
    result.host_gt_inds = host_gt_inds
    return result


def _to_device_without_blocking(host_tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return host_tensor.to(device)
    # Pinned memory lets the copy run asynchronously; the caching host allocator keeps the buffer alive until the
    # copy has completed.
    return host_tensor.pin_memory().to(device, non_blocking=True)


def _detr_targets_single_fewer_syncs(self, cls_score, bbox_pred, gt_instances, img_meta):
    """mmdet 3.3.0's ``DETRHead._get_targets_single`` taking the positive/negative query indices from the host
    assignment.

    The stock method finds them with ``torch.nonzero(...).unique()`` on the device: two host syncs per image and
    layer. Where the assigner left ``host_gt_inds`` (the fewer-syncs ``assign``), the same sorted indices come from
    numpy and reach the device in one non-blocking copy; everything else is the stock computation.
    """
    import numpy as np
    from mmdet.structures.bbox import bbox_cxcywh_to_xyxy, bbox_xyxy_to_cxcywh
    from mmengine.structures import InstanceData

    img_h, img_w = img_meta["img_shape"]
    factor = bbox_pred.new_tensor([img_w, img_h, img_w, img_h]).unsqueeze(0)
    num_bboxes = bbox_pred.size(0)
    bbox_pred = bbox_cxcywh_to_xyxy(bbox_pred) * factor
    pred_instances = InstanceData(scores=cls_score, bboxes=bbox_pred)
    assign_result = self.assigner.assign(pred_instances=pred_instances, gt_instances=gt_instances,
                                         img_meta=img_meta)
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
    gt_bboxes = gt_instances.bboxes
    gt_labels = gt_instances.labels
    pos_assigned_gt_inds = assign_result.gt_inds[pos_inds] - 1
    pos_gt_bboxes = gt_bboxes[pos_assigned_gt_inds.long(), :]
    labels = gt_bboxes.new_full((num_bboxes,), self.num_classes, dtype=torch.long)
    labels[pos_inds] = gt_labels[pos_assigned_gt_inds]
    label_weights = gt_bboxes.new_ones(num_bboxes)
    bbox_targets = torch.zeros_like(bbox_pred, dtype=gt_bboxes.dtype)
    bbox_weights = torch.zeros_like(bbox_pred, dtype=gt_bboxes.dtype)
    bbox_weights[pos_inds] = 1.0
    bbox_targets[pos_inds] = bbox_xyxy_to_cxcywh(pos_gt_bboxes / factor)
    return labels, label_weights, bbox_targets, bbox_weights, pos_inds, neg_inds


def _detr_heads_with_stock_targets(model: nn.Module):
    """DETR-family heads whose class uses ``DETRHead._get_targets_single`` unchanged (others are left alone)."""
    from mmdet.models.dense_heads import DETRHead
    for module in model.modules():
        if isinstance(module, DETRHead) and type(module)._get_targets_single is DETRHead._get_targets_single:
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
    check_mirrored_mmdet_version()
    changed = 0
    for assigner in _hungarian_assigners(model):
        assigner.assign = _assign_with_fewer_host_syncs.__get__(assigner)
        changed += 1
    for head in _detr_heads_with_stock_targets(model):
        head._get_targets_single = _detr_targets_single_fewer_syncs.__get__(head)
    return changed


def apply_fast_paths(model: nn.Module, sdpa_attention: bool = False, hungarian_host_syncs: bool = False
                     ) -> Dict[str, int]:
    """Turn on the selected fast paths on ``model`` (unwrapping DDP); returns how many sites each one changed."""
    model = getattr(model, "module", model)
    changed = {}
    if sdpa_attention:
        changed["sdpa_attention"] = enable_sdpa_attention(model)
    if hungarian_host_syncs:
        changed["hungarian_host_syncs"] = enable_hungarian_host_syncs(model)
    return changed
