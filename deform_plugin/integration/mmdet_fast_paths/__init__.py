"""Opt-in, exact fast paths for the parts of an mmdet training step outside MSDA.

This package is the one place that knows the private structure these fast paths change (mmcv's
``MultiheadAttention`` brick, mmdet's ``HungarianAssigner`` and DETR heads). Nothing here runs unless a config asks
for it, through ``deform_plugin.engine.FastPathsHook`` in ``custom_hooks`` (or a tool calling
:func:`apply_fast_paths`). The switches are the fields of :class:`FastPaths` (:mod:`.switches`). Each changes
instances of one model only; each is exact (see its module):

- ``sdpa_attention`` (:mod:`.sdpa_attention`): attention bricks through PyTorch SDPA;
- ``hungarian_host_syncs`` (:mod:`.matching`) and ``batched_matching`` (:mod:`.batched_matching`): matching with
  fewer syncs, and all of a step's matching in one pass (for Mask2Former, with its losses and its ground truth,
  panoptic stuff classes included, made sync-free: :mod:`.mask2former_losses`, :mod:`.mask2former_targets`);
- ``sync_free_losses`` (:mod:`.loss_normalisation`): the DETR heads' per-layer losses without host syncs;
- ``batched_losses`` (:mod:`.batched_losses`): every decoder layer's loss in one pass, DINO's denoising losses too
  (needs the matching solved ahead: turns ``batched_matching`` on too); DDQ-DETR's head gets both together, its
  whole loss in one pass with all of the step's matching in one copy (:mod:`.ddq_losses`, :mod:`.ddq_aux_loss`);
  Grounding-DINO's text-conditioned losses in one pass too (:mod:`.grounding_dino_losses`, which also says which
  switches have no exact form for it: those are refused);
- ``sync_free_forward`` (:mod:`.sync_free_forward`): Deformable-DETR's and DINO's forward without host syncs;
- ``cuda_graphs`` (:mod:`.graphed_training`; Grounding-DINO's, BERT included: :mod:`.graphed_grounding`): their
  training forward and backward replayed from CUDA graphs, one pair per input shape (needs the sync-free forward:
  turns it on too); under DistributedDataParallel the DETRs'
  backbone and neck are captured as a region of their own, so that the other gradients are all-reduced while the
  backbone's backward replays (``split_graphs_at_features``); elsewhere the regions write the gradients into
  ``gradient_slots``;
- ``relu_dropout_fusion`` and ``ffn_recompute`` (:mod:`.ffn_memory`): mmcv ``FFN``'s ReLU and dropout keep one
  activation for backward instead of three; FFNs without dropout recompute their hidden layer in the backward
  (less training memory);
- ``float32_nms`` (:mod:`.ddq_nms`): DDQ-DETR's NMS takes its boxes and scores in float32, so that it runs under
  autocast (bf16 training and inference).

All but ``sdpa_attention``, ``relu_dropout_fusion`` and ``ffn_recompute`` replace private methods of mmdet 3.3.0 with
copies (``float32_nms`` rebuilds two of them from mmdet's own code): they refuse other mmdet versions
(:mod:`deform_plugin.integration.mmdet_version`). A switch that finds nothing it knows in a model (a detector family
it does not serve, a subclass that changes the methods it replaces) leaves that model as it is and
says so in a warning that names the switch, the model and what it looks for.
"""
from __future__ import annotations

import logging
from typing import Dict, List, Optional

from mmengine.logging import print_log
from torch import nn

from ..mmdet_version import MIRRORED_MMDET_VERSION, check_mirrored_mmdet_version
from .batched_losses import enable_batched_losses
from .batched_matching import enable_batched_matching
from .ddq_losses import enable_ddq_one_pass_losses
from .ddq_nms import enable_float32_nms
from .ffn_memory import enable_ffn_recompute, enable_relu_dropout_fusion
from .graphed_training import enable_cuda_graphs
from .grounding_dino_losses import enable_grounding_batched_losses, enable_grounding_host_syncs, grounding_refusals
from .loss_normalisation import enable_sync_free_losses
from .mask2former_losses import enable_mask2former_batched_matching
from .matching import enable_hungarian_host_syncs
from .sdpa_attention import disable_sdpa_attention, enable_sdpa_attention, sdpa_multihead_attention_class
from .switches import FastPaths
from .sync_free_forward import enable_sync_free_forward

FAST_PATHS = FastPaths.switch_names()

__all__ = ["FAST_PATHS", "MIRRORED_MMDET_VERSION", "FastPaths", "apply_fast_paths", "check_mirrored_mmdet_version",
           "disable_sdpa_attention", "enable_sdpa_attention", "sdpa_multihead_attention_class", "unchanged_notes"]

# What each switch changes, for the warning where it finds none of it in a model.
_WHAT_EACH_SWITCH_CHANGES = {
    "sdpa_attention": "mmcv MultiheadAttention bricks",
    "hungarian_host_syncs": "mmdet HungarianAssigners",
    "batched_matching": "DETR-family heads with mmdet's own loss_by_feat, Mask2Former heads, and DDQ-DETR heads "
                        "(only with batched_losses, whose one pass computes their losses from it)",
    "sync_free_losses": "DETR-family heads with mmdet's own loss_by_feat_single",
    "sync_free_forward": "Deformable-DETR-family detectors and Mask2Former pixel decoders with mmdet's own forward",
    "batched_losses": "DETR-family heads (DDQ-DETR's included) whose losses are mmdet's FocalLoss, L1Loss and "
                      "GIoULoss, with their matching solved ahead",
    "cuda_graphs": "Deformable-DETR-family (DDQ-DETR and Grounding-DINO included) and Mask2Former detectors with "
                   "mmdet's own training loss",
    "relu_dropout_fusion": "mmcv FFNs with a ReLU and a dropout of probability between 0 and 1",
    "ffn_recompute": "mmcv FFNs without dropout",
    "float32_nms": "DDQ-DETR detectors and decoders with mmdet's own pre_decoder and select_distinct_queries",
}


