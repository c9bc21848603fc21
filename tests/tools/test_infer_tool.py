"""tools/infer.py draws and saves detections as mmdet's DetInferencer does, and explains bad input."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO_CONFIG = ROOT / "configs" / "demo" / "deformable-detr-refine_r18_tiny_1xb4-500i_shapes.py"


def _run(*args):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "infer.py"), *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    import cv2
    folder = tmp_path_factory.mktemp("images")
    generator = np.random.default_rng(0)
    for index, (height, width) in enumerate([(120, 160), (150, 110)]):
        cv2.imwrite(str(folder / f"{index}.png"), generator.integers(0, 255, (height, width, 3), dtype=np.uint8))
    return folder


def test_infer_writes_drawn_images_and_predictions(images, tmp_path):
    result = _run(DEMO_CONFIG, "none", images, "--out-dir", tmp_path, "--device", "cpu")
    assert result.returncode == 0, result.stderr[-3000:]
    for index in range(2):
        assert (tmp_path / "vis" / f"{index}.png").is_file()
        prediction = json.loads((tmp_path / "preds" / f"{index}.json").read_text())
        assert {"labels", "scores", "bboxes"} <= prediction.keys() and len(prediction["bboxes"]) == 30


@pytest.mark.parametrize("args, message", [
    (("{config}", "missing.pth", "{images}"), "checkpoint 'missing.pth' does not exist"),
    (("{config}", "none", "nowhere.jpg"), "image 'nowhere.jpg' does not exist"),
    (("missing.py", "none", "{images}"), "config 'missing.py' does not exist"),
], ids=["checkpoint", "image", "config"])
def test_bad_input_gets_a_clear_message(images, args, message):
    result = _run(*(a.format(config=DEMO_CONFIG, images=images) for a in args))
    assert result.returncode != 0 and message in result.stderr and "Traceback" not in result.stderr
