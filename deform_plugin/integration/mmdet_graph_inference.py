"""Inference with the forward of each input shape replayed from a CUDA graph (mmdet's DETR family, Grounding-DINO
and MaskFormer).

At batch 1 the GPU work of a detector is small and the host's kernel launches set the pace. A CUDA graph replays
the launches of a whole forward in one call. The detector's ``predict`` is split in two: the *region* (backbone,
neck, transformer and head forward: fixed-size tensors in and out, no host sync once ``sync_free_forward`` is on) is
captured once per input shape and replayed; the *post-processing* (top-k, rescaling to the original image, mask
fusion: data-dependent and cheap) runs eagerly on the replayed outputs, as mmdet runs it. DDQ-DETR selects its
decoder's queries with NMS: with the selection on the device (:mod:`.mmdet_fast_paths.ddq_distinct_queries`, which
:func:`deform_plugin.apis.enable_fast_inference` turns on) its whole forward is the region, and the last layer's
distinct queries leave it with the head's outputs; with mmdet's own (a data-dependent number of boxes, read on the
host) its region ends with the encoder, and its decoder and head run eagerly with the post-processing.
Grounding-DINO's text side (the prompt's tokens and positive maps, BERT) runs eagerly before the region, whose
inputs then include the text tensors; their shapes are part of a graph's signature
(:mod:`.mmdet_grounding_inference`).

Real photos come in many sizes, and a graph serves one shape. So each input is padded up to a bucket
(:class:`~deform_plugin.cuda_graphs.InferenceBuckets`): the DETRs take each image's size inside the padded input as
a device tensor and mask the padding, as they mask it for every image of a batch but the largest, so one graph
serves every image of its bucket. Which shape a call runs at, and whether it is captured, follows one policy:

1. the bucket's own graph, where it has one;
2. its own capture, once the bucket has earned it (:class:`~deform_plugin.cuda_graphs.CapturePolicy`'s
   ``capture_after`` calls; ``own_graph_after`` calls where a larger graph can serve it meanwhile);
3. a larger captured shape that covers it within ``borrow_max_pixels``, or a captured canvas that covers it;
4. where canvases are given, the canvas's capture (at its first call: every input of its orientation fits it);
5. otherwise eagerly, at the bucket.

A shape seen once never pays a capture, no graph is ever dropped to make room for another (past ``max_graphs`` or
the memory cap, new shapes run eagerly or borrow), and an eager call runs the same region function on the same
padded input as a replay does, so a detection does not depend on whether its shape had a graph yet, only on the
shape it ran at. On a device without graphs (the CPU) inputs are padded to their bucket all the same. The padding
changes the features near the image border slightly (convolutions see padded zeros); docs/results.md gives its
measured effect on detections and mAP.
"""
from __future__ import annotations

from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

from deform_plugin.cuda_graphs import (
    CapturePolicy,
    GraphCache,
    InferenceBuckets,
    SharedBuffers,
    canvases_from_test_pipeline,
)

from .mmdet_fast_paths.ddq_distinct_queries import (distinct_query_rows, restore_distinct_query_rows,
                                                    selects_distinct_queries_sync_free)
from .mmdet_fast_paths.graphed_inputs import image_sizes_tensor
from .mmdet_fast_paths.graphed_training import detr_decoder, detr_encoder
from .mmdet_grounding_inference import grounding_predict_split

# The mmdet release whose MaskFormerHead.predict tail the MaskFormer post-processing below mirrors.
from .mmdet_version import MIRRORED_MMDET_VERSION

# Graph inference keeps few shapes: batch-1 inputs of one test pipeline fall into a few dozen buckets at most.
DEFAULT_INFERENCE_POLICY = CapturePolicy(capture_after=2, max_graphs=16)


def _detr_region(detector, batch_inputs, image_sizes):
    encoder_outputs, decoder_inputs = detr_encoder(detector, batch_inputs, image_sizes)
    head_inputs = detr_decoder(detector, encoder_outputs, decoder_inputs)
    return detector.bbox_head(head_inputs["hidden_states"], head_inputs["references"])


