"""Graph inference gives eager inference's detections: the split predict exactly, the replayed graph on a GPU."""
import copy
import os
from pathlib import Path

import pytest
import stock_worker
import torch
from small_detectors import float64_nms_refusal, small_detector

import deform_plugin  # noqa: F401  (mmcv-lite stand-in; registers our module)
from deform_plugin.apis import enable_fast_inference
from deform_plugin.cuda_graphs import CapturePolicy
from deform_plugin.integration.mmdet_graph_inference import GraphInference

ROOT = Path(__file__).resolve().parents[2]

ON_GPU = torch.cuda.is_available()
CONFIGS = {"dino": "configs/dino/dino-4scale_r50_8xb2-12e_coco_deform-plugin.py",
           "ddq": "configs/ddq/ddq-detr-4scale_r50_8xb2-12e_coco_deform-plugin.py",
           "mask2former": "configs/mask2former/mask2former_r50_8xb2-lsj-50e_coco_deform-plugin.py"}


def _detector(name, device="cpu", dtype=torch.float64):
    from mmengine.config import Config
    torch.manual_seed(0)
    model = stock_worker.build_msda_owner(Config.fromfile(str(ROOT / CONFIGS[name])))
    model.init_weights()
    return model.to(device=device, dtype=dtype).eval()


def _small_detector(name):
    """The CPU tests' detector: the config's, shrunk (ResNet-18, 100 or 20 queries, two layers of each kind); the
    split predict and the fast inference run the same pieces at any size."""
    return small_detector(name, dtype=torch.float64, layers=2).eval()


def _predictions(samples):
    out = []
    for sample in samples:
        instances = sample.pred_instances
        out.append({key: instances[key] for key in ("bboxes", "scores", "labels", "masks") if key in instances})
    return out


# DDQ-DETR's region ends with its encoder: its decoder's query selection runs after it, with the post-processing.
@pytest.mark.parametrize("name", ["dino", "ddq", "mask2former"])
def test_split_predict_is_the_stock_predict(name):
    # The DETRs' region takes each image's size as a tensor and masks its padding; an unpadded image gets an
    # all-valid mask where stock passes none: the same detections up to rounding.
    from deform_plugin.integration.mmdet_fast_paths.graphed_inputs import image_sizes_tensor
    refusal = float64_nms_refusal() if name == "ddq" else None
    if refusal:
        pytest.skip(refusal)
    detector = _small_detector(name)
    inputs, samples = stock_worker.detection_inputs(batch=1, height=224, width=256)
    graph_inference = GraphInference(detector)
    with torch.no_grad():
        expected = _predictions(detector.predict(inputs, copy.deepcopy(samples)))
        outs = graph_inference.region(detector, inputs, image_sizes_tensor(samples, inputs.device))
        got = _predictions(graph_inference.postprocess(detector, outs, copy.deepcopy(samples), True))
    for ours, theirs in zip(got, expected):
        assert ours.keys() == theirs.keys() and "bboxes" in ours
        for key in ours:
            if ours[key].is_floating_point():
                torch.testing.assert_close(ours[key], theirs[key], rtol=1e-7, atol=1e-8)
            else:
                assert torch.equal(ours[key], theirs[key]), key


def test_on_a_cpu_fast_inference_gives_the_eager_detections():
    # 224 x 256 is its own 32 px bucket: no padding, the region's all-valid masks where stock passes none.
    detector = _small_detector("dino")
    reference = copy.deepcopy(detector)
    enable_fast_inference(detector)
    inputs, samples = stock_worker.detection_inputs(batch=1, height=224, width=256)
    with torch.no_grad():
        got = _predictions(detector.predict(inputs, copy.deepcopy(samples)))
        expected = _predictions(reference.predict(inputs, copy.deepcopy(samples)))
    for ours, theirs in zip(got, expected):
        # The SDPA attention brick and the masks differ from stock by float rounding only.
        torch.testing.assert_close(ours["bboxes"], theirs["bboxes"], rtol=1e-7, atol=1e-7)
        assert torch.equal(ours["labels"], theirs["labels"])


