"""ONNX export of mmdet 3.3's DETR-family detectors (Deformable-DETR plain/refine/two-stage, DINO), and its check.

The graph is one fixed-size image in, the DETR family's top-k detections out:

    image  (1, 3, H, W) float32  raw pixel values (0-255) in the channel order mmdet's loading yields (BGR for the
                                 stock configs); the data preprocessor's channel flip and normalisation are in the
                                 graph. No padding: H and W must already be multiples of its ``pad_size_divisor``.
    boxes  (1, K, 4) float32     x1, y1, x2, y2 in input pixels, clamped to the image (no rescale to another size)
    scores (1, K)    float32     sigmoid class scores, descending
    labels (1, K)    int64       class indices

with K the head's ``test_cfg.max_per_img`` — the post-processing of mmdet's ``DETRHead._predict_by_feat_single``
(sigmoid, top-k over queries x classes, no NMS). The graph is traced by the TorchScript exporter
(``torch.onnx.export(..., dynamo=False)``) and is specialised to H x W: mmdet 3.3's ``DeformableDETR.pre_transformer``
builds the level table with ``torch._shape_as_tensor(feat)[2:].to(device)``, which ``torch.export`` (the default
exporter) rejects in both its modes.

This module knows mmdet's private structure (``extract_feat``, ``forward_transformer``, the head's branches); the
MSDA layers inside switch to standard ONNX operators by themselves while an export traces them
(:mod:`deform_plugin.ops.msda.export`).
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

# Exact classes: a subclass (DDQ-DETR is a DINO) may change the inference path, so it is not accepted silently.
SUPPORTED_DETECTORS = ("DeformableDETR", "DINO")
NOT_YET = {
    "DDQDETR": "it selects distinct queries with NMS (mmcv's batched_nms) before and between decoder layers",
    "Mask2Former": "its outputs are masks from a pixel decoder and MaskFormerFusionHead, not the DETR box top-k",
    "GroundingDINO": "it takes text as a second input",
}
# Encoder logits of the proposals ONNX Runtime picks may differ from PyTorch's top-k by float32 rounding only.
PROPOSAL_ATOL = 1e-3
INPUT_NAMES = ("image",)
OUTPUT_NAMES = ("boxes", "scores", "labels")
# GridSample needs 16; 17 also has LayerNormalization as one operator; 20 is the TorchScript exporter's newest.
DEFAULT_OPSET = 17
MIN_OPSET, MAX_OPSET = 16, 20


class ExportError(Exception):
    """A request the exporter cannot honour (config, checkpoint, image size); the message says what to change."""


# ---- building the model -------------------------------------------------------------------------------------------

def _drop_pretrained_init(node) -> None:
    if isinstance(node, dict):
        init_cfg = node.get("init_cfg")
        if isinstance(init_cfg, dict) and init_cfg.get("type") == "Pretrained":
            node["init_cfg"] = None
        for value in node.values():
            _drop_pretrained_init(value)
    elif isinstance(node, (list, tuple)):
        for value in node:
            _drop_pretrained_init(value)


def build_detector(config: str, checkpoint: Optional[str] = None, cfg_options: Optional[dict] = None,
                   seed: int = 0) -> nn.Module:
    """The detector on CPU in eval mode, as mmdet's ``init_detector`` builds it.

    Without a checkpoint the weights are random, drawn after ``torch.manual_seed(seed)``: every ``Pretrained``
    init_cfg is dropped (no downloads) and ``init_weights()`` runs, so that no parameter is left uninitialised
    (``DeformableDETR.level_embed`` is ``torch.empty`` until then).
    """
    from mmdet.registry import MODELS
    from mmengine.config import Config
    from mmengine.logging import MMLogger
    from mmengine.model.utils import revert_sync_batchnorm
    from mmengine.registry import init_default_scope
    from mmengine.runner import load_checkpoint

    if not os.path.isfile(config):
        raise ExportError(f"config file not found: {config}")
    is_url = checkpoint is not None and checkpoint.startswith(("http://", "https://"))
    if checkpoint is not None and not is_url and not os.path.isfile(checkpoint):
        raise ExportError(f"checkpoint file not found: {checkpoint}")
    try:
        cfg = Config.fromfile(config)
    except Exception as error:  # a syntax error or a missing base config: one line, not mmengine's stack
        raise ExportError(f"cannot read config {config}: {type(error).__name__}: {error}") from None
    if cfg_options:
        cfg.merge_from_dict(cfg_options)
    if "model" not in cfg:
        raise ExportError(f"{config} defines no model")
    if checkpoint is None:
        _drop_pretrained_init(cfg.model)
    elif "init_cfg" in cfg.model.get("backbone", {}):
        cfg.model.backbone.init_cfg = None  # the checkpoint has the backbone: as init_detector does
    init_default_scope(cfg.get("default_scope", "mmdet"))
    if checkpoint is None:
        torch.manual_seed(seed)
    try:
        model = revert_sync_batchnorm(MODELS.build(cfg.model))
    except Exception as error:  # e.g. a type no registry knows
        raise ExportError(f"cannot build the model of {config}: {type(error).__name__}: {error}") from None
    logger = MMLogger.get_current_instance()
    level = logger.level
    logger.setLevel(logging.WARNING)  # init_weights logs every parameter at INFO
    try:
        if checkpoint is None:
            model.init_weights()
        else:
            try:
                load_checkpoint(model, checkpoint, map_location="cpu", logger=logger)
            except Exception as error:  # a corrupt or foreign file: say which, not where in torch.load it failed
                raise ExportError(f"cannot load checkpoint {checkpoint}: {type(error).__name__}: {error}") from None
    finally:
        logger.setLevel(level)
    return model.eval()


def check_exportable(model: nn.Module) -> None:
    """Raise :class:`ExportError` unless ``model`` is a supported DETR-family detector running our MSDA."""
    from deform_plugin.models.msda import MultiScaleDeformableAttention

    name = type(model).__name__
    if not any(isinstance(m, MultiScaleDeformableAttention) for m in model.modules()):
        raise ExportError(f"the config builds {name}, which has no MultiScaleDeformableAttention: this tool exports "
                          f"deform_plugin's DETR-family detectors ({', '.join(SUPPORTED_DETECTORS)})")
    if name not in SUPPORTED_DETECTORS:
        why = f" ({NOT_YET[name]})" if name in NOT_YET else ""
        raise ExportError(f"{name} is not a supported detector family{why}; supported: "
                          f"{', '.join(SUPPORTED_DETECTORS)} (Deformable-DETR plain, refine and two-stage)")
    if not model.bbox_head.loss_cls.use_sigmoid:
        raise ExportError(f"{name}'s head scores with a softmax; the exported post-processing is the sigmoid top-k "
                          "of the DETR family's focal-loss heads")


# ---- input size ---------------------------------------------------------------------------------------------------

@dataclass
class InputSizeReport:
    """What the backbone and neck make of an H x W image."""

    level_shapes: List[Tuple[int, int]]
    strides: List[int]

    @property
    def num_keys(self) -> int:
        return sum(h * w for h, w in self.level_shapes)


def _level_shapes(model: nn.Module, height: int, width: int) -> List[Tuple[int, int]]:
    with torch.no_grad():
        feats = model.extract_feat(torch.zeros(1, 3, height, width))
    return [tuple(int(s) for s in f.shape[-2:]) for f in feats]


def check_input_size(model: nn.Module, height: int, width: int) -> InputSizeReport:
    """Raise :class:`ExportError` if the exported graph could not take an H x W image; else its level sizes.

    Constraints: H and W positive multiples of the data preprocessor's ``pad_size_divisor`` (the graph does not
    pad); the backbone accepts the size; two-stage detectors (DINO, Deformable-DETR two-stage) pick their
    ``num_queries`` proposals by top-k over the encoder's keys, so the levels must hold at least that many.
    """
    if height < 1 or width < 1:
        raise ExportError(f"the image size must be positive, got {height}x{width}")
    divisor = int(getattr(model.data_preprocessor, "pad_size_divisor", 1))
    if height % divisor or width % divisor:
        up = (math.ceil(height / divisor) * divisor, math.ceil(width / divisor) * divisor)
        raise ExportError(f"{height}x{width} is not a multiple of the data preprocessor's pad_size_divisor "
                          f"{divisor}; mmdet would pad it, the exported graph does not: use --shape {up[0]} {up[1]}")
    try:
        shapes = _level_shapes(model, height, width)
    except Exception as error:
        raise ExportError(f"the backbone cannot take a {height}x{width} image: {type(error).__name__}: "
                          f"{error}") from None
    report = InputSizeReport(shapes, [round(height / h) for h, _ in shapes])
    num_queries = getattr(model, "num_queries", 0)
    if getattr(model, "as_two_stage", False) and report.num_keys < num_queries:
        levels = " + ".join(f"{h}x{w}" for h, w in shapes)
        side = _smallest_square_side(model, num_queries, divisor, start=max(height, width))
        raise ExportError(
            f"{height}x{width} is too small for {type(model).__name__}: its two-stage encoder picks num_queries="
            f"{num_queries} proposals by top-k over the feature-map keys, but the backbone and neck (strides "
            f"{', '.join(map(str, report.strides))}) give {levels} = {report.num_keys} keys; "
            f"a size of at least {side}x{side} gives enough (e.g. --shape {side} {side})")
    return report


def _smallest_square_side(model: nn.Module, num_queries: int, divisor: int, start: int) -> int:
    step = max(32, divisor)
    side = math.ceil(start / step) * step
    while sum(h * w for h, w in _level_shapes(model, side, side)) < num_queries:
        side += step
    return side


# ---- the exported module ------------------------------------------------------------------------------------------

class DETRExportModel(nn.Module):
    """The detector from raw pixels to the top-k detections, for one fixed image size.

    Args:
        detector: a built DeformableDETR or DINO in eval mode (see :func:`check_exportable`).
        height, width: the image size the graph is traced for.
    """

    def __init__(self, detector: nn.Module, height: int, width: int):
        super().__init__()
        from mmdet.structures import DetDataSample

        self.detector = detector
        self.height = height
        self.width = width
        preprocessor = detector.data_preprocessor
        self.flip_channels = bool(getattr(preprocessor, "_channel_conversion", False))
        self.normalize = bool(getattr(preprocessor, "_enable_normalize", False))
        head = detector.bbox_head
        self.num_classes = head.num_classes
        self.num_queries = detector.num_queries
        self.max_per_img = int((head.test_cfg or {}).get("max_per_img", self.num_queries))
        if self.max_per_img > self.num_queries * self.num_classes:
            raise ExportError(f"test_cfg.max_per_img={self.max_per_img} exceeds num_queries x num_classes = "
                              f"{self.num_queries * self.num_classes}")
        # The head's metadata as a constant: img_shape = batch_input_shape = the traced size, no data samples in
        # the graph.
        self._samples = [DetDataSample(metainfo=dict(img_shape=(height, width), batch_input_shape=(height, width)))]

    def forward(self, image: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        detector = self.detector
        x = image.float()
        if self.flip_channels:
            x = x[:, [2, 1, 0]]
        if self.normalize:
            x = (x - detector.data_preprocessor.mean) / detector.data_preprocessor.std
        feats = detector.extract_feat(x)
        head_inputs = detector.forward_transformer(feats, self._samples)
        all_scores, all_boxes = detector.bbox_head(**head_inputs)
        return self.top_k(all_scores[-1], all_boxes[-1])

    def top_k(self, cls_logits: torch.Tensor, boxes_cxcywh: torch.Tensor
              ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """mmdet's sigmoid top-k over queries x classes, batched: ``(B, Q, C)``, ``(B, Q, 4)`` -> boxes, scores,
        labels."""
        scores, index = cls_logits.sigmoid().flatten(1).topk(self.max_per_img, dim=1)
        labels = index % self.num_classes
        query = torch.div(index, self.num_classes, rounding_mode="floor")
        boxes = torch.gather(boxes_cxcywh, 1, query[..., None].expand(-1, -1, 4))
        centre, size = boxes[..., :2], boxes[..., 2:]
        boxes = torch.cat([centre - 0.5 * size, centre + 0.5 * size], dim=-1)
        scale = boxes.new_tensor([self.width, self.height, self.width, self.height])
        boxes = torch.minimum((boxes * scale).clamp(min=0), scale)
        return boxes, scores, labels


def check_opset(opset: int) -> None:
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise ExportError(f"opset {opset} is not supported: GridSample needs {MIN_OPSET} or later, and the "
                          f"TorchScript exporter writes at most {MAX_OPSET}")


def export_detector(model: DETRExportModel, path: str, opset: int = DEFAULT_OPSET, seed: int = 0) -> List[str]:
    """Trace ``model`` with the TorchScript exporter into ``path``; check the file; return its operator types."""
    import onnx

    check_opset(opset)
    image = random_image(model.height, model.width, seed)
    with warnings.catch_warnings(), torch.no_grad():
        # The tracer warns at every tensor -> Python value conversion in mmdet's code: each is a size of the fixed
        # input, which the graph is specialised to on purpose.
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        torch.onnx.export(model, (image,), path, dynamo=False, opset_version=opset, input_names=list(INPUT_NAMES),
                          output_names=list(OUTPUT_NAMES))
    graph = onnx.load(path)
    # The tracer leaves the outputs' sizes symbolic ("TopKscores_dim_0"); they are fixed, and runtimes that plan
    # memory ahead (TensorRT) prefer to read them from the file.
    k = model.max_per_img
    for output, dims in zip(graph.graph.output, ((1, k, 4), (1, k), (1, k))):
        for dim, size in zip(output.type.tensor_type.shape.dim, dims):
            dim.Clear()
            dim.dim_value = size
    onnx.checker.check_model(graph)
    onnx.save(graph, path)
    return sorted({node.op_type for node in graph.graph.node})


def random_image(height: int, width: int, seed: int = 0) -> torch.Tensor:
    """``(1, 3, H, W)`` float32 pixel values in [0, 255]."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (1, 3, height, width), generator=generator).float()


