"""tools/infer.py draws and saves detections as mmdet's DetInferencer does, and explains bad input."""
import json
import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

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


@pytest.fixture(scope="module")
def messy_folder(tmp_path_factory):
    """What a real folder holds: good images, a grayscale and a 16-bit PNG, a truncated JPEG, a text file named .jpg,
    a file that is no image by name, and a subfolder with an image of the same name as one above."""
    import cv2
    folder = tmp_path_factory.mktemp("messy")
    pixels = np.random.default_rng(1).integers(0, 255, (96, 128, 3), dtype=np.uint8)
    cv2.imwrite(str(folder / "0.png"), pixels)
    (folder / "sub").mkdir()
    cv2.imwrite(str(folder / "sub" / "0.png"), pixels[::-1])
    cv2.imwrite(str(folder / "gray.png"), pixels[:, :, 0])
    cv2.imwrite(str(folder / "deep.png"), pixels.astype(np.uint16) * 257)
    jpeg = cv2.imencode(".jpg", pixels)[1].tobytes()
    (folder / "truncated.jpg").write_bytes(jpeg[:len(jpeg) // 2])
    (folder / "fake.jpg").write_text("not an image\n")
    (folder / "notes.txt").write_text("not an image either\n")
    return folder


def test_unreadable_files_are_skipped_and_the_rest_run(messy_folder, tmp_path):
    result = _run(DEMO_CONFIG, "none", messy_folder, "--recursive", "--out-dir", tmp_path, "--device", "cpu")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    warnings = sorted(line for line in result.stderr.splitlines() if line.startswith("warning: skipped"))
    assert warnings == [f"warning: skipped {messy_folder / 'fake.jpg'}: not an image that OpenCV can decode (it is "
                        "text)",
                        f"warning: skipped {messy_folder / 'truncated.jpg'}: truncated JPEG: the data ends before the "
                        "image does"]
    assert "left out 1 file(s) whose names do not end in an image suffix" in result.stderr
    # The demo config's 4 classes, not COCO's 80 (no checkpoint here to name them).
    assert "classes: 4 from the config's test dataset (circle, square, triangle, star)" in result.stderr
    summary = result.stdout.splitlines()[-2]
    assert summary.startswith("4 image(s) in ") and " img/s end to end" in summary
    assert summary.endswith("skipped 2 unreadable file(s), each named above")
    assert "capture" not in result.stdout  # nothing is captured on a CPU
    for name in ("0", "sub/0", "gray", "deep"):  # the two 0.png keep their folders apart
        assert (tmp_path / "vis" / f"{name}.png").is_file(), name
        prediction = json.loads((tmp_path / "preds" / f"{name}.json").read_text())
        assert len(prediction["bboxes"]) == 30 and set(prediction["labels"]) <= {0, 1, 2, 3}
    assert not (tmp_path / "vis" / "truncated.jpg").exists() and not (tmp_path / "vis" / "fake.jpg").exists()


def test_a_folder_of_unreadable_files_exits_1(tmp_path):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "fake.png").write_bytes(b"\x89PNG not really")
    result = _run(DEMO_CONFIG, "none", folder, "--out-dir", tmp_path / "out", "--device", "cpu")
    assert result.returncode == 1 and "error: none of the 1 image(s) could be read" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args, message", [
    (("{config}", "missing.pth", "{images}"),
     "error: checkpoint 'missing.pth' does not exist (pass 'none' for random weights)"),
    (("{config}", "none", "nowhere.jpg"), "error: image 'nowhere.jpg' does not exist"),
    (("missing.py", "none", "{images}"), "error: config 'missing.py' does not exist"),
    (("{config}", "none", "{empty}"), "error: no images in '{empty}'; pass --recursive to read their subfolders"),
    pytest.param(("{config}", "none", "{images}", "--device", "cuda:0"),
                 "error: --device cuda:0: torch sees no CUDA device here; pass --device cpu",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")),
], ids=["checkpoint", "image", "config", "no-images", "no-cuda"])
def test_bad_input_gets_a_clear_message(images, tmp_path, args, message, capsys):
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    values = dict(config=DEMO_CONFIG, images=images, empty=tmp_path / "empty")
    assert _usage_error([a.format(**values) for a in args], capsys) == message.format(**values)


def _usage_error(argv, capsys) -> str:
    """The last stderr line of tools/infer.py run in this process with ``argv``, which must end it as a usage error
    (exit status 2) before any model is built. In this process: a usage error needs no fresh interpreter."""
    main = runpy.run_path(str(ROOT / "tools" / "infer.py"), run_name="infer_tool")["main"]
    with pytest.raises(SystemExit) as ended:
        main([str(arg) for arg in argv])
    assert ended.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_a_bad_graph_cap_is_a_usage_error(images, tmp_path, capsys):
    argv = [DEMO_CONFIG, "none", images, "--out-dir", tmp_path, "--device", "cpu", "--max-graphs", "0"]
    assert _usage_error(argv, capsys) == "error: --max-graphs: CapturePolicy: max_graphs must be an int >= 1, got 0"


@pytest.mark.parametrize("api, user_value, selects", [("v7", "0", "v8"), ("v8", "1", "v7")])
def test_cudnn_api_needs_cuda_and_an_environment_that_allows_it(images, tmp_path, capsys, monkeypatch, api,
                                                                user_value, selects):
    from deform_plugin.conv_planning import CUDNN_V8_API_DISABLED
    argv = [DEMO_CONFIG, "none", images, "--out-dir", tmp_path, "--device", "cpu", "--cudnn-api", api]
    monkeypatch.setenv(CUDNN_V8_API_DISABLED, user_value)
    assert _usage_error(argv, capsys) == (f"error: --cudnn-api {api}: the environment sets {CUDNN_V8_API_DISABLED}="
                                          f"'{user_value}', which selects cuDNN's {selects} API; unset it or drop "
                                          "--cudnn-api")
    monkeypatch.delenv(CUDNN_V8_API_DISABLED)
    assert _usage_error(argv, capsys) == ("error: --cudnn-api selects an API of cuDNN, a CUDA library: it needs a "
                                          "CUDA device, not 'cpu'")


def test_eager_and_no_buckets_exclude_each_other(images, tmp_path, capsys):
    argv = [DEMO_CONFIG, "none", images, "--out-dir", tmp_path, "--eager", "--no-buckets"]
    assert "not allowed with argument" in _usage_error(argv, capsys)