def test_on_a_cpu_fast_inference_keeps_the_cpu_threads():
    # The threads do the model's work there; only a GPU model's process gets fewer.
    threads = torch.get_num_threads()
    changed = enable_fast_inference(_small_detector("dino"), cpu_threads=1)
    assert torch.get_num_threads() == threads and "cpu_threads" not in changed


def test_a_bad_cpu_thread_count_is_refused_before_anything_changes():
    detector = _small_detector("dino")
    with pytest.raises(ValueError, match="cpu_threads must be a positive integer or None, got 0"):
        enable_fast_inference(detector, cpu_threads=0)
    assert "predict" not in vars(detector)  # no graph-replayed predict put in place


def _unset_cudnn_api(monkeypatch):
    from deform_plugin.conv_planning import CUDNN_V8_API_DISABLED
    monkeypatch.setenv(CUDNN_V8_API_DISABLED, "")  # restored at teardown, whatever this test sets
    monkeypatch.delenv(CUDNN_V8_API_DISABLED)
    return CUDNN_V8_API_DISABLED


def test_cudnn_v7_api_by_default_only_for_a_model_on_the_gpu(monkeypatch):
    variable = _unset_cudnn_api(monkeypatch)
    changed = enable_fast_inference(_small_detector("dino"), cpu_threads=None)
    assert "cudnn_v7_api" not in changed and variable not in os.environ
    changed = enable_fast_inference(_small_detector("dino"), cpu_threads=None, cudnn_v7_api=True)
    assert changed["cudnn_v7_api"] is True and os.environ[variable] == "1"


def test_the_users_cudnn_api_wins_and_a_bad_switch_is_refused(monkeypatch):
    variable = _unset_cudnn_api(monkeypatch)
    monkeypatch.setenv(variable, "0")
    assert enable_fast_inference(_small_detector("dino"), cudnn_v7_api=True)["cudnn_v7_api"] is False
    assert os.environ[variable] == "0"
    detector = _small_detector("dino")
    with pytest.raises(ValueError, match="cudnn_v7_api must be None, True or False, got 'v7'"):
        enable_fast_inference(detector, cudnn_v7_api="v7")
    assert "predict" not in vars(detector)


def test_a_detector_without_graph_inference_is_refused():
    with pytest.raises(TypeError, match="Linear has no graph inference"):
        GraphInference(torch.nn.Linear(2, 2))


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("name", ["dino", "ddq", "mask2former"])
def test_graph_replay_gives_the_eager_detections(name):
    from deform_plugin.integration.mmdet_fast_paths import apply_fast_paths
    detector = _detector(name, device="cuda", dtype=torch.float32)
    eager = copy.deepcopy(detector)
    apply_fast_paths(eager, sdpa_attention=True, sync_free_forward=True)  # the same kernels, not replayed
    changed = enable_fast_inference(detector, policy=CapturePolicy(max_graphs=1), buckets=None)
    graph_inference = changed["graph_inference"]
    inputs, samples = stock_worker.detection_inputs(batch=1, height=512, width=640)
    inputs = inputs.float().cuda()
    with torch.no_grad():
        expected = _predictions(eager.predict(inputs, copy.deepcopy(samples)))
        for _ in range(3):  # eager, captured, replayed
            got = _predictions(detector.predict(inputs, copy.deepcopy(samples)))
        assert len(graph_inference.graphs.entries) == 1 and graph_inference.graphs.replays == 2
        # A second input size beyond max_graphs=1 runs eagerly; the first keeps its graph.
        other_inputs, other_samples = stock_worker.detection_inputs(batch=1, height=480, width=640)
        for _ in range(3):
            detector.predict(other_inputs.float().cuda(), copy.deepcopy(other_samples))
        detector.predict(inputs, copy.deepcopy(samples))
        assert len(graph_inference.graphs.entries) == 1 and graph_inference.graphs.replays == 3
    for ours, theirs in zip(got, expected):
        torch.testing.assert_close(ours["bboxes"], theirs["bboxes"], rtol=1e-3, atol=1e-2)
        assert torch.equal(ours["labels"], theirs["labels"])
