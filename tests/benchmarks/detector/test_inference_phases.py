"""deform_plugin.benchmarks.detector.inference_phases: an inference_detector call split into its phases."""
import pytest
import torch
from train_benchmark_cases import TINY_COCO_CONFIG

from deform_plugin.benchmarks.common import machine_info
from deform_plugin.benchmarks.detector.inference import report
from deform_plugin.benchmarks.detector.inference_loop import make_images
from deform_plugin.benchmarks.detector.inference_phases import PHASES, time_phases


@pytest.fixture(scope="module")
def tiny_detector():
    from mmdet.apis import init_detector
    torch.manual_seed(0)
    return init_detector(str(TINY_COCO_CONFIG), None, device="cpu", palette="coco")


def test_phases_add_up_to_the_call_and_leave_the_model_as_it_was(tiny_detector):
    from mmcv.transforms import Compose
    model = tiny_detector
    compose_call = Compose.__call__
    before = {name: set(vars(part)) for name, part in
              dict(model=model, preprocessor=model.data_preprocessor, head=model.bbox_head).items()}
    phases = time_phases(model, make_images([(40, 60), (60, 40)], seed=0))
    assert set(phases) == set(PHASES) | {"total"}
    assert all(phases[p] > 0 for p in ("pipeline", "preprocess", "forward", "postprocess"))
    assert sum(phases[p] for p in PHASES) == pytest.approx(phases["total"], rel=1e-9)
    after = {name: set(vars(part)) for name, part in
             dict(model=model, preprocessor=model.data_preprocessor, head=model.bbox_head).items()}
    assert after == before and Compose.__call__ is compose_call
    with pytest.raises(ValueError, match="at least one image"):
        time_phases(model, [])


def test_the_report_adds_a_phase_table(tmp_path):
    phases = dict.fromkeys(PHASES, 1.0)
    phases["total"] = 5.0
    record = dict(config="tiny", sizes="coco16", row="graph:fp32", steady_ms=5.0, all_ms=6.0, first_ms=9.0,
                  seconds=[0.006, 0.005], detections=[], nonfinite_images=0, phases_ms=phases)
    text = report([record], machine_info(torch.device("cpu")), tmp_path)
    assert "ms per image by phase" in text
    assert "| tiny | coco16 | graph:fp32 | 1.00 | 1.00 | 1.00 | 1.00 | 1.00 | 5.00 |" in text
