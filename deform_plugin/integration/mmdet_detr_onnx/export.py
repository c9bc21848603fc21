"""ONNX export of mmdet 3.3's DETR-family detectors: the detector built and checked, its input size checked, the
exported module of its family, and the traced file (the package's docstring describes the graph)."""
from __future__ import annotations

import logging
import math
import os
import warnings
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

# Exact classes: a subclass (DDQ-DETR is a DINO) may change the inference path, so it is not accepted silently.
SUPPORTED_DETECTORS = ("DeformableDETR", "DINO", "Mask2Former")
NOT_YET = {
    "DDQDETR": "it selects distinct queries with NMS (mmcv's batched_nms) before and between decoder layers",
    "GroundingDINO": "it takes text as a second input",
}
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
    if name == "Mask2Former":
        fusion = model.panoptic_fusion_head
        test_cfg = fusion.test_cfg or {}
        if fusion.num_stuff_classes or not test_cfg.get("instance_on", False):
            raise ExportError(f"{name} is exported with its instance-segmentation outputs only: this config has "
                              f"{fusion.num_stuff_classes} stuff classes and instance_on="
                              f"{test_cfg.get('instance_on', False)} (a panoptic or semantic config); use an instance "
                              "config such as configs/mask2former/mask2former_r50_8xb2-lsj-50e_coco_deform-plugin.py")
    elif not model.bbox_head.loss_cls.use_sigmoid:
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
    """The feature-map sizes the MSDA layers attend over (Mask2Former's pixel decoder: its coarsest few)."""
    with torch.no_grad():
        feats = model.extract_feat(torch.zeros(1, 3, height, width))
    shapes = [tuple(int(s) for s in f.shape[-2:]) for f in feats]
    pixel_decoder = getattr(getattr(model, "panoptic_head", None), "pixel_decoder", None)
    num_levels = getattr(pixel_decoder, "num_encoder_levels", None)
    return shapes[-num_levels:] if num_levels else shapes


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

class ExportModel(nn.Module):
    """What every exported family shares: the data preprocessor's channel flip and normalisation in the graph, the
    fixed size, the output names and shapes."""

    output_names: Tuple[str, ...] = OUTPUT_NAMES
    # How far (pixels) a box may move besides box_rtol when --verify compares ONNX Runtime with PyTorch.
    box_atol: float = 0.0

    def __init__(self, detector: nn.Module, height: int, width: int, max_per_img: int, num_candidates: int):
        super().__init__()
        from mmdet.structures import DetDataSample

        self.detector = detector
        self.height = height
        self.width = width
        preprocessor = detector.data_preprocessor
        self.flip_channels = bool(getattr(preprocessor, "_channel_conversion", False))
        self.normalize = bool(getattr(preprocessor, "_enable_normalize", False))
        self.max_per_img = max_per_img
        if max_per_img > num_candidates:
            raise ExportError(f"the test_cfg's {max_per_img} detections per image exceed num_queries x num_classes "
                              f"= {num_candidates}")
        # The head's metadata as a constant: img_shape = batch_input_shape = the traced size, no data samples in
        # the graph.
        self._samples = [DetDataSample(metainfo=dict(img_shape=(height, width), batch_input_shape=(height, width)))]

    def output_shapes(self) -> Tuple[Tuple[int, ...], ...]:
        k = self.max_per_img
        return (1, k, 4), (1, k), (1, k)

    def preprocess(self, image: torch.Tensor) -> torch.Tensor:
        x = image.float()
        if self.flip_channels:
            x = x[:, [2, 1, 0]]
        if self.normalize:
            x = (x - self.detector.data_preprocessor.mean) / self.detector.data_preprocessor.std
        return x