def _detr_postprocess(detector, outs, batch_data_samples, rescale, context=None):
    batch_img_metas = [sample.metainfo for sample in batch_data_samples]
    results_list = detector.bbox_head.predict_by_feat(*outs, batch_img_metas=batch_img_metas, rescale=rescale)
    return detector.add_pred_to_datasample(batch_data_samples, results_list)


def _encoder_region(detector, batch_inputs, image_sizes):
    # DDQ-DETR: backbone, neck and encoder. The NMS that selects its distinct queries, before the decoder and between
    # its layers, keeps a data-dependent number of boxes: it needs the host, and runs after the replay.
    encoder_outputs, decoder_inputs = detr_encoder(detector, batch_inputs, image_sizes)
    return dict(memory=encoder_outputs["memory"], memory_mask=encoder_outputs["memory_mask"],
                valid_ratios=decoder_inputs["valid_ratios"], spatial_shapes=decoder_inputs["spatial_shapes"],
                level_start_index=decoder_inputs["level_start_index"])


def _decoder_and_postprocess(detector, outs, batch_data_samples, rescale, context=None):
    # The replayed level tables are copies: the decoder's sync-free pieces read each once (a few integers).
    encoder_outputs = dict(memory=outs["memory"], memory_mask=outs["memory_mask"],
                           spatial_shapes=outs["spatial_shapes"])
    decoder_inputs = {name: outs[name] for name in ("memory_mask", "spatial_shapes", "level_start_index",
                                                    "valid_ratios")}
    head_inputs = detr_decoder(detector, encoder_outputs, decoder_inputs, batch_data_samples)
    outs = detector.bbox_head(head_inputs["hidden_states"], head_inputs["references"])
    return _detr_postprocess(detector, outs, batch_data_samples, rescale)


def _ddq_region(detector, batch_inputs, image_sizes):
    # DDQ-DETR with its distinct queries selected on the device: the whole forward; the distinct queries that the
    # head's post-processing reads leave with its outputs.
    return _detr_region(detector, batch_inputs, image_sizes), distinct_query_rows(detector)


def _ddq_postprocess(detector, outs, batch_data_samples, rescale, context=None):
    head_outputs, rows = outs
    restore_distinct_query_rows(detector, rows)
    return _detr_postprocess(detector, head_outputs, batch_data_samples, rescale)


def _maskformer_region(detector, batch_inputs, image_sizes=None):
    # Mask2Former's forward reads the pixels only (mmdet 3.3.0 does not mask its padding).
    return detector.panoptic_head(detector.extract_feat(batch_inputs), None)


def _maskformer_postprocess(detector, outs, batch_data_samples, rescale, context=None):
    # The tail of mmdet 3.3.0's MaskFormerHead.predict, then MaskFormer.predict's fusion.
    all_cls_scores, all_mask_preds = outs
    img_shape = batch_data_samples[0].metainfo["batch_input_shape"]
    mask_pred_results = F.interpolate(all_mask_preds[-1], size=(img_shape[0], img_shape[1]), mode="bilinear",
                                      align_corners=False)
    results_list = detector.panoptic_fusion_head.predict(all_cls_scores[-1], mask_pred_results, batch_data_samples,
                                                         rescale=rescale)
    return detector.add_pred_to_datasample(batch_data_samples, results_list)


class _Split(NamedTuple):
    region: Callable
    postprocess: Callable  # (detector, outs, batch_data_samples, rescale, context)
    takes_image_sizes: bool
    # (batch_data_samples, device) -> Prepared: the region's other inputs (keyword arguments after the image sizes)
    # and the post-processing's context, made per call; None where a call must run the detector's own predict.
    prepare: Optional[Callable] = None


