"""tools/benchmark_infer.py: the size distributions, the images, the row grammar and one small CPU run."""
import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
from checkout import checkout_environment
from tool_main import run_tool_main
from train_benchmark_cases import TINY_COCO_CONFIG

from deform_plugin.benchmarks.detector.inference import compare_detections, parse_image_range, parse_row
from deform_plugin.benchmarks.detector.inference_loop import COCO_COMMON_SIZES, call_kind, image_sizes, make_images

ROOT = Path(__file__).resolve().parents[2]


def test_the_size_distributions():
    assert image_sizes("coco16", 18) == list(COCO_COMMON_SIZES) + list(COCO_COMMON_SIZES[:2])
    assert image_sizes("fixed", 3) == [(480, 640)] * 3
    distinct = image_sizes("distinct", 50, seed=1)
    assert len(set(distinct)) == 50 and all(300 <= side <= 1333 for size in distinct for side in size)
    assert distinct == image_sizes("distinct", 50, seed=1) != image_sizes("distinct", 50, seed=2)
    with pytest.raises(ValueError, match="unknown size distribution 'coco'; choose from coco16, distinct, fixed"):
        image_sizes("coco", 4)
    with pytest.raises(ValueError, match="count must be >= 1, got 0"):
        image_sizes("coco16", 0)


def test_images_have_their_sizes_and_are_reproducible():
    images = make_images([(31, 45), (64, 8)], seed=3)
    assert [image.shape for image in images] == [(31, 45, 3), (64, 8, 3)]
    assert all(image.dtype.name == "uint8" and image.flags["C_CONTIGUOUS"] for image in images)
    assert all((a == b).all() for a, b in zip(images, make_images([(31, 45), (64, 8)], seed=3)))


def test_rows_are_kind_and_mode():
    assert parse_row("graph:bf16") == ("graph", "bf16")
    for bad, match in [("graph", "not KIND:MODE"), ("fast:fp32", "not KIND:MODE"),
                       ("stock:bf16", "stock runs fp32 only")]:
        with pytest.raises(argparse.ArgumentTypeError, match=match):
            parse_row(bad)


def test_profile_ranges_are_one_based_and_ordered():
    assert parse_image_range("3:5") == (3, 5) and parse_image_range("4") == (4, 4)
    for bad in ("0:2", "5:3", "a:b", "2:"):
        with pytest.raises(argparse.ArgumentTypeError, match="not FIRST:LAST"):
            parse_image_range(bad)


def test_a_graph_call_is_named_by_what_its_stats_changed():
    before = dict(graphs=1, replays=4, borrowed_calls=2, eager_calls=3)
    assert call_kind(before, dict(before, graphs=2)) == "capture"
    assert call_kind(before, dict(before, replays=5)) == "replay"
    assert call_kind(before, dict(before, replays=5, borrowed_calls=3)) == "borrow"
    assert call_kind(before, dict(before, eager_calls=4)) == "eager"
    # Feature buckets: two parts, the backbone's graphs under 'backbone'.
    parts = dict(before, borrowed_calls=0, backbone=dict(graphs=2, replays=7, eager_calls=5))
    assert call_kind(parts, dict(parts, replays=5, backbone=dict(graphs=2, replays=8, eager_calls=5))) == "replay"
    assert call_kind(parts, dict(parts, replays=5, backbone=dict(graphs=2, replays=7, eager_calls=6))) == "partial"
    assert call_kind(parts, dict(parts, replays=5, backbone=dict(graphs=3, replays=7, eager_calls=5))) == "capture"
    assert call_kind(parts, dict(parts, graphs=2, backbone=dict(graphs=2, replays=7, eager_calls=6))) == "capture"
    assert call_kind(parts, dict(parts, eager_calls=4, backbone=dict(graphs=2, replays=7, eager_calls=6))) == "eager"


def test_detections_are_compared_by_top_scores_and_top_box():
    a = [dict(scores=[0.9, 0.5], labels=[1, 2], bboxes=[[0, 0, 10, 10], [1, 1, 2, 2]])]
    b = [dict(scores=[0.85, 0.5], labels=[1, 3], bboxes=[[0.5, 0, 10, 10.5], [1, 1, 2, 2]])]
    c = [dict(scores=[0.9, 0.5], labels=[1, 2], bboxes=[[3, 0, 10, 10], [1, 1, 2, 2]])]
    assert compare_detections(a, b) == pytest.approx(dict(max_score_diff=0.05, top1_agreement=1.0))
    assert compare_detections(a, c)["top1_agreement"] == 0.0


def test_a_small_cpu_run_writes_its_report(tmp_path):
    command = [sys.executable, "tools/benchmark_infer.py", str(TINY_COCO_CONFIG), "--device", "cpu", "--images", "2",
               "--warmup", "1", "--sizes", "coco16", "--rows", "stock:fp32", "eager:fp32", "graph:fp32", "--out-dir",
               str(tmp_path), "--profile", "2:2"]
    completed = subprocess.run(command, cwd=ROOT, env=checkout_environment(), capture_output=True, text=True,
                               timeout=600)
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-2000:]
    records = json.loads((tmp_path / "inference.json").read_text())["records"]
    assert [r["row"] for r in records] == ["stock:fp32", "eager:fp32", "graph:fp32"]
    # The same weights and images: mmcv's own op (here its PyTorch CPU path) finds our op's detections.
    assert records[0]["max_score_diff"] < 1e-4 and records[1]["top1_vs_stock"] == 1.0
    graph = records[2]
    # The CPU runs no graphs; Deformable-DETR's feature buckets pad nothing there (the detections are the unpadded
    # ones either way).
    assert graph["graphs"]["graphs"] == 0 and graph["graphs"]["eager_calls"] == 2
    assert graph["graphs"]["padded_pixels"] == 0 and graph["nonfinite_images"] == 0
    assert graph["call_kinds"] == ["eager", "eager"] and records[0]["call_kinds"] is None
    assert records[1]["max_score_diff"] == 0.0
    table = (tmp_path / "inference.md").read_text()
    assert table.startswith("machine: ") and "| graph:fp32 |" in table
    assert (tmp_path / "inference.png").stat().st_size > 0
    assert "| graph:fp32 | 2 x " in table  # the calls by kind
    # Each row's profile of its second image: torch.profiler's operator table, under the row's own name.
    profiles = sorted(p.name for p in (tmp_path / "profiles").iterdir())
    assert len(profiles) == 3 and all(name.endswith(".txt") for name in profiles)
    assert "by self CPU time" in (tmp_path / "profiles" / profiles[0]).read_text()


def test_a_missing_config_is_one_error_line(tmp_path, monkeypatch, capsys):
    # A usage error needs no fresh interpreter: the command line runs in this process.
    monkeypatch.chdir(ROOT)
    status, _, stderr = run_tool_main("benchmark_infer.py", ["nowhere.py", "--out-dir", tmp_path], monkeypatch, capsys)
    assert status == 2 and "config 'nowhere.py' does not exist" in stderr