def _distributed_over_processes() -> bool:
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def apply_fast_paths(model: nn.Module, switches: Optional[FastPaths] = None, gradient_slots=None,
                     capture_policy=None, **switch_values) -> Dict[str, int]:
    """Turn on the selected fast paths on ``model`` (unwrapping DDP); returns how many sites each one changed.

    The switches come as a :class:`FastPaths` or as its fields by keyword (``sdpa_attention=True, ...``), not both;
    the switches they need are turned on too (:meth:`FastPaths.with_implications`). ``split_graphs_at_features``
    (None: where the run is distributed over more than one process without ``gradient_slots``, i.e. under
    DistributedDataParallel) gives the DETRs' backbone and neck a graphed region of their own; ``gradient_slots``
    (never with DistributedDataParallel) let the graphed regions hand the parameters their gradients without
    autograd's per-parameter accumulation (see :func:`.graphed_training.enable_cuda_graph_training`).
    ``capture_policy`` (a :class:`deform_plugin.cuda_graphs.CapturePolicy`) says when ``cuda_graphs`` captures an
    input shape; ``feature_bucket_size`` pads the DETRs' feature maps to buckets before their transformer's graphs
    (:class:`FastPaths`).
    """
    if switches is not None and switch_values:
        raise TypeError(f"apply_fast_paths takes a FastPaths or switches by keyword, not both (got "
                        f"{', '.join(sorted(switch_values))} beside {switches})")
    paths = (switches if switches is not None else FastPaths.from_dict(switch_values)).with_implications()
    model = getattr(model, "module", model)
    refusals = grounding_refusals(model, paths.selected())
    if refusals:
        # Refused before anything changes: a switch that silently did nothing (or something else) would mislead.
        raise ValueError("; ".join(f"fast path {name} has no exact form for {type(model).__name__}: {reason}"
                                   for name, reason in refusals.items()) + ": turn it off")
    changed = {}
    if paths.sdpa_attention:
        changed["sdpa_attention"] = enable_sdpa_attention(model)
    if paths.hungarian_host_syncs:
        check_mirrored_mmdet_version("fast path hungarian_host_syncs")
        changed["hungarian_host_syncs"] = enable_hungarian_host_syncs(model)
        enable_grounding_host_syncs(model)
    if paths.batched_matching:
        changed["batched_matching"] = enable_batched_matching(model) + enable_mask2former_batched_matching(model)
    if paths.sync_free_losses:
        check_mirrored_mmdet_version("fast path sync_free_losses")
        changed["sync_free_losses"] = enable_sync_free_losses(model)
    if paths.sync_free_forward:
        check_mirrored_mmdet_version("fast path sync_free_forward")
        changed["sync_free_forward"] = enable_sync_free_forward(model)
    if paths.batched_losses:
        # Last: a head's per-layer loss method (stock or sync-free) stays the fallback for unforeseen calls.
        check_mirrored_mmdet_version("fast path batched_losses")
        changed["batched_losses"] = sum(enable_batched_losses(head) or enable_grounding_batched_losses(head)
                                        for head in model.modules()
                                        if "loss_by_feat" in vars(head) and hasattr(head, "assigner"))
        # DDQ-DETR's head: its matching and its losses in one pass, both switches at once.
        ddq_heads = enable_ddq_one_pass_losses(model)
        changed["batched_matching"] += ddq_heads
        changed["batched_losses"] += ddq_heads
    # Before the graphs capture the network; the fusion first, so that recomputation takes the FFNs left.
    if paths.relu_dropout_fusion:
        changed["relu_dropout_fusion"] = enable_relu_dropout_fusion(model)
    if paths.ffn_recompute:
        changed["ffn_recompute"] = enable_ffn_recompute(model)
    if paths.float32_nms:
        check_mirrored_mmdet_version("fast path float32_nms")
        changed["float32_nms"] = enable_float32_nms(model)
    if paths.cuda_graphs:
        check_mirrored_mmdet_version("fast path cuda_graphs")
        split = paths.split_graphs_at_features
        if split is None:
            split = _distributed_over_processes() and gradient_slots is None
        changed["cuda_graphs"] = enable_cuda_graphs(model, split_at_features=split, gradient_slots=gradient_slots,
                                                    policy=capture_policy,
                                                    feature_bucket_size=paths.feature_bucket_size or None)
    # Logged, not warned: the shared configs select switches that some families have nothing for (DINO's FFNs have no
    # dropout to fuse).
    for note in unchanged_notes(model, changed):
        print_log(note, logger="current", level=logging.INFO)
    return changed


def unchanged_notes(model: nn.Module, changed: Dict[str, int]) -> List[str]:
    """One line per switch of ``changed`` (:func:`apply_fast_paths`' result) that changed nothing in ``model``:
    the switch, the model and what the switch looks for."""
    name = type(getattr(model, "module", model)).__name__
    return [f"deform_plugin: fast path {switch} changes nothing in {name}: it finds none of the "
            f"{_WHAT_EACH_SWITCH_CHANGES[switch]} it changes; that part of {name} runs as stock"
            for switch, count in changed.items() if count == 0]