def _split_predict(detector) -> Optional[_Split]:
    """The region and post-processing of a detector whose class keeps mmdet's own ``predict``, else None."""
    from mmdet.models.detectors import DDQDETR, DINO, DeformableDETR, DetectionTransformer, GroundingDINO, MaskFormer
    if isinstance(detector, GroundingDINO):
        parts = grounding_predict_split(detector)
        return None if parts is None else _Split(parts.region, parts.postprocess, True, parts.prepare)
    if (isinstance(detector, DeformableDETR) and type(detector).predict is DetectionTransformer.predict
            and all(getattr(type(detector), name) is getattr(DeformableDETR, name)
                    for name in ("pre_transformer", "forward_encoder", "extract_feat"))):
        if not isinstance(detector, DDQDETR):
            return _Split(_detr_region, _detr_postprocess, True)
        if type(detector).forward_transformer is DINO.forward_transformer:
            if selects_distinct_queries_sync_free(detector):
                return _Split(_ddq_region, _ddq_postprocess, True)
            return _Split(_encoder_region, _decoder_and_postprocess, True)
    if isinstance(detector, MaskFormer) and type(detector).predict is MaskFormer.predict:
        import mmdet
        if mmdet.__version__ == MIRRORED_MMDET_VERSION:
            return _Split(_maskformer_region, _maskformer_postprocess, False)
    return None


def test_pipeline_canvases(detector) -> Tuple[Tuple[int, int], ...]:
    """The canvases of the detector's test pipeline (:func:`canvases_from_test_pipeline`), where ``init_detector``
    or ``DetInferencer`` left its config on it (``model.cfg``); () where it has none."""
    cfg = getattr(detector, "cfg", None)
    try:
        pipeline = cfg.test_dataloader.dataset.pipeline
    except AttributeError:
        pipeline = getattr(cfg, "test_pipeline", None) if cfg is not None else None
    return canvases_from_test_pipeline(pipeline)


def throughput_buckets(detector, borrow_max_pixels: float = 1.7) -> InferenceBuckets:
    """Buckets for sizes that rarely repeat: the test pipeline's canvases, and borrowing up to
    ``borrow_max_pixels`` times a bucket's pixels (more padding: see :class:`InferenceBuckets`)."""
    return InferenceBuckets(canvases=test_pipeline_canvases(detector), borrow_max_pixels=borrow_max_pixels)


class _CapturedForward:
    """One input shape's graph, the static inputs it reads and the outputs it writes."""

    def __init__(self, graph, static_input: torch.Tensor, static_sizes: Optional[torch.Tensor],
                 static_inputs: Dict[str, torch.Tensor], static_outputs):
        self.graph = graph
        self.static_input = static_input
        self.static_sizes = static_sizes
        self.static_inputs = static_inputs  # the prepared inputs (Grounding-DINO's text tensors), by name
        self.static_outputs = static_outputs


