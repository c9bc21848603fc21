"""ONNX export of mmdet 3.3's DETR-family detectors (Deformable-DETR plain/refine/two-stage, DINO, Mask2Former
instance segmentation) in :mod:`.export`, and its check in ONNX Runtime in :mod:`.check`.

The graph is one fixed-size image in, the family's top-k detections out:

    image  (1, 3, H, W) float32  raw pixel values (0-255) in the channel order mmdet's loading yields (BGR for the
                                 stock configs); the data preprocessor's channel flip and normalisation are in the
                                 graph. No padding: H and W must already be multiples of its ``pad_size_divisor``.
    boxes  (1, K, 4) float32     x1, y1, x2, y2 in input pixels, clamped to the image (no rescale to another size)
    scores (1, K)    float32     sigmoid class scores, descending
    labels (1, K)    int64       class indices

with K the head's ``test_cfg.max_per_img`` — the post-processing of mmdet's ``DETRHead._predict_by_feat_single``
(sigmoid, top-k over queries x classes, no NMS). Mask2Former (instance configs) adds

    masks  (1, K, H, W) bool     each detection's mask at the input size

with K its fusion head's ``test_cfg.max_per_image``: mmdet's ``MaskFormerFusionHead.instance_postprocess`` (softmax
without the no-object class, top-k over queries x classes, score times the mean sigmoid inside the mask, the box
around the mask), with the detections sorted by score (mmdet's top-k leaves them unsorted).

The graph is traced by the TorchScript exporter (``torch.onnx.export(..., dynamo=False)``) and is specialised to
H x W: mmdet 3.3's ``DeformableDETR.pre_transformer`` builds the level table with
``torch._shape_as_tensor(feat)[2:].to(device)``, which ``torch.export`` (the default exporter) rejects in both its
modes.

This module knows mmdet's private structure (``extract_feat``, ``forward_transformer``, the heads' branches); the
MSDA layers inside switch to standard ONNX operators by themselves while an export traces them
(:mod:`deform_plugin.ops.msda.export`).
"""
from .check import PROPOSAL_ATOL, VerifyReport, compare_detections, verify_onnx
from .export import (DEFAULT_OPSET, INPUT_NAMES, MAX_OPSET, MIN_OPSET, NOT_YET, OUTPUT_NAMES, SUPPORTED_DETECTORS,
                     DETRExportModel, ExportError, ExportModel, InputSizeReport, Mask2FormerExportModel,
                     build_detector, check_exportable, check_input_size, check_opset, export_detector, export_model,
                     random_image)

__all__ = ["DEFAULT_OPSET", "DETRExportModel", "ExportError", "ExportModel", "INPUT_NAMES", "InputSizeReport",
           "MAX_OPSET", "MIN_OPSET", "Mask2FormerExportModel", "NOT_YET", "OUTPUT_NAMES", "PROPOSAL_ATOL",
           "SUPPORTED_DETECTORS", "VerifyReport", "build_detector", "check_exportable", "check_input_size",
           "check_opset", "compare_detections", "export_detector", "export_model", "random_image", "verify_onnx"]
