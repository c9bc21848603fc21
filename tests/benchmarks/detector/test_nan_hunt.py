"""The NaN hunt: its variants, its comparisons (NaN never dropped), and on a GPU a few fresh processes of a tiny
DINO, eager and graph-replayed, poisoned and not."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkout import checkout_environment

from deform_plugin.benchmarks.detector.nan_hunt import (
    max_abs_diff,
    nearest_box_distance,
    parse_variant,
    summarize_variant,
)

ROOT = Path(__file__).resolve().parents[3]
TINY_DINO = Path(__file__).resolve().parent / "configs" / "dino-4scale_r18_tiny_coco.py"


def _process(first_scores, nonfinite=(0, 0), graphs=None, second_score=0.1, box=(0.0, 0.0, 4.0, 4.0)):
    return dict(detections=[dict(scores=first_scores, bboxes=[list(box)] * len(first_scores),
                                 nonfinite=nonfinite[0]),
                            dict(scores=[second_score], bboxes=[[0.0, 0.0, 1.0, 1.0]], nonfinite=nonfinite[1])],
                graphs=graphs)


def test_variants_are_kind_mode_and_poison():
    assert parse_variant("graph:bf16:poison") == dict(name="graph:bf16:poison", row="graph", mode="bf16",
                                                      poison=True)
    assert parse_variant("eager:fp32")["poison"] is False
    import argparse
    for bad in ("graph", "stock:fp32", "graph:fp16", "graph:fp32:nan"):
        with pytest.raises(argparse.ArgumentTypeError, match="KIND:MODE"):
            parse_variant(bad)


def test_a_nan_anywhere_makes_the_difference_nan():
    assert max_abs_diff([0.9, 0.5], [0.8, 0.5]) == pytest.approx(0.1)
    assert math.isnan(max_abs_diff([0.9, float("nan")], [0.8, 0.5]))
    assert math.isnan(max_abs_diff([float("nan"), 0.9], [0.8, 0.5]))  # Python's max would drop a leading NaN
    assert max_abs_diff([], [0.5]) == 0.0
    # Boxes in any order: each against its nearest reference box.
    assert nearest_box_distance([[0, 0, 4, 4], [10, 10, 20, 20]], [[10, 10, 20, 21], [0, 0, 4, 4]]) == 1.0
    assert math.isnan(nearest_box_distance([[0, 0, float("nan"), 4]], [[0, 0, 4, 4]]))


def test_a_variant_row_counts_nan_processes_and_the_spread():
    reference = _process([0.9, 0.5])
    processes = [_process([0.9, 0.5], graphs=dict(graphs=1, replays=3, eager_calls=1)),
                 _process([float("nan"), 0.9], nonfinite=(2, 0)), _process([0.9, 0.4], nonfinite=(0, 1)),
                 dict(error="exit 1: boom")]
    row = summarize_variant("graph:fp32", processes, reference)
    assert (row["processes"], row["failed"], row["errors"]) == (4, 1, ["exit 1: boom"])
    assert row["first_image_nonfinite_processes"] == 1 and row["first_image_nonfinite_counts"] == [0, 2, 0]
    assert row["any_image_nonfinite_processes"] == 2
    assert math.isnan(row["spread"]) and math.isnan(row["max_diff_vs_reference"])
    assert row["graphs"] == [dict(graphs=1, replays=3, eager_calls=1)]
    steady = summarize_variant("eager:fp32", [_process([0.9, 0.5]), _process([0.9, 0.5])], reference)
    assert steady["spread"] == 0.0 and steady["max_diff_vs_reference"] == 0.0
    assert steady["max_box_distance_vs_reference"] == 0.0
    # The spread covers every image, not the first alone; boxes are compared with the reference's.
    later = summarize_variant("graph:bf16", [_process([0.9, 0.5]), _process([0.9, 0.5], second_score=0.3,
                                                                               box=(0.0, 0.0, 4.0, 6.5))], reference)
    assert later["spread"] == pytest.approx(0.2) and later["max_box_distance_vs_reference"] == 2.5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the hunt's graph rows need a CUDA device")
def test_a_few_fresh_processes_agree_and_hold_no_nan(tmp_path):
    command = [sys.executable, "tools/nan_hunt.py", str(TINY_DINO), "--variants", "eager:fp32", "graph:fp32",
               "graph:fp32:poison", "graph:bf16", "--processes", "2", "--jobs", "4", "--images", "3",
               "--out-dir", str(tmp_path)]
    completed = subprocess.run(command, cwd=ROOT, env=checkout_environment(), capture_output=True, text=True,
                               timeout=900)
    report = (tmp_path / "nan_hunt.md").read_text() if (tmp_path / "nan_hunt.md").exists() else ""
    assert completed.returncode == 0, report + completed.stdout[-3000:] + completed.stderr[-3000:]
    result = json.loads((tmp_path / "nan_hunt.json").read_text())
    assert result["settings"]["nonfinite_parameters"] == []
    rows = {row["variant"]: row for row in result["rows"]}
    for name in ("eager:fp32", "graph:fp32", "graph:fp32:poison", "graph:bf16"):
        row = rows[name]
        assert row["failed"] == 0 and row["any_image_nonfinite_processes"] == 0 and row["spread"] == 0.0, row
    # Three 480x640 images: eager (the kind's warm-up), captured and replayed, replayed.
    assert rows["graph:fp32"]["graphs"][0]["replays"] == 2