# ---- verification in ONNX Runtime ---------------------------------------------------------------------------------

@dataclass
class VerifyReport:
    """ONNX Runtime against PyTorch on one image.

    Ranks are compared one to one; where ONNX Runtime's k-th detection differs from PyTorch's, it still counts as
    matched if PyTorch has the same (label, box) at a rank whose score is within ``score_atol`` (two near-equal
    scores may swap places under float32 rounding).

    Two-stage detectors rank the encoder's proposals by top-k first, and DINO pairs the i-th proposal with the i-th
    learned query, so two near-equal encoder scores that swap places change the detections. With random weights such
    near-ties are everywhere. PyTorch therefore runs with ONNX Runtime's proposal order, after checking that this
    order is a valid top-k of PyTorch's own scores (``proposal_score_max_abs``).
    """

    score_max_abs: float
    box_max_abs: float
    box_max_rel: float
    swapped_near_ties: int
    unmatched_ranks: List[int] = field(default_factory=list)
    box_rtol: float = 1e-3
    score_atol: float = 1e-4
    # Two-stage only: how many of the num_queries proposal positions ONNX Runtime ordered differently, and the largest
    # difference between PyTorch's encoder scores of ONNX Runtime's picks and PyTorch's own top-k (sorted).
    proposals_reordered: Optional[int] = None
    proposal_score_max_abs: Optional[float] = None
    proposal_atol: float = PROPOSAL_ATOL

    @property
    def passed(self) -> bool:
        # Matched ranks are within box_rtol by construction.
        proposals_ok = self.proposal_score_max_abs is None or self.proposal_score_max_abs <= self.proposal_atol
        return not self.unmatched_ranks and self.score_max_abs <= self.score_atol and proposals_ok

    def lines(self) -> List[str]:
        lines = [
            f"scores: max abs error {self.score_max_abs:.3g} (limit {self.score_atol:g})",
            f"boxes:  max abs error {self.box_max_abs:.3g} px, max relative error {self.box_max_rel:.3g} "
            f"(limit {self.box_rtol:g}, relative to max(|coordinate|, 1 px)) over matched ranks",
            f"labels: {len(self.unmatched_ranks)} unmatched ranks"
            + (f" {self.unmatched_ranks[:10]}" if self.unmatched_ranks else "")
            + f", {self.swapped_near_ties} near-tie swaps",
        ]
        if self.proposals_reordered is not None:
            lines.append(f"two-stage proposals: ONNX Runtime's top-k is PyTorch's within "
                         f"{self.proposal_score_max_abs:.3g} (limit {self.proposal_atol:g}, encoder logits); "
                         f"{self.proposals_reordered} positions "
                         "ordered differently among near-equal scores (PyTorch reran with ONNX Runtime's order)")
        return lines


