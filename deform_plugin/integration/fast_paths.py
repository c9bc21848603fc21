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
        device with two blocking copies and then scatters labels through them. The fast path builds the per-query
        ``gt_inds`` on the host, where scipy's result already is, copies it once from pinned memory without
        blocking, and gathers the labels on the device. Same cost matrix, same ``linear_sum_assignment`` call, the
        same integers out: bitwise identical assignments.
"""
from __future__ import annotations

import warnings
from typing import Dict, Optional

import torch
from torch import nn
from torch.profiler import record_function

FAST_PATH_NAMES = ("sdpa_attention", "hungarian_host_syncs")


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
    stock = _stock_multihead_attention_class()
    fast = sdpa_multihead_attention_class()
    switched = 0
    for module in model.modules():
        if type(module) is stock:
            module.__class__ = fast
            switched += 1
    return switched


def disable_sdpa_attention(model: nn.Module) -> int:
    """Undo :func:`enable_sdpa_attention`; returns the number of modules switched back."""
    stock = _stock_multihead_attention_class()
    fast = sdpa_multihead_attention_class()
    switched = 0
    for module in model.modules():
        if type(module) is fast:
            module.__class__ = stock
            switched += 1
    return switched


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
        gt_inds = torch.full((num_preds,), 0 if num_gts == 0 else -1, dtype=torch.long, device=device)
        labels = torch.full((num_preds,), -1, dtype=torch.long, device=device)
        return AssignResult(num_gts=num_gts, gt_inds=gt_inds, max_overlaps=None, labels=labels)

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
    if device.type == "cuda":
        # Pinned memory lets the copy run asynchronously; the caching host allocator keeps the buffer alive until
        # the copy has completed.
        gt_inds = host_gt_inds.pin_memory().to(device, non_blocking=True)
    else:
        gt_inds = host_gt_inds.to(device)
    # labels[q] = gt_labels[gt_inds[q] - 1] for matched queries, -1 elsewhere: the stock scatter, as a gather.
    matched = gt_inds > 0
    labels = torch.where(matched, gt_labels[(gt_inds - 1).clamp(min=0)].long(), torch.full_like(gt_inds, -1))
    return AssignResult(num_gts=num_gts, gt_inds=gt_inds, max_overlaps=None, labels=labels)


def _hungarian_assigners(model: nn.Module):
    from mmdet.models.task_modules.assigners import HungarianAssigner
    seen = set()
    for module in model.modules():
        for value in vars(module).values():
            if type(value) is HungarianAssigner and id(value) not in seen:
                seen.add(id(value))
                yield value


def enable_hungarian_host_syncs(model: nn.Module) -> int:
    """Give every stock ``HungarianAssigner`` held by a module of ``model`` the fewer-syncs ``assign``.

    Only instances are changed (the class stays stock), so other models in the process are unaffected.
    Returns the number of assigners changed.
    """
    changed = 0
    for assigner in _hungarian_assigners(model):
        assigner.assign = _assign_with_fewer_host_syncs.__get__(assigner)
        changed += 1
    return changed


def disable_hungarian_host_syncs(model: nn.Module) -> int:
    changed = 0
    for assigner in _hungarian_assigners(model):
        if "assign" in vars(assigner):
            del assigner.assign
            changed += 1
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
