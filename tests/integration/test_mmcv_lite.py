"""mmcv-lite support: the stand-in ``mmcv._ext`` and the ops it serves."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import deform_plugin  # noqa: F401
from deform_plugin.integration.mmcv_lite import compiled_mmcv_ops_available, standin_installed

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not standin_installed(),
                                reason="mmcv with compiled ops is installed: the stand-in is not used")


def test_fresh_process_imports_mmdet_with_mmcv_lite():
    code = ("import importlib.util, sys; import deform_plugin; "
            "import mmdet.models, mmdet.datasets, mmdet.evaluation, mmdet.engine, mmdet.apis; "
            "spec = importlib.util.find_spec('mmcv._ext'); "
            "assert spec is not None and spec.origin == 'deform_plugin stand-in', spec; print('ok')")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-2000:]


def test_standin_is_marked_and_not_reported_as_compiled():
    assert importlib.util.find_spec("mmcv._ext").origin == "deform_plugin stand-in"
    assert not compiled_mmcv_ops_available()


def test_unserved_op_names_itself_and_how_to_get_it():
    from mmcv.ops import RoIAlign
    roi_align = RoIAlign((2, 2), spatial_scale=1.0, sampling_ratio=1)
    with pytest.raises(NotImplementedError, match=r"mmcv op 'roi_align_forward'.*install mmcv with its ops"):
        roi_align(torch.randn(1, 2, 8, 8), torch.tensor([[0.0, 0.0, 0.0, 4.0, 4.0]]))


@pytest.mark.parametrize("gamma,alpha", [(2.0, 0.25), (1.5, 0.5)])
def test_sigmoid_focal_loss_matches_mmdet_python_version(gamma, alpha):
    from mmcv.ops import sigmoid_focal_loss
    from mmdet.models.losses.focal_loss import py_sigmoid_focal_loss
    generator = torch.Generator().manual_seed(0)
    num_classes = 5
    logits = (3 * torch.randn(40, num_classes, generator=generator, dtype=torch.float64)).requires_grad_()
    labels = torch.randint(0, num_classes + 1, (40,), generator=generator)  # num_classes = background
    one_hot = torch.nn.functional.one_hot(labels, num_classes + 1)[:, :num_classes].double()
    ours = sigmoid_focal_loss(logits, labels, gamma, alpha, None, "none")
    expected_logits = logits.detach().clone().requires_grad_()
    expected = py_sigmoid_focal_loss(expected_logits, one_hot, gamma=gamma, alpha=alpha, reduction="none")
    torch.testing.assert_close(ours, expected)
    grad = torch.randn_like(ours)
    ours.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(logits.grad, expected_logits.grad)


def test_focal_loss_as_mmdet_calls_it_for_cuda_tensors():
    # mmdet's FocalLoss takes mmcv's compiled path for CUDA tensors; here the same wrapper runs on the CPU.
    from mmdet.models.losses.focal_loss import py_sigmoid_focal_loss, sigmoid_focal_loss
    logits = torch.randn(30, 4, dtype=torch.float64)
    labels = torch.randint(0, 5, (30,))
    weight = torch.rand(30, dtype=torch.float64)
    one_hot = torch.nn.functional.one_hot(labels, 5)[:, :4].double()
    torch.testing.assert_close(sigmoid_focal_loss(logits, labels, weight, avg_factor=7.0),
                               py_sigmoid_focal_loss(logits, one_hot, weight, avg_factor=7.0))


def test_nms_keeps_the_right_boxes():
    from mmcv.ops import nms
    boxes = torch.tensor([[0, 0, 10, 10], [1, 1, 11, 11], [20, 20, 30, 30], [0, 0, 10, 9], [21, 21, 29, 29.]])
    scores = torch.tensor([0.9, 0.8, 0.7, 0.95, 0.1])
    dets, keep = nms(boxes, scores, iou_threshold=0.5)
    # Box 3 (0.95) suppresses 0 (IoU 0.9) and 1 (IoU 0.66); box 2 suppresses 4 (IoU 0.64).
    assert keep.tolist() == [3, 2]
    torch.testing.assert_close(dets[:, 4], torch.tensor([0.95, 0.7]))


def greedy_nms_reference(boxes, scores, iou_threshold, offset):
    """mmcv's CPU kernel read literally: one pair at a time in float32 (numpy scalars), in its operation order."""
    import numpy as np
    f32 = np.float32
    order = scores.sort(0, descending=True)[1].tolist()  # the kernel's own call: ties fall as it orders them
    coords = boxes.float().numpy()
    zero, off, threshold = f32(0), f32(offset), f32(iou_threshold)
    area = [(x2 - x1 + off) * (y2 - y1 + off) for x1, y1, x2, y2 in coords]
    suppressed, keep = set(), []
    with np.errstate(divide="ignore", invalid="ignore"):
        for rank, i in enumerate(order):
            if i in suppressed:
                continue
            keep.append(i)
            ix1, iy1, ix2, iy2 = coords[i]
            for j in order[rank + 1:]:
                if j in suppressed:
                    continue
                jx1, jy1, jx2, jy2 = coords[j]
                # Python's max/min pick like std::max/std::min (first argument unless the second is larger/smaller).
                w = max(zero, min(ix2, jx2) - max(ix1, jx1) + off)
                h = max(zero, min(iy2, jy2) - max(iy1, jy1) + off)
                inter = w * h
                if inter / (area[i] + area[j] - inter) > threshold:
                    suppressed.add(j)
    return keep