def _box_rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return ((a - b).abs() / b.abs().clamp(min=1.0)).amax(-1)


def compare_detections(got: Sequence[torch.Tensor], expected: Sequence[torch.Tensor], box_rtol: float = 1e-3,
                       score_atol: float = 1e-4) -> VerifyReport:
    """Compare ``(boxes, scores, labels)`` of one image (batch 1) as :class:`VerifyReport` describes."""
    boxes, scores, labels = (t[0] for t in got)
    exp_boxes, exp_scores, exp_labels = (t[0] for t in expected)
    score_err = float((scores - exp_scores).abs().max())
    unmatched, swaps, box_abs, box_rel = [], 0, 0.0, 0.0
    for rank in range(len(scores)):
        if labels[rank] == exp_labels[rank]:
            rel = float(_box_rel(boxes[rank], exp_boxes[rank]))
            if rel <= box_rtol:
                box_abs = max(box_abs, float((boxes[rank] - exp_boxes[rank]).abs().max()))
                box_rel = max(box_rel, rel)
                continue
        candidates = (((exp_scores - scores[rank]).abs() <= score_atol) & (exp_labels == labels[rank])).nonzero()
        rel = float(_box_rel(boxes[rank][None], exp_boxes[candidates.flatten()]).min()) if len(candidates) else None
        if rel is not None and rel <= box_rtol:
            swaps += 1
            box_rel = max(box_rel, rel)
        else:
            unmatched.append(rank)
    return VerifyReport(score_err, box_abs, box_rel, swaps, unmatched, box_rtol, score_atol)


