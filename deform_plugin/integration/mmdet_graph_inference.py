"""Inference with each input signature's forward captured in a CUDA graph (mmdet's DETR family and MaskFormer).

At batch 1 the GPU work of a detector is small and the host's kernel launches set the pace. A CUDA graph replays
the launches of a whole forward in one call. The detector's ``predict`` is split in two: the *region*
(backbone, neck, transformer and head forward: fixed-size tensors in and out, no host sync once
``sync_free_forward`` is on) is captured once per input signature and replayed; the *post-processing* (top-k,
rescaling to the original image, mask fusion: data-dependent and cheap) runs eagerly on the replayed outputs, as
mmdet runs it. The signature is everything the region reads on the host: the input's shape, dtype and device,
every image's shape in the batch, and the autocast state. A signature seen for the first time is warmed up eagerly
(compiling the Triton kernels, choosing cuDNN algorithms) and captured; beyond ``max_graphs`` signatures, or where
a capture fails, that signature runs eagerly, with one log line saying why.

Detections equal eager inference up to floating-point rounding (the same kernels run; atomics may order additions
differently).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from mmengine.logging import print_log

# The mmdet release whose MaskFormerHead.predict tail the MaskFormer post-processing below mirrors.
from .mmdet_version import MIRRORED_MMDET_VERSION


def _detr_region(detector, batch_inputs, batch_data_samples):
    img_feats = detector.extract_feat(batch_inputs)
    head_inputs_dict = detector.forward_transformer(img_feats, batch_data_samples)
    return detector.bbox_head(head_inputs_dict["hidden_states"], head_inputs_dict["references"])


def _detr_postprocess(detector, outs, batch_data_samples, rescale):
    batch_img_metas = [sample.metainfo for sample in batch_data_samples]
    results_list = detector.bbox_head.predict_by_feat(*outs, batch_img_metas=batch_img_metas, rescale=rescale)
    return detector.add_pred_to_datasample(batch_data_samples, results_list)


def _maskformer_region(detector, batch_inputs, batch_data_samples):
    return detector.panoptic_head(detector.extract_feat(batch_inputs), batch_data_samples)


def _maskformer_postprocess(detector, outs, batch_data_samples, rescale):
    # The tail of mmdet 3.3.0's MaskFormerHead.predict, then MaskFormer.predict's fusion.
    all_cls_scores, all_mask_preds = outs
    img_shape = batch_data_samples[0].metainfo["batch_input_shape"]
    mask_pred_results = F.interpolate(all_mask_preds[-1], size=(img_shape[0], img_shape[1]), mode="bilinear",
                                      align_corners=False)
    results_list = detector.panoptic_fusion_head.predict(all_cls_scores[-1], mask_pred_results, batch_data_samples,
                                                         rescale=rescale)
    return detector.add_pred_to_datasample(batch_data_samples, results_list)


def _split_predict(detector) -> Optional[Tuple[Callable, Callable]]:
    """The (region, post-processing) pair of a detector whose class keeps mmdet's own ``predict``, else None."""
    from mmdet.models.detectors import DetectionTransformer, MaskFormer
    if isinstance(detector, DetectionTransformer) and type(detector).predict is DetectionTransformer.predict:
        return _detr_region, _detr_postprocess
    if isinstance(detector, MaskFormer) and type(detector).predict is MaskFormer.predict:
        import mmdet
        if mmdet.__version__ == MIRRORED_MMDET_VERSION:
            return _maskformer_region, _maskformer_postprocess
    return None


class _CapturedForward:
    """One signature's graph: a static input buffer, the graph, and the region's static outputs."""

    def __init__(self, graph: torch.cuda.CUDAGraph, static_input: torch.Tensor, static_outputs):
        self.graph = graph
        self.static_input = static_input
        self.static_outputs = static_outputs