def random_boxes(count, generator, spread=400.0, size=(5.0, 120.0), centres=None):
    if centres is None:
        xy = torch.rand(count, 2, generator=generator) * spread
    else:  # crowds: every box jittered around one of a few centres
        pick = torch.randint(len(centres), (count,), generator=generator)
        xy = torch.tensor(centres, dtype=torch.float32)[pick] + 6 * torch.randn(count, 2, generator=generator)
    wh = size[0] + torch.rand(count, 2, generator=generator) * (size[1] - size[0])
    return torch.cat([xy, xy + wh], 1)


NMS_CASES = {
    # name: (boxes, scores) builders; counts above the stand-in's block of 256 cross blocks.
    "random-ties": lambda g: (random_boxes(300, g), (torch.rand(300, generator=g) * 8).floor() / 8),
    "crowds": lambda g: (random_boxes(700, g, centres=[(50, 50), (60, 55), (200, 120), (300, 300)]),
                         torch.rand(700, generator=g)),
    "all-equal-scores": lambda g: (random_boxes(400, g), torch.full((400,), 0.5)),
    "disjoint": lambda g: (torch.tensor([[float(3 * i), 0.0, 3 * i + 2.0, 2.0] for i in range(520)]),
                           torch.rand(520, generator=g)),
}


@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("iou_threshold", [0.3, 0.5, 0.7])
@pytest.mark.parametrize("case", NMS_CASES.values(), ids=NMS_CASES.keys())
def test_nms_matches_greedy_brute_force(case, iou_threshold, offset):
    from deform_plugin.integration.mmcv_lite import nms
    boxes, scores = case(torch.Generator().manual_seed(0))
    expected = greedy_nms_reference(boxes, scores, iou_threshold, offset)
    keep = nms(boxes, scores, iou_threshold, offset)
    assert keep.dtype == torch.long
    assert keep.tolist() == expected
    if offset == 0 and iou_threshold == 0.5:
        assert 1 < len(expected) < len(boxes) or NMS_CASES["disjoint"] is case


@pytest.mark.parametrize("iou_threshold", [0.0, -0.1], ids=["zero", "negative"])
def test_nms_thresholds_at_and_below_zero(iou_threshold):
    # At 0 any overlap suppresses; below 0 even disjoint boxes do (IoU 0 > threshold), so nothing can be pruned.
    from deform_plugin.integration.mmcv_lite import nms
    boxes, scores = NMS_CASES["random-ties"](torch.Generator().manual_seed(3))
    # Zero-area boxes first: against each other union 0 and IoU NaN (never suppressed), against others IoU 0.
    boxes[::7, 2:] = boxes[::7, :2]
    scores[::7] += 1
    expected = greedy_nms_reference(boxes, scores, iou_threshold, 0)
    assert nms(boxes, scores, iou_threshold).tolist() == expected
    assert len(expected) > 1


