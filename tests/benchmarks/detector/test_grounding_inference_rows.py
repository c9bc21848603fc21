"""The inference benchmark's batch-1 loop and phases on a graph row of Grounding-DINO: the caption prompt reaches
every ``inference_detector`` call, and the fast inference serves it (on a CPU: its region run eagerly)."""
import pytest
import torch

pytest.importorskip("transformers")

from deform_plugin.benchmarks.detector.inference_loop import make_images, time_inference  # noqa: E402
from deform_plugin.benchmarks.detector.inference_phases import PHASES, time_phases  # noqa: E402

small_grounding_dino = pytest.importorskip("small_grounding_dino")


@pytest.fixture(scope="module")
def grounding_graph_row():
    from mmdet.apis import init_detector

    from deform_plugin.apis import enable_fast_inference
    from deform_plugin.benchmarks.detector import random_text_encoder_model  # noqa: F401  (registers it)
    cfg = small_grounding_dino.small_grounding_dino_config()
    cfg.model.test_cfg.max_per_img = 50  # 30 queries of five names: 150 scores
    cfg.test_dataloader.dataset.pipeline[1].scale = (96, 128)  # a CPU-sized FixScaleResize
    torch.manual_seed(0)
    model = init_detector(cfg, None, device="cpu", palette="coco")
    # The benchmark's prompt is the model's classes (init_detector without a checkpoint gives COCO's 80).
    model.dataset_meta = dict(classes=small_grounding_dino.CLASSES)
    changed = enable_fast_inference(model)
    return model, changed["graph_inference"]


def test_the_loop_and_the_phases_prompt_a_grounding_graph_row(grounding_graph_row):
    model, graph_inference = grounding_graph_row
    images = make_images([(60, 80), (80, 60), (60, 80)], seed=0)
    result = time_inference(model, images, graph_inference=graph_inference, top_k=5)
    assert len(result["seconds"]) == 3 and result["call_kinds"] == ["eager"] * 3  # no graphs on a CPU
    assert all(len(detections["scores"]) == 5 for detections in result["detections"])
    assert graph_inference.graphs.eager_calls == 3  # each call the graph inference's region, run eagerly
    phases = time_phases(model, images[:1])
    assert all(phases[phase] > 0 for phase in ("pipeline", "preprocess", "forward", "postprocess"))
    assert sum(phases[phase] for phase in PHASES) == pytest.approx(phases["total"], rel=1e-9)