class GraphInference:
    """A detector's ``predict`` with the forward of each input signature captured in a CUDA graph.

    Args:
        detector: an mmdet ``DetectionTransformer`` (Deformable-DETR, DINO, ...) or ``MaskFormer`` in eval mode.
        max_graphs: signatures kept as graphs (least recently used dropped first); others run eagerly.
        warmup_runs: eager runs of a new signature before its capture.
    """

    def __init__(self, detector, max_graphs: int = 4, warmup_runs: int = 2):
        split = _split_predict(detector)
        if split is None:
            raise TypeError(f"{type(detector).__name__} has no graph inference: it is not one of mmdet's DETR-family "
                            "or MaskFormer detectors with their own predict()")
        self.detector = detector
        self.region, self.postprocess = split
        self.eager_predict = type(detector).predict.__get__(detector)
        self.max_graphs = max_graphs
        self.warmup_runs = warmup_runs
        self.graphs: "OrderedDict[tuple, _CapturedForward]" = OrderedDict()
        self.eager_signatures: Dict[tuple, str] = {}
        self.pool = None
        self.capture_stream: Optional[torch.cuda.Stream] = None

    @staticmethod
    def signature(batch_inputs: torch.Tensor, batch_data_samples) -> tuple:
        autocast = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
        shapes = tuple((tuple(s.metainfo.get("img_shape", ())), tuple(s.metainfo.get("batch_input_shape", ())))
                       for s in batch_data_samples)
        return tuple(batch_inputs.shape), batch_inputs.dtype, batch_inputs.device, shapes, autocast

    def predict(self, batch_inputs: torch.Tensor, batch_data_samples, rescale: bool = True):
        if not batch_inputs.is_cuda or self.detector.training or torch.is_grad_enabled():
            return self.eager_predict(batch_inputs, batch_data_samples, rescale=rescale)
        key = self.signature(batch_inputs, batch_data_samples)
        entry = self.graphs.get(key)
        if entry is None:
            if key in self.eager_signatures:
                return self.eager_predict(batch_inputs, batch_data_samples, rescale=rescale)
            entry = self._capture(key, batch_inputs, batch_data_samples)
            if entry is None:
                return self.eager_predict(batch_inputs, batch_data_samples, rescale=rescale)
        else:
            self.graphs.move_to_end(key)
        entry.static_input.copy_(batch_inputs)
        entry.graph.replay()
        # Clones, so that results never alias a buffer that the next replay overwrites.
        outs = torch.utils._pytree.tree_map(torch.clone, entry.static_outputs)
        return self.postprocess(self.detector, outs, batch_data_samples, rescale)

    def _fall_back(self, key, reason: str) -> None:
        self.eager_signatures[key] = reason
        print_log(f"deform_plugin: inference of input {key[0]} runs eagerly: {reason}", logger="current")

    def _capture(self, key, batch_inputs, batch_data_samples) -> Optional[_CapturedForward]:
        if len(self.graphs) >= self.max_graphs:
            dropped, _ = self.graphs.popitem(last=False)
            print_log(f"deform_plugin: dropped the inference graph of input {dropped[0]} (max_graphs="
                      f"{self.max_graphs})", logger="current")
        static_input = batch_inputs.clone()
        # One stream for every signature's warm-up and capture: the caching allocator reuses a freed block only on
        # the stream it was allocated on, so a stream per signature would strand each one's memory.
        if self.capture_stream is None:
            self.capture_stream = torch.cuda.Stream(device=batch_inputs.device)
        side = self.capture_stream
        side.wait_stream(torch.cuda.current_stream(batch_inputs.device))
        try:
            with torch.cuda.stream(side):
                for _ in range(self.warmup_runs):
                    self.region(self.detector, static_input, batch_data_samples)
            torch.cuda.current_stream(batch_inputs.device).wait_stream(side)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # One memory pool for every signature: only one graph's outputs are read at a time.
            with torch.cuda.graph(graph, pool=self.pool, stream=side):
                static_outputs = self.region(self.detector, static_input, batch_data_samples)
        except RuntimeError as error:
            torch.cuda.synchronize(batch_inputs.device)
            self._fall_back(key, f"its forward could not be captured ({str(error).splitlines()[0]})")
            return None
        entry = _CapturedForward(graph, static_input, static_outputs)
        self.graphs[key] = entry
        return entry


def enable_graph_inference(detector, max_graphs: int = 4, warmup_runs: int = 2) -> GraphInference:
    """Give ``detector`` (an instance) the graph-captured ``predict`` of :class:`GraphInference`; returns it."""
    graph_inference = GraphInference(detector, max_graphs=max_graphs, warmup_runs=warmup_runs)
    detector.predict = graph_inference.predict
    return graph_inference