def _with_proposal_indices_output(graph) -> Optional[str]:
    """Expose the proposal top-k's indices as an extra graph output; return its name (None: no such top-k).

    The proposal top-k comes first in the graph's (topological) node order, the detections' top-k last.
    """
    import onnx

    topks = [node for node in graph.graph.node if node.op_type == "TopK"]
    if len(topks) < 2:
        return None
    name = topks[0].output[1]
    graph.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.INT64, None))
    return name


@contextlib.contextmanager
def _proposals_in_order(num_queries: int, indices: torch.Tensor, seen: list):
    """Make mmdet's proposal top-k (``torch.topk(scores (B, S), num_queries)`` in ``pre_decoder`` of DeformableDETR
    and DINO, mmdet 3.3) return ``indices``; record the scores and PyTorch's own top-k values in ``seen``."""
    original = torch.topk

    def topk(input, k, *args, **kwargs):
        values, own = original(input, k, *args, **kwargs)
        if k != num_queries or input.dim() != 2 or seen:
            return values, own
        seen.append((input, values))
        return torch.return_types.topk((input.gather(1, indices), indices))

    torch.topk = topk
    try:
        yield
    finally:
        torch.topk = original


def verify_onnx(path: str, model: DETRExportModel, image: Optional[torch.Tensor] = None, seed: int = 0,
                box_rtol: float = 1e-3, score_atol: float = 1e-4) -> VerifyReport:
    """Run ``path`` in ONNX Runtime (CPU) and ``model`` in PyTorch on ``image`` (random if None) and compare."""
    try:
        import onnx
        import onnxruntime
    except ImportError:
        raise ExportError("--verify needs onnx and onnxruntime: pip install onnx onnxruntime") from None
    if image is None:
        image = random_image(model.height, model.width, seed)
    detector = model.detector
    graph = onnx.load(path)
    proposals = _with_proposal_indices_output(graph) if getattr(detector, "as_two_stage", False) else None
    session = onnxruntime.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
    del graph
    outputs = list(OUTPUT_NAMES) + ([proposals] if proposals else [])
    got = [torch.from_numpy(t) for t in session.run(outputs, {INPUT_NAMES[0]: image.numpy()})]
    if proposals and tuple(got[3].shape) != (1, detector.num_queries):
        raise RuntimeError(f"the graph's first TopK gives {tuple(got[3].shape)} indices, not the (1, "
                           f"{detector.num_queries}) proposals of mmdet 3.3's pre_decoder")
    seen: list = []
    order = _proposals_in_order(detector.num_queries, got[3], seen) if proposals else contextlib.nullcontext()
    with order, torch.no_grad():
        expected = model(image)
    report = compare_detections(got[:3], expected, box_rtol, score_atol)
    if proposals:
        if not seen:
            raise RuntimeError("the proposal top-k of the PyTorch model was not found (not mmdet 3.3's pre_decoder?)")
        scores, own_values = seen[0]
        picked = scores.gather(1, got[3]).sort(dim=1, descending=True).values
        report.proposal_score_max_abs = float((picked - own_values).abs().max())
        report.proposals_reordered = int((got[3] != scores.topk(detector.num_queries, dim=1).indices).sum())
    return report
