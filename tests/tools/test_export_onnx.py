"""tools/export_onnx.py: detectors exported and verified in ONNX Runtime, and a one-line message for each bad request.

The demo detector and two stock families (Deformable-DETR two-stage and Mask2Former instance, random weights) at
128x128 run here, the families shrunk through the tool's --cfg-options (a ResNet-18, fewer encoder and decoder layers:
the same operators and outputs, a smaller graph to export and run); the other families are run by hand
(docs/deployment.md lists the commands and the numbers).
"""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

REPO_ROOT = Path(__file__).resolve().parents[2]
DEMO_CONFIG = REPO_ROOT / "configs" / "demo" / "deformable-detr-refine_r18_tiny_1xb4-500i_shapes.py"
TWO_STAGE_CONFIG = (REPO_ROOT / "configs" / "deformable_detr"
                    / "deformable-detr-refine-twostage_r50_16xb2-50e_coco_deform-plugin.py")
MASK2FORMER_CONFIG = REPO_ROOT / "configs" / "mask2former" / "mask2former_r50_8xb2-lsj-50e_coco_deform-plugin.py"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("deform_plugin_tools_export_onnx",
                                                  REPO_ROOT / "tools" / "export_onnx.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module", autouse=True)
def single_intra_op_thread():
    """One torch thread: on a small shared CPU two spinning OpenMP threads slow these small models down."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def graph_signature(path):
    model = onnx.load(str(path))
    onnx.checker.check_model(model)

    def dims(value):
        return [d.dim_value for d in value.type.tensor_type.shape.dim]

    return ({i.name: dims(i) for i in model.graph.input}, {o.name: dims(o) for o in model.graph.output},
            {node.domain for node in model.graph.node}, {node.op_type for node in model.graph.node})


def test_demo_detector_exports_and_verifies_on_an_image(tool, tmp_path, capsys):
    import cv2
    import numpy as np

    image = np.zeros((90, 150, 3), dtype=np.uint8)  # another size and aspect: the tool resizes it to 128x128
    cv2.rectangle(image, (20, 10), (70, 60), (0, 0, 255), -1)
    cv2.circle(image, (110, 45), 25, (255, 200, 0), -1)
    cv2.imwrite(str(tmp_path / "shapes.png"), image)
    out = tmp_path / "demo.onnx"
    status = tool.main([str(DEMO_CONFIG), "--out", str(out), "--shape", "128", "128", "--verify",
                        "--image", str(tmp_path / "shapes.png")])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "note: no checkpoint given" in printed
    assert "verify: PASSED" in printed
    inputs, outputs, domains, operators = graph_signature(out)
    assert inputs == {"image": [1, 3, 128, 128]}
    assert outputs == {"boxes": [1, 30, 4], "scores": [1, 30], "labels": [1, 30]}  # max_per_img=30
    assert domains <= {"", "ai.onnx"} and "GridSample" in operators


# --cfg-options that shrink each family: a ResNet-18 (its channels into the neck or the pixel decoder), two encoder
# layers, and two decoder layers (Mask2Former's transformer decoder: one round of three over its feature levels).
TWO_STAGE_SMALL = ["model.backbone.depth=18", "model.neck.in_channels=[128,256,512]", "model.encoder.num_layers=2",
                   "model.decoder.num_layers=2"]
MASK2FORMER_SMALL = ["model.backbone.depth=18", "model.panoptic_head.in_channels=[64,128,256,512]",
                     "model.panoptic_head.pixel_decoder.encoder.num_layers=2",
                     "model.panoptic_head.transformer_decoder.num_layers=3"]


def _export_and_verify_at_128(tool, config, out, capsys, cfg_options=()):
    """The tool's printout and the file's signature after ``--shape 128 128 --verify`` (which must pass)."""
    status = tool.main([str(config), "--out", str(out), "--shape", "128", "128", "--verify",
                        *(["--cfg-options", *cfg_options] if cfg_options else [])])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "verify: PASSED" in printed
    inputs, outputs, domains, operators = graph_signature(out)
    assert inputs == {"image": [1, 3, 128, 128]}
    assert domains <= {"", "ai.onnx"} and "GridSample" in operators
    return printed, outputs


def test_stock_two_stage_deformable_detr_exports_and_verifies(tool, tmp_path, capsys):
    printed, outputs = _export_and_verify_at_128(tool, TWO_STAGE_CONFIG, tmp_path / "two_stage.onnx", capsys,
                                                 TWO_STAGE_SMALL)
    assert "two-stage proposals" in printed
    assert outputs == {"boxes": [1, 100, 4], "scores": [1, 100], "labels": [1, 100]}


def test_mask2former_instance_segmentation_exports_and_verifies(tool, tmp_path, capsys):
    printed, outputs = _export_and_verify_at_128(tool, MASK2FORMER_CONFIG, tmp_path / "mask2former.onnx", capsys,
                                                 MASK2FORMER_SMALL)
    assert "masks:  smallest IoU" in printed
    # The pixel decoder's MSDA attends over the backbone's three coarsest maps (strides 8, 16, 32).
    assert "MSDA levels at this size: 16x16, 8x8, 4x4 (336 keys)" in printed
    assert outputs == {"boxes": [1, 100, 4], "scores": [1, 100], "labels": [1, 100], "masks": [1, 100, 128, 128]}


def test_mask_detections_are_compared_mask_by_mask():
    from deform_plugin.integration.mmdet_detr_onnx import compare_detections
    masks = torch.zeros(1, 2, 40, 40, dtype=torch.bool)
    masks[0, 0, 2:22, 3:23] = True
    masks[0, 1, 15:35, 15:35] = True
    boxes = torch.tensor([[[3.0, 2.0, 23.0, 22.0], [15.0, 15.0, 35.0, 35.0]]])
    expected = (boxes, torch.tensor([[0.9, 0.8]]), torch.tensor([[1, 4]]), masks)
    flipped = masks.clone()
    flipped[0, 0, 21, 3:23] = False  # the boundary row: IoU 380/400, the box moves by one pixel
    got = (boxes - torch.tensor([0.0, 0.0, 0.0, 1.0]), expected[1], expected[2], flipped)
    report = compare_detections(got, expected, box_atol=1.0)
    assert not report.passed and report.mask_min_iou == pytest.approx(0.95)  # under 0.99
    flipped[0, 0, 21, 3:23] = True
    flipped[0, 0, 21, 22] = False  # one boundary pixel: IoU 399/400
    report = compare_detections(got, expected, box_atol=1.0)
    assert report.passed and report.mask_min_iou == pytest.approx(399 / 400)
    flipped[0, 1, 15:25] = False  # half a mask
    report = compare_detections(got[:3] + (flipped,), expected, box_atol=1.0)
    assert not report.passed and report.mask_min_iou == pytest.approx(0.5)
    assert not compare_detections(got, expected).passed  # boxes without the pixel tolerance


def test_read_image_is_bgr_resized(tool, tmp_path):
    import cv2
    import numpy as np

    image = np.zeros((10, 20, 3), dtype=np.uint8)
    image[..., 2] = 200  # red in OpenCV's BGR order
    cv2.imwrite(str(tmp_path / "red.png"), image)
    tensor = tool.read_image(str(tmp_path / "red.png"), 8, 12)
    assert tensor.shape == (1, 3, 8, 12) and tensor.dtype == torch.float32
    assert tensor[0, 2].eq(200).all() and tensor[0, :2].eq(0).all()


def write_config(tmp_path, text):
    path = tmp_path / "config.py"
    path.write_text(text)
    return str(path)


SIZE = ["--shape", "128", "128"]
BAD_REQUESTS = {
    "missing-checkpoint": (lambda tmp: [str(DEMO_CONFIG), str(tmp / "nowhere.pth"), *SIZE],
                           "checkpoint '.*nowhere.pth' does not exist"),
    "missing-config": (lambda tmp: [str(tmp / "nowhere.py"), *SIZE], "config '.*nowhere.py' does not exist"),
    "config-is-a-folder": (lambda tmp: [str(tmp), *SIZE], "config '.*' is a folder, not a file"),
    "no-msda": (lambda tmp: [write_config(tmp, "_base_ = 'mmdet::faster_rcnn/faster-rcnn_r50_fpn_1x_coco.py'\n"),
                             *SIZE],
                "builds FasterRCNN, which has no MultiScaleDeformableAttention"),
    "unsupported-family": (lambda tmp: [str(REPO_ROOT / "configs" / "ddq"
                                            / "ddq-detr-4scale_r50_8xb2-12e_coco_deform-plugin.py"), *SIZE],
                           "DDQDETR is not a supported detector family .*NMS"),
    "too-small-for-two-stage": (lambda tmp: [str(TWO_STAGE_CONFIG), "--shape", "64", "64"],
                                r"64x64 is too small for DeformableDETR: .*num_queries=300 .*strides 8, 16, 32, 64\)"
                                r" give 8x8 \+ 4x4 \+ 2x2 \+ 1x1 = 85 keys; .*--shape 128 128"),
    "not-a-pad-multiple": (lambda tmp: [str(DEMO_CONFIG), "--shape", "100", "100", "--cfg-options",
                                        "model.data_preprocessor.pad_size_divisor=32"],
                           "100x100 is not a multiple of the data preprocessor's pad_size_divisor 32.*"
                           "--shape 128 128"),
    "panoptic-mask2former": (lambda tmp: [str(REPO_ROOT / "configs" / "mask2former"
                                              / "mask2former_r50_8xb2-lsj-50e_coco-panoptic_deform-plugin.py"), *SIZE],
                             "Mask2Former is exported with its instance-segmentation outputs only: this config has 53 "
                             "stuff classes"),
    "opset-without-gridsample": (lambda tmp: [str(DEMO_CONFIG), *SIZE, "--opset", "15"],
                                 "opset 15 is not supported"),
}


@pytest.mark.parametrize("request_args,message", list(BAD_REQUESTS.values()), ids=list(BAD_REQUESTS))
def test_bad_request_gets_one_line_message(tool, tmp_path, capsys, request_args, message):
    status = tool.main(request_args(tmp_path) + ["--out", str(tmp_path / "x.onnx")])
    captured = capsys.readouterr()
    assert status == 2
    assert "Traceback" not in captured.err
    errors = [line for line in captured.err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, captured.err
    assert re.search(message, errors[0]), errors[0]
    assert not (tmp_path / "x.onnx").exists()
