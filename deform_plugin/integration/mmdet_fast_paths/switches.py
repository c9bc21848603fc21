"""The switches of the exact fast paths: one typed object, :class:`FastPaths`, that every caller builds.

``FastPathsHook`` (configs), :func:`~deform_plugin.integration.mmdet_fast_paths.apply_fast_paths` (tools) and the
benchmarks' rows all name the switches by its fields; :meth:`FastPaths.with_implications` is the one place that
says which switch needs which.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping, Optional, Tuple

__all__ = ["FastPaths"]


@dataclass(frozen=True)
class FastPaths:
    """Which exact fast paths a model takes; each is off unless set.

    The switches change classes and methods of existing objects only (no new parameters), so checkpoints stay
    interchangeable with stock runs. Truthy values count as on (configs may write ``1``).

    Attributes:
        sdpa_attention: mmcv ``MultiheadAttention`` bricks run PyTorch SDPA (``need_weights=False``).
        hungarian_host_syncs: ``HungarianAssigner.assign`` builds its result on the host and copies it once,
            without blocking; DETR-family heads take their positive/negative query indices from that host copy
            instead of two ``nonzero()`` syncs.
        batched_matching: every decoder layer's matching of a step in one cost pass and one copy to the host (for
            Mask2Former with its losses and ground truth made sync-free; for DDQ-DETR only with ``batched_losses``);
            needs ``hungarian_host_syncs``.
        sync_free_losses: the DETR heads' per-layer loss normalisers without host syncs.
        sync_free_forward: Deformable-DETR's, DINO's and Mask2Former's forward without host syncs (level tables
            made on the host, the host's sizes walked instead of the device's).
        batched_losses: every decoder layer's DETR loss (focal, L1, GIoU) of a step in one pass over all layers,
            from the assignments solved ahead, DINO's denoising losses in one pass as well (DDQ-DETR's head: its
            whole loss, the dense queries' included, with all of the step's matching in one copy); needs
            ``batched_matching``.
        cuda_graphs: the network's training forward and backward replayed from CUDA graphs, one pair per input
            shape (Deformable-DETR, DINO, Grounding-DINO with its BERT, Mask2Former); needs ``sync_free_forward``.
        relu_dropout_fusion: mmcv ``FFN``'s ReLU and dropout keep one activation for backward instead of three
            (less memory; the same outputs, random draws and gradients).
        ffn_recompute: mmcv ``FFN`` modules without dropout keep only their input and recompute their hidden layer in
            the backward (less memory for two more matmuls per FFN; the same outputs and gradients).
        float32_nms: DDQ-DETR's NMS (the distinct queries' selection before and between its decoder layers) takes
            its boxes and scores in float32 where they are bf16 or fp16, so that it runs under autocast (stock's
            fails there) and decides as float32 NMS on those values; a no-op in float32.
        split_graphs_at_features: with ``cuda_graphs``, the DETRs' backbone and neck captured as a region of their
            own, so that DistributedDataParallel all-reduces the other gradients while the backbone's backward
            replays. None: only under DistributedDataParallel (see
            :func:`~deform_plugin.integration.mmdet_fast_paths.apply_fast_paths`).
        feature_bucket_size: with ``cuda_graphs``, Deformable-DETR's and DINO's transformer and head captured per
            feature bucket: the backbone and neck run at each batch's own shape (a region of their own), and their
            feature maps and padding masks are padded, each side up to a multiple of this many input pixels, before
            the transformer, whose graphs then serve every batch shape of a bucket. Exact (the added cells are
            masked and excluded; :mod:`.padded_levels` says why), unlike ``ShapeBucketsHook``'s padding of the
            images. None or 0: off; ``FastPathsHook`` sets 128 in a run without ``ShapeBucketsHook``.
    """

    sdpa_attention: bool = False
    hungarian_host_syncs: bool = False
    batched_matching: bool = False
    sync_free_losses: bool = False
    sync_free_forward: bool = False
    batched_losses: bool = False
    cuda_graphs: bool = False
    relu_dropout_fusion: bool = False
    ffn_recompute: bool = False
    float32_nms: bool = False
    split_graphs_at_features: Optional[bool] = None
    feature_bucket_size: Optional[int] = None

    def __post_init__(self):
        for name in self.switch_names():
            object.__setattr__(self, name, bool(getattr(self, name)))
        if self.split_graphs_at_features is not None:
            object.__setattr__(self, "split_graphs_at_features", bool(self.split_graphs_at_features))
        size = self.feature_bucket_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
            raise ValueError(f"FastPaths: feature_bucket_size must be an int >= 0 (pixels; 0: off) or None, got "
                             f"{size!r}")

    @classmethod
    def field_names(cls) -> Tuple[str, ...]:
        """Every field: the on/off switches, then ``split_graphs_at_features`` and ``feature_bucket_size``."""
        return tuple(field.name for field in dataclasses.fields(cls))

    @classmethod
    def switch_names(cls) -> Tuple[str, ...]:
        """The on/off switches, in the order :func:`apply_fast_paths` turns them on."""
        return tuple(name for name in cls.field_names()
                     if name not in ("split_graphs_at_features", "feature_bucket_size"))

    @classmethod
    def from_dict(cls, switches: Mapping[str, object]) -> FastPaths:
        """The switches of a mapping such as a ``FastPathsHook`` config; a name that is no field is refused, with the
        valid ones."""
        unknown = sorted(set(switches) - set(cls.field_names()))
        if unknown:
            raise ValueError(f"unknown fast path switch{'es' if len(unknown) > 1 else ''} {', '.join(unknown)}: the "
                             f"switches are {', '.join(cls.field_names())}")
        return cls(**switches)

    @classmethod
    def all_exact(cls) -> FastPaths:
        """Every switch on (each fast path is exact)."""
        return cls(**{name: True for name in cls.switch_names()})

    def with_implications(self) -> FastPaths:
        """These switches with those they need turned on too: ``batched_losses`` needs ``batched_matching``, which
        needs ``hungarian_host_syncs``; ``cuda_graphs`` needs ``sync_free_forward``."""
        batched_matching = self.batched_matching or self.batched_losses
        return dataclasses.replace(self, batched_matching=batched_matching,
                                   hungarian_host_syncs=self.hungarian_host_syncs or batched_matching,
                                   sync_free_forward=self.sync_free_forward or self.cuda_graphs)

    def selected(self) -> Tuple[str, ...]:
        """The switches that are on."""
        return tuple(name for name in self.switch_names() if getattr(self, name))
