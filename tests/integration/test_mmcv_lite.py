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
