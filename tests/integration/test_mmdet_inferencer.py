"""NamedClassesInferencer: class names from the checkpoint, else the config, of the model's class count; never COCO's
80 names for a model of other classes."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deform_plugin.integration.mmdet_inferencer import NamedClassesInferencer, choose_class_names

REPO_ROOT = Path(__file__).resolve().parents[2]
DEMO_CONFIG = REPO_ROOT / "configs" / "demo" / "deformable-detr-refine_r18_tiny_1xb4-500i_shapes.py"
SHAPES = ["circle", "square", "triangle", "star"]


@pytest.mark.parametrize("candidates, names, source", [
    ([("the checkpoint", ["a", "b", "c", "d"]), ("the config", SHAPES)], ["a", "b", "c", "d"], "the checkpoint"),
    ([("the checkpoint", [f"coco{i}" for i in range(80)]), ("the config", SHAPES)], SHAPES, "the config"),
    ([("the checkpoint", None), ("the config", SHAPES)], SHAPES, "the config"),
    ([("the checkpoint", None), ("the config", ["x"])], [f"class {i}" for i in range(4)],
     "numbered: the model predicts 4 classes (the config has 1)"),
], ids=["checkpoint", "checkpoint-of-other-classes", "config", "numbered"])
def test_class_names_match_the_model(candidates, names, source):
    assert choose_class_names(candidates, 4) == (names, source)


def test_the_demo_detector_without_checkpoint_names_its_four_classes(tmp_path):
    inferencer = NamedClassesInferencer(model=str(DEMO_CONFIG), weights=None, device="cpu", show_progress=False)
    assert inferencer.model.dataset_meta["classes"] == SHAPES
    assert inferencer.visualizer.dataset_meta["classes"] == SHAPES
    assert inferencer.class_names_source == "the config's test dataset"
    # A checkpoint's own names win where they fit the model.
    checkpoint = tmp_path / "named.pth"
    torch.save({"state_dict": inferencer.model.state_dict(),
                "meta": {"dataset_meta": {"classes": ["w", "x", "y", "z"]}}}, checkpoint)
    named = NamedClassesInferencer(model=str(DEMO_CONFIG), weights=str(checkpoint), device="cpu",
                                   show_progress=False)
    assert named.model.dataset_meta["classes"] == ["w", "x", "y", "z"]
    assert named.class_names_source == "the checkpoint"
