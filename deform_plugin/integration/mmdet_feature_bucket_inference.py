"""Graph inference of Deformable-DETR and DINO with the feature maps padded instead of the image: exact detections.

:class:`~.mmdet_graph_inference.GraphInference` pads each input image up to a bucket, which changes the features
near its border slightly (convolutions see the padded zeros). :class:`FeatureBucketInference` runs the backbone and
neck at the input's own size instead (from a graph once that size recurs, eagerly before), pads each feature level
and its padding mask up to a feature bucket (:mod:`.mmdet_fast_paths.padded_levels`, which says why the outputs are
the unpadded ones), and replays the transformer and head from the bucket's graph, captured at the bucket's first
call. The detections are those of the unpadded input (up to float rounding; mmdet makes its reference points in
float32), and a stream of sizes that never repeat still replays the transformer, which is most of a DETR's launches.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch
import torch.utils._pytree as pytree

from deform_plugin.cuda_graphs import (DEFAULT_FEATURE_BUCKET_SIZE, CapturePolicy, GraphCache,
                                       check_feature_bucket_size)

from .mmdet_fast_paths.graphed_inputs import image_sizes_tensor
from .mmdet_fast_paths.graphed_training import detr_encoder
from .mmdet_fast_paths.padded_levels import (added_tokens, dino_forward_decoder, dino_topk_proposals, pad_levels,
                                             pads_deformable_detr_decoder, pads_dino_decoder, two_stage_pre_decoder,
                                             unpadded_valid_ratios)
from .mmdet_graph_inference import DEFAULT_INFERENCE_POLICY, GraphInference, _detr_postprocess

def supports_feature_buckets(detector) -> bool:
    """Whether ``detector`` is a Deformable-DETR or DINO with mmdet 3.3.0's predict and transformer pieces."""
    from mmdet.models.detectors import DINO, DeformableDETR, DetectionTransformer
    detector_type = type(detector)
    if not isinstance(detector, DeformableDETR) or detector_type.predict is not DetectionTransformer.predict:
        return False
    if not all(getattr(detector_type, name) is getattr(DeformableDETR, name)
               for name in ("pre_transformer", "forward_encoder", "extract_feat")):
        return False
    if detector_type.forward_transformer is DINO.forward_transformer:
        return (all(getattr(detector_type, name) is getattr(DINO, name) for name in ("pre_decoder", "forward_decoder"))
                and pads_dino_decoder(detector))
    return (detector_type.forward_transformer is DeformableDETR.forward_transformer
            and all(getattr(detector_type, name) is getattr(DeformableDETR, name)
                    for name in ("pre_decoder", "forward_decoder"))
            and pads_deformable_detr_decoder(detector))


def transformer_and_head(detector, features: Sequence[torch.Tensor], level_masks: Sequence[torch.Tensor],
                         unpadded_shapes: torch.Tensor):
    """mmdet 3.3.0's ``forward_transformer`` (inference) and the head's forward on padded feature levels."""
    from mmdet.models.detectors import DINO
    encoder_outputs, decoder_inputs = detr_encoder(detector, None, None, tuple(features), tuple(level_masks))
    memory, memory_mask = encoder_outputs["memory"], encoder_outputs["memory_mask"]
    spatial_shapes = encoder_outputs["spatial_shapes"]
    excluded = added_tokens(spatial_shapes, unpadded_shapes)
    if isinstance(detector, DINO):
        _, topk_coords_unact = dino_topk_proposals(detector, memory, memory_mask, spatial_shapes, excluded)
        query = detector.query_embedding.weight[:, None, :].repeat(1, memory.shape[0], 1).transpose(0, 1)
        head_inputs = dino_forward_decoder(
            detector, query, memory, reference_points=topk_coords_unact.detach().sigmoid(), dn_mask=None,
            query_position_ratios=unpadded_valid_ratios(level_masks, unpadded_shapes), **decoder_inputs)
    else:
        if detector.as_two_stage:
            decoder_inputs_from_encoder, _ = two_stage_pre_decoder(detector, memory, memory_mask, spatial_shapes,
                                                                   excluded)
        else:
            decoder_inputs_from_encoder, _ = detector.pre_decoder(**encoder_outputs)
        head_inputs = detector.forward_decoder(**decoder_inputs, **decoder_inputs_from_encoder)
    return detector.bbox_head(head_inputs["hidden_states"], head_inputs["references"])


class _Captured:
    def __init__(self, graph, static_inputs, static_outputs):
        self.graph, self.static_inputs, self.static_outputs = graph, static_inputs, static_outputs