class GraphInference:
    """A detector's ``predict`` with each input shape's forward replayed from a CUDA graph (see the module).

    Args:
        detector: an mmdet ``DeformableDETR``-family detector (Deformable-DETR, DINO, Grounding-DINO, ...) or
            ``MaskFormer``.
        policy: when a shape earns its graph and how many are kept (default: captured at its second call, at most
            16 graphs).
        buckets: how inputs are padded so that graphs are reused (:class:`InferenceBuckets`); None: no padding, a
            graph per exact input shape. Default: ``InferenceBuckets()`` (32 px steps, borrowing at most 15% more
            pixels, no canvases); :func:`throughput_buckets` for sizes that rarely repeat.
    """

    # Graphs are CUDA graphs; tests emulate them on the CPU with a subclass that sets this to "cpu".
    device_type = "cuda"

    def __init__(self, detector, policy: Optional[CapturePolicy] = None, buckets: Optional[InferenceBuckets] = ...):
        split = _split_predict(detector)
        if split is None:
            raise TypeError(f"{type(detector).__name__} has no graph inference: it is not one of mmdet's DETR-family, "
                            "Grounding-DINO or MaskFormer detectors with their own predict()")
        self.detector = detector
        self.region, self.postprocess, self.takes_image_sizes, self.prepare = split
        self.eager_predict = type(detector).predict.__get__(detector)
        self.buckets = InferenceBuckets() if buckets is ... else buckets
        self.graphs = GraphCache(f"{type(detector).__name__} inference", policy or DEFAULT_INFERENCE_POLICY)
        self.shared = SharedBuffers()
        self.warmed_on_capture_stream: set = set()
        self.borrowed_calls = 0  # calls that ran on a larger shape's graph (a canvas included)
        self.pixels = [0, 0]  # the inputs' own pixels and those they ran at

    @property
    def policy(self) -> CapturePolicy:
        return self.graphs.policy

    def predict(self, batch_inputs: torch.Tensor, batch_data_samples, rescale: bool = True):
        graphs_run_here = batch_inputs.device.type == self.device_type
        if self.detector.training or torch.is_grad_enabled() or (self.buckets is None and not graphs_run_here):
            return self.eager_predict(batch_inputs, batch_data_samples, rescale=rescale)
        inputs, context = {}, None
        if self.prepare is not None:
            prepared = self.prepare(batch_data_samples, batch_inputs.device)
            if prepared is None:
                return self.eager_predict(batch_inputs, batch_data_samples, rescale=rescale)
            inputs, context = prepared
        # The prepared inputs' shapes are the graph's too: another prompt length is another kind, with its own graphs.
        kind = (tuple(batch_inputs.shape[:2]), batch_inputs.dtype, batch_inputs.device,
                torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"),
                tuple((name, tuple(tensor.shape), tensor.dtype) for name, tensor in inputs.items()))
        height, width = batch_inputs.shape[-2:]
        if graphs_run_here:
            shape, capture = self._choose_shape((int(height), int(width)), kind)
        else:  # no graphs on this device: the bucket's padding all the same, so that detections match the GPU's
            shape, capture = self._bucket((int(height), int(width))), False
        batch_inputs = self._pad(batch_inputs, batch_data_samples, shape)
        self.pixels[0] += int(height) * int(width)
        self.pixels[1] += shape[0] * shape[1]
        image_sizes = (image_sizes_tensor(batch_data_samples, batch_inputs.device) if self.takes_image_sizes
                       else None)
        key = kind + (shape,)
        entry = self.graphs.entries.get(key)
        if entry is None and capture:
            entry = self.graphs.capture(key, lambda: self._capture(batch_inputs, image_sizes, inputs, kind),
                                        batch_inputs.device, f" of input {list(batch_inputs.shape)}")
        if entry is None:
            self.graphs.note_eager_call(key)
            outs = self.region(self.detector, batch_inputs, image_sizes, **inputs)
        else:
            entry.static_input.copy_(batch_inputs)
            if entry.static_sizes is not None:
                entry.static_sizes.copy_(image_sizes)
            for name, tensor in inputs.items():
                entry.static_inputs[name].copy_(tensor)
            entry.graph.replay()
            self.graphs.replays += 1
            # Clones: the next replay overwrites the static outputs.
            outs = pytree.tree_map(torch.clone, entry.static_outputs)
        return self.postprocess(self.detector, outs, batch_data_samples, rescale, context)

    # -- the policy -------------------------------------------------------------------------------------------------
    def _choose_shape(self, input_shape: Tuple[int, int], kind) -> Tuple[Tuple[int, int], bool]:
        """The shape a call runs at, and whether that shape is captured now (see the module's list)."""
        buckets = self.buckets
        bucket = self._bucket(input_shape)
        graphs = self.graphs
        if kind + (bucket,) in graphs.entries:
            return bucket, False
        first_of_kind = kind not in graphs.warmed_up_kinds
        captured = [key[-1] for key in graphs.entries if key[:-1] == kind]
        canvas = None
        stand_in = None
        if buckets is not None:
            canvas = buckets.canvas_for(bucket)
            canvas = None if canvas is None else self._bucket(canvas)
            stand_in = buckets.borrowable(bucket, captured)
            if stand_in is None and canvas is not None and canvas in captured:
                stand_in = canvas
        own_after = buckets.own_graph_after if stand_in is not None else None
        if graphs.earns_capture(kind + (bucket,), kind, capture_after=own_after):
            return bucket, True
        if stand_in is not None:
            self.borrowed_calls += 1
            return stand_in, False
        if not first_of_kind and canvas is not None and canvas != bucket:
            # Every input of the canvas's orientation fits it: it recurs by construction, so it is captured at once.
            if graphs.earns_capture(kind + (canvas,), kind, capture_after=1):
                self.borrowed_calls += 1
                return canvas, True
        return bucket, False

    def _bucket(self, shape: Tuple[int, int]) -> Tuple[int, int]:
        """``shape`` padded to its bucket (itself without buckets), a multiple of the preprocessor's divisor too."""
        if self.buckets is None:
            return shape
        divisor = getattr(getattr(self.detector, "data_preprocessor", None), "pad_size_divisor", 1) or 1
        return self.buckets.bucket(shape, divisor)

    def _pad(self, batch_inputs: torch.Tensor, batch_data_samples, shape: Tuple[int, int]) -> torch.Tensor:
        """``batch_inputs`` padded at the bottom and right to ``shape`` with the data preprocessor's pad value;
        the samples' ``batch_input_shape`` follows."""
        height, width = batch_inputs.shape[-2:]
        if (height, width) == shape:
            return batch_inputs
        pad_value = getattr(getattr(self.detector, "data_preprocessor", None), "pad_value", 0)
        for sample in batch_data_samples:
            sample.set_metainfo({"batch_input_shape": tuple(shape)})
        return F.pad(batch_inputs, (0, shape[1] - width, 0, shape[0] - height), value=pad_value)

    # -- capture ----------------------------------------------------------------------------------------------------
    def _capture(self, batch_inputs: torch.Tensor, image_sizes: Optional[torch.Tensor],
                 inputs: Dict[str, torch.Tensor], kind) -> _CapturedForward:
        role = tuple(batch_inputs.shape[:2]) + (batch_inputs.dtype,)
        static_input = self.shared.view_like(("input", role), batch_inputs)
        static_input.copy_(batch_inputs)
        static_sizes = None
        if image_sizes is not None:
            static_sizes = self.shared.view_like(("image_sizes", role), image_sizes)
            static_sizes.copy_(image_sizes)
        static_inputs = {}
        for name, tensor in inputs.items():
            static_inputs[name] = self.shared.view_like((name, role), tensor)
            static_inputs[name].copy_(tensor)
        autocast_on, autocast_dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
        # Autocast's cache of cast weights is off while capturing: a graph that read a cached cast would read freed
        # memory once the caller's autocast region ends and drops its cache.
        with self.graphs.capture_stream(batch_inputs.device), \
                torch.autocast("cuda", dtype=autocast_dtype, enabled=autocast_on, cache_enabled=False):
            if kind not in self.warmed_on_capture_stream:
                # Once per kind: the libraries' per-stream state (cuBLAS workspaces) exists before a capture.
                self.region(self.detector, static_input, static_sizes, **static_inputs)
                self.warmed_on_capture_stream.add(kind)
            graph, outputs = self.capture_graph(
                lambda: self.region(self.detector, static_input, static_sizes, **static_inputs))
        return _CapturedForward(graph, static_input, static_sizes, static_inputs, outputs)

    def capture_graph(self, work: Callable[[], object]):
        """``(graph, outputs)``: a graph replaying the kernels ``work()`` launches, and the outputs it writes."""
        return self.graphs.capture_graph(work)

    def stats(self) -> Dict[str, object]:
        """Graphs, replays, eager calls, capture time, graph memory, borrowed calls and the padding's extra pixels."""
        stats = self.graphs.stats()
        stats.update(borrowed_calls=self.borrowed_calls,
                     padded_pixels=(self.pixels[1] / self.pixels[0] - 1.0) if self.pixels[0] else 0.0)
        return stats


def enable_graph_inference(detector, policy: Optional[CapturePolicy] = None,
                           buckets: Optional[InferenceBuckets] = ...) -> GraphInference:
    """Give ``detector`` (an instance) the graph-replayed ``predict`` of :class:`GraphInference`; returns it."""
    graph_inference = GraphInference(detector, policy=policy, buckets=buckets)
    detector.predict = graph_inference.predict
    return graph_inference