def test_nms_edges_of_the_iou_rule():
    from deform_plugin.integration.mmcv_lite import nms
    # IoU exactly 0.5 does not suppress (strict >); 0.5 + one float32 ulp does.
    half = torch.tensor([[0.0, 0.0, 2.0, 1.0], [0.0, 0.0, 1.0, 1.0]])
    assert nms(half, torch.tensor([0.9, 0.8]), 0.5).tolist() == [0, 1]
    assert nms(half, torch.tensor([0.9, 0.8]), 0.4999).tolist() == [0]
    # offset=1 counts pixels: a point box has area 1, and two touching boxes overlap by one pixel column.
    points = torch.tensor([[5.0, 5.0, 5.0, 5.0], [5.0, 5.0, 5.0, 5.0], [6.0, 5.0, 6.0, 5.0]])
    scores = torch.tensor([0.3, 0.2, 0.1])
    assert nms(points, scores, 0.5, offset=1).tolist() == [0, 2]
    # Zero-area boxes: union 0, IoU NaN, nothing suppressed (as in the kernel).
    assert nms(points, scores, 0.5, offset=0).tolist() == [0, 1, 2]
    assert nms(points, scores, 0.5, offset=0).tolist() == greedy_nms_reference(points, scores, 0.5, 0)


def test_nms_empty_input_and_index_dtype():
    from deform_plugin.integration.mmcv_lite import nms
    keep = nms(torch.zeros(0, 4), torch.zeros(0), 0.5)
    assert keep.dtype == torch.long and keep.shape == (0,)
    # float64 boxes are computed in float32, as the kernel reads them.
    boxes, scores = NMS_CASES["random-ties"](torch.Generator().manual_seed(1))
    assert nms(boxes.double(), scores, 0.5).tolist() == nms(boxes, scores, 0.5).tolist()


def test_nms_through_mmcv_wrappers():
    from mmcv.ops import batched_nms, nms
    generator = torch.Generator().manual_seed(2)
    boxes, scores = NMS_CASES["crowds"](generator)
    dets, keep = nms(boxes, scores, iou_threshold=0.6, score_threshold=0.2, max_num=50)
    valid = torch.nonzero(scores > 0.2).squeeze(1)
    expected = valid[greedy_nms_reference(boxes[valid], scores[valid], 0.6, 0)][:50]
    assert keep.tolist() == expected.tolist()
    torch.testing.assert_close(dets[:, 4], scores[expected])
    labels = torch.randint(3, (len(boxes),), generator=generator)
    _, keep = batched_nms(boxes, scores, labels, dict(type="nms", iou_threshold=0.5))
    kept = set()
    for label in range(3):
        members = torch.nonzero(labels == label).squeeze(1)
        kept.update(members[greedy_nms_reference(boxes[members], scores[members], 0.5, 0)].tolist())
    assert set(keep.tolist()) == kept


def test_mmcv_msda_function_runs_through_the_standin():
    from mmcv.ops.multi_scale_deform_attn import MultiScaleDeformableAttnFunction, multi_scale_deformable_attn_pytorch
    shapes = torch.tensor([[5, 6], [2, 3]])
    starts = torch.tensor([0, 30])
    value = torch.randn(3, 36, 2, 4, dtype=torch.float64, requires_grad=True)
    locations = torch.rand(3, 7, 2, 2, 3, 2, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(3, 7, 2, 2, 3, dtype=torch.float64, requires_grad=True)
    out = MultiScaleDeformableAttnFunction.apply(value, shapes, starts, locations, weights, 1)
    expected = multi_scale_deformable_attn_pytorch(value, shapes, locations, weights)
    torch.testing.assert_close(out, expected)
    grads = torch.autograd.grad(out.sum(), (value, locations, weights))
    expected_grads = torch.autograd.grad(expected.sum(), (value, locations, weights))
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want)


def test_mmcv_imported_before_the_plugin_still_gives_mmdet_its_msda():
    # mmcv's transformer module imported first (as `from mmcv.cnn.bricks.transformer import ...` in user code does)
    # misses MultiScaleDeformableAttention; importing deform_plugin afterwards must repair it for mmdet.
    code = ("import warnings; warnings.simplefilter('ignore'); "
            "from mmcv.cnn.bricks.transformer import MultiheadAttention; import deform_plugin; "
            "from mmdet.apis import DetInferencer; import mmdet.models; print('ok')")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-2000:]