class FeatureBucketInference(GraphInference):
    """A Deformable-DETR's or DINO's ``predict`` with the backbone and neck run at the input's own size and the
    transformer and head replayed per feature bucket (see the module).

    Args:
        detector: a detector :func:`supports_feature_buckets` accepts.
        policy: when the backbone's graph of an input size is captured, and how many graphs each part keeps
            (default: captured at the size's second call, at most 16); a feature bucket is captured at its first
            call once the kind warmed up (buckets recur by construction).
        feature_bucket_size: each feature level's sides rounded up to this many input pixels' worth of cells.
    """

    def __init__(self, detector, policy: Optional[CapturePolicy] = None,
                 feature_bucket_size: int = DEFAULT_FEATURE_BUCKET_SIZE):
        if not supports_feature_buckets(detector):
            raise TypeError(f"{type(detector).__name__} has no feature-bucket inference: it is not a Deformable-DETR "
                            "or DINO with mmdet 3.3.0's predict and transformer")
        if feature_bucket_size is None:
            raise ValueError("FeatureBucketInference: feature_bucket_size must be an int >= 1 (pixels), got None")
        check_feature_bucket_size("FeatureBucketInference", "feature_bucket_size", feature_bucket_size)
        super().__init__(detector, policy=policy, buckets=None)
        self.feature_bucket_size = feature_bucket_size
        name = type(detector).__name__
        self.graphs.name = f"{name} inference transformer and head"
        self.feature_graphs = GraphCache(f"{name} inference backbone and neck", self.graphs.policy)

    def predict(self, batch_inputs: torch.Tensor, batch_data_samples, rescale: bool = True):
        if self.detector.training or torch.is_grad_enabled():
            return self.eager_predict(batch_inputs, batch_data_samples, rescale=rescale)
        if batch_inputs.device.type != self.device_type:
            # Off the graphs' device nothing is replayed, and the padded path would give the same detections.
            self.graphs.note_eager_call()
            return self.eager_predict(batch_inputs, batch_data_samples, rescale=rescale)
        detector = self.detector
        kind = (tuple(batch_inputs.shape[:2]), batch_inputs.dtype, batch_inputs.device,
                torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
        height, width = (int(side) for side in batch_inputs.shape[-2:])
        features = self._run(self.feature_graphs, "features", kind, (height, width),
                             lambda pixels: tuple(detector.extract_feat(pixels)), [batch_inputs])
        levels = pad_levels(features, image_sizes_tensor(batch_data_samples, batch_inputs.device), (height, width),
                            self.feature_bucket_size)
        self.pixels[0] += sum(f.shape[-2] * f.shape[-1] for f in features)
        self.pixels[1] += sum(f.shape[-2] * f.shape[-1] for f in levels.features)
        count = len(features)
        outs = self._run(self.graphs, "levels", kind, tuple(tuple(f.shape[-2:]) for f in levels.features),
                         lambda *tensors: transformer_and_head(detector, tensors[:count], tensors[count:2 * count],
                                                               tensors[2 * count]),
                         [*levels.features, *levels.masks, levels.unpadded_shapes], capture_after=1)
        return _detr_postprocess(detector, outs, batch_data_samples, rescale)

    def _run(self, cache: GraphCache, role: str, kind, shape, fn, inputs, capture_after: Optional[int] = None):
        """``fn(*inputs)``: replayed from ``cache``'s graph of ``shape``, captured now where it earns it, else
        eagerly."""
        key = kind + (shape,)
        entry = cache.entries.get(key)
        if entry is None and cache.earns_capture(key, kind, capture_after=capture_after):
            entry = cache.capture(key, lambda: self._capture(cache, role, kind, fn, inputs), inputs[0].device,
                                  f" of {role} {list(shape)}")
        if entry is None:
            cache.note_eager_call(key)
            return fn(*inputs)
        for static, value in zip(entry.static_inputs, inputs):
            static.copy_(value)
        entry.graph.replay()
        cache.replays += 1
        # Clones: the next replay overwrites the static outputs.
        return pytree.tree_map(torch.clone, entry.static_outputs)

    def _capture(self, cache: GraphCache, role: str, kind, fn, inputs) -> _Captured:
        static_inputs = []
        for index, tensor in enumerate(inputs):
            static = self.shared.view_like((role, index), tensor)
            static.copy_(tensor)
            static_inputs.append(static)
        autocast_on, autocast_dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
        device = inputs[0].device
        # Autocast's cache of cast weights is off while capturing (see GraphInference._capture).
        with cache.capture_stream(device), \
                torch.autocast("cuda", dtype=autocast_dtype, enabled=autocast_on, cache_enabled=False):
            if (role, kind) not in self.warmed_on_capture_stream:
                fn(*static_inputs)  # the libraries' per-stream state before a capture
                self.warmed_on_capture_stream.add((role, kind))
            graph, outputs = self.capture_graph(lambda: fn(*static_inputs), cache)
        return _Captured(graph, static_inputs, outputs)

    def capture_graph(self, work, cache: Optional[GraphCache] = None):
        """``(graph, outputs)`` of ``work()`` in ``cache``'s pool (the transformer's by default)."""
        return (cache or self.graphs).capture_graph(work)

    def stats(self) -> Dict[str, object]:
        """The transformer's graphs, replays and eager calls (one per call), the backbone's under ``backbone``, and
        the cells the feature buckets add."""
        stats = super().stats()
        stats.update(backbone=self.feature_graphs.stats(), borrowed_calls=0)
        stats["capture_seconds"] += self.feature_graphs.capture_seconds
        stats["graph_memory_mb"] += self.feature_graphs.graph_memory_bytes / (1 << 20)
        return stats


def enable_feature_bucket_inference(detector, policy: Optional[CapturePolicy] = None,
                                    feature_bucket_size: int = DEFAULT_FEATURE_BUCKET_SIZE) -> FeatureBucketInference:
    """Give ``detector`` (an instance) the ``predict`` of :class:`FeatureBucketInference`; returns it."""
    graph_inference = FeatureBucketInference(detector, policy=policy or DEFAULT_INFERENCE_POLICY,
                                             feature_bucket_size=feature_bucket_size)
    detector.predict = graph_inference.predict
    return graph_inference
