"""Opt-in, exact fast paths for the parts of an mmdet training step outside MSDA.

This package is the one place that knows the private structure these fast paths change (mmcv's
``MultiheadAttention`` brick, mmdet's ``HungarianAssigner`` and DETR heads). Nothing here runs unless a config asks
for it, through ``deform_plugin.engine.FastPathsHook`` in ``custom_hooks`` (or a tool calling
:func:`apply_fast_paths`). Each switch changes instances of one model only; each is exact (see its module):

- ``sdpa_attention`` (:mod:`.sdpa_attention`): attention bricks through PyTorch SDPA;
- ``hungarian_host_syncs`` and ``batched_matching`` (:mod:`.matching`): matching with fewer syncs, and all of a
  step's matching in one pass (for Mask2Former, with its losses made sync-free: :mod:`.mask2former_losses`);
- ``sync_free_losses`` (:mod:`.loss_normalisation`): the DETR heads' per-layer losses without host syncs;
- ``batched_losses`` (:mod:`.batched_losses`): every decoder layer's loss in one pass, DINO's denoising losses too
  (needs the matching solved ahead: turns ``batched_matching`` on too);
- ``sync_free_forward`` (:mod:`.sync_free_forward`): Deformable-DETR's and DINO's forward without host syncs;
- ``cuda_graphs`` (:mod:`.graphed_training`): their training forward and backward replayed from CUDA graphs, one
  pair per input shape (needs the sync-free forward: turns it on too); under DistributedDataParallel the DETRs'
  backbone and neck are captured as a region of their own, so that the other gradients are all-reduced while the
  backbone's backward replays (``split_graphs_at_features``); elsewhere the regions write the gradients into
  ``gradient_slots``;
- ``relu_dropout_fusion`` and ``ffn_recompute`` (:mod:`.ffn_memory`): mmcv ``FFN``'s ReLU and dropout keep one
  activation for backward instead of three; FFNs without dropout recompute their hidden layer in the backward
  (less training memory).

All but the first and the last two replace private methods of mmdet 3.3.0 with copies: they refuse other mmdet versions.
"""
from __future__ import annotations

from typing import Dict, Optional

from torch import nn

from .batched_losses import enable_batched_losses
from .graphed_training import enable_cuda_graphs
from .loss_normalisation import enable_sync_free_losses
from .mask2former_losses import enable_mask2former_batched_matching
from .matching import enable_batched_matching, enable_hungarian_host_syncs
from .ffn_memory import enable_ffn_recompute, enable_relu_dropout_fusion
from .sdpa_attention import disable_sdpa_attention, enable_sdpa_attention, sdpa_multihead_attention_class
from .sync_free_forward import enable_sync_free_forward

# The mmdet release whose private DETRHead methods the copies in this package mirror line for line.
MIRRORED_MMDET_VERSION = "3.3.0"
FAST_PATHS = ("sdpa_attention", "hungarian_host_syncs", "batched_matching", "sync_free_losses", "sync_free_forward",
              "batched_losses", "cuda_graphs", "relu_dropout_fusion", "ffn_recompute")

__all__ = ["FAST_PATHS", "apply_fast_paths", "check_mirrored_mmdet_version", "disable_sdpa_attention",
           "enable_sdpa_attention", "sdpa_multihead_attention_class"]


def _distributed_over_processes() -> bool:
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def check_mirrored_mmdet_version(switch: str) -> None:
    """Refuse an mmdet-private copy on an mmdet other than the one it mirrors, with a clear message."""
    import mmdet
    if mmdet.__version__ != MIRRORED_MMDET_VERSION:
        raise RuntimeError(
            f"deform_plugin's {switch} fast path mirrors private methods of mmdet {MIRRORED_MMDET_VERSION}, but "
            f"mmdet {mmdet.__version__} is installed: turn it off (FastPathsHook({switch}=False)) or install "
            f"mmdet=={MIRRORED_MMDET_VERSION}")


def apply_fast_paths(model: nn.Module, sdpa_attention: bool = False, hungarian_host_syncs: bool = False,
                     batched_matching: bool = False, sync_free_losses: bool = False,
                     sync_free_forward: bool = False, batched_losses: bool = False,
                     cuda_graphs: bool = False, relu_dropout_fusion: bool = False,
                     ffn_recompute: bool = False, split_graphs_at_features: Optional[bool] = None,
                     gradient_slots=None, capture_policy=None) -> Dict[str, int]:
    """Turn on the selected fast paths on ``model`` (unwrapping DDP); returns how many sites each one changed.

    ``batched_matching`` builds on ``hungarian_host_syncs`` and turns it on too; ``batched_losses`` builds on
    ``batched_matching``; ``cuda_graphs`` on ``sync_free_forward``. ``split_graphs_at_features`` (None: where the
    run is distributed over more than one process without ``gradient_slots``, i.e. under DistributedDataParallel)
    gives the DETRs' backbone and neck a graphed region of their own; ``gradient_slots`` (never with
    DistributedDataParallel) let the graphed regions hand the parameters their gradients without autograd's
    per-parameter accumulation (see :func:`.graphed_training.enable_cuda_graph_training`). ``capture_policy``
    (a :class:`deform_plugin.cuda_graphs.CapturePolicy`) says when ``cuda_graphs`` captures an input shape.
    """
    batched_matching = batched_matching or batched_losses
    sync_free_forward = sync_free_forward or cuda_graphs
    model = getattr(model, "module", model)
    changed = {}
    if sdpa_attention:
        changed["sdpa_attention"] = enable_sdpa_attention(model)
    if hungarian_host_syncs or batched_matching:
        check_mirrored_mmdet_version("hungarian_host_syncs")
        changed["hungarian_host_syncs"] = enable_hungarian_host_syncs(model)
    if batched_matching:
        changed["batched_matching"] = enable_batched_matching(model) + enable_mask2former_batched_matching(model)
    if sync_free_losses:
        check_mirrored_mmdet_version("sync_free_losses")
        changed["sync_free_losses"] = enable_sync_free_losses(model)
    if sync_free_forward:
        check_mirrored_mmdet_version("sync_free_forward")
        changed["sync_free_forward"] = enable_sync_free_forward(model)
    if batched_losses:
        # Last: a head's per-layer loss method (stock or sync-free) stays the fallback for unforeseen calls.
        check_mirrored_mmdet_version("batched_losses")
        changed["batched_losses"] = sum(enable_batched_losses(head) for head in model.modules()
                                        if "loss_by_feat" in vars(head) and hasattr(head, "assigner"))
    # Before the graphs capture the network; the fusion first, so that recomputation takes the FFNs left.
    if relu_dropout_fusion:
        changed["relu_dropout_fusion"] = enable_relu_dropout_fusion(model)
    if ffn_recompute:
        changed["ffn_recompute"] = enable_ffn_recompute(model)
    if cuda_graphs:
        check_mirrored_mmdet_version("cuda_graphs")
        if split_graphs_at_features is None:
            split_graphs_at_features = _distributed_over_processes() and gradient_slots is None
        changed["cuda_graphs"] = enable_cuda_graphs(model, split_at_features=split_graphs_at_features,
                                                    gradient_slots=gradient_slots, policy=capture_policy)
    return changed