class DETRExportModel(ExportModel):
    """A Deformable-DETR or DINO from raw pixels to the top-k detections, for one fixed image size.

    Args:
        detector: a built DeformableDETR or DINO in eval mode (see :func:`check_exportable`).
        height, width: the image size the graph is traced for.
    """

    def __init__(self, detector: nn.Module, height: int, width: int):
        head = detector.bbox_head
        super().__init__(detector, height, width,
                         max_per_img=int((head.test_cfg or {}).get("max_per_img", detector.num_queries)),
                         num_candidates=detector.num_queries * head.num_classes)
        self.num_classes = head.num_classes
        self.num_queries = detector.num_queries

    def forward(self, image: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        detector = self.detector
        feats = detector.extract_feat(self.preprocess(image))
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


class Mask2FormerExportModel(ExportModel):
    """A Mask2Former instance-segmentation model from raw pixels to its top-k masks, boxes, scores and labels.

    The head's last decoder layer's class logits and mask logits, the masks upsampled to the input size (mmdet's
    ``MaskFormerHead.predict``; no crop or rescale: the input is the image), then mmdet's instance post-processing
    for configs without stuff classes (every query is a thing): softmax without the no-object class, top-k over
    queries x classes, the mask's mean sigmoid inside its binary mask times the class score, the mask's bounding box
    (:func:`~deform_plugin.integration.mmdet_fast_paths.sync_free_forward.mask_boxes`, equal to mmdet's
    ``mask2bbox``). Sorted by score.
    """

    output_names = OUTPUT_NAMES + ("masks",)
    # A box is its mask's: a boundary pixel whose logit is within rounding of 0 may flip and move it by one.
    box_atol = 1.0

    def __init__(self, detector: nn.Module, height: int, width: int):
        fusion = detector.panoptic_fusion_head
        num_queries = detector.panoptic_head.num_queries
        super().__init__(detector, height, width,
                         max_per_img=int((fusion.test_cfg or {}).get("max_per_image", 100)),
                         num_candidates=num_queries * fusion.num_classes)
        self.num_classes = fusion.num_classes

    def output_shapes(self) -> Tuple[Tuple[int, ...], ...]:
        return super().output_shapes() + ((1, self.max_per_img, self.height, self.width),)

    def forward(self, image: torch.Tensor):
        from ..mmdet_fast_paths.sync_free_forward import mask_boxes

        detector = self.detector
        feats = detector.extract_feat(self.preprocess(image))
        all_cls_scores, all_mask_preds = detector.panoptic_head(feats, self._samples)
        mask_logits = F.interpolate(all_mask_preds[-1], size=(self.height, self.width), mode="bilinear",
                                    align_corners=False)[0]
        scores = F.softmax(all_cls_scores[-1][0], dim=-1)[:, :-1]
        scores, index = scores.flatten().topk(self.max_per_img)
        labels = index % self.num_classes
        mask_logits = mask_logits[torch.div(index, self.num_classes, rounding_mode="floor")]
        binary = (mask_logits > 0).float()
        mask_scores = (mask_logits.sigmoid() * binary).flatten(1).sum(1) / (binary.flatten(1).sum(1) + 1e-6)
        # A top-k of all K rather than a sort: TensorRT's TopK needs a constant K, and a sort exports one sized at run
        # time.
        scores, order = (scores * mask_scores).topk(self.max_per_img)
        masks = binary.bool()[order]
        return mask_boxes(masks)[None], scores[None], labels[order][None], masks[None]


def export_model(detector: nn.Module, height: int, width: int) -> ExportModel:
    """The exported module of ``detector``'s family (after :func:`check_exportable`)."""
    family = Mask2FormerExportModel if type(detector).__name__ == "Mask2Former" else DETRExportModel
    return family(detector, height, width).eval()


def check_opset(opset: int) -> None:
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise ExportError(f"opset {opset} is not supported: GridSample needs {MIN_OPSET} or later, and the "
                          f"TorchScript exporter writes at most {MAX_OPSET}")


def export_detector(model: ExportModel, path: str, opset: int = DEFAULT_OPSET, seed: int = 0) -> List[str]:
    """Trace ``model`` with the TorchScript exporter into ``path``; check the file; return its operator types."""
    import onnx

    check_opset(opset)
    image = random_image(model.height, model.width, seed)
    with warnings.catch_warnings(), torch.no_grad():
        # The tracer warns at every tensor -> Python value conversion in mmdet's code: each is a size of the fixed
        # input, which the graph is specialised to on purpose.
        warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
        torch.onnx.export(model, (image,), path, dynamo=False, opset_version=opset, input_names=list(INPUT_NAMES),
                          output_names=list(model.output_names))
    graph = onnx.load(path)
    # The tracer leaves the outputs' sizes symbolic ("TopKscores_dim_0"); they are fixed, and runtimes that plan
    # memory ahead (TensorRT) prefer to read them from the file.
    for output, dims in zip(graph.graph.output, model.output_shapes()):
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
