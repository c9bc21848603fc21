"""deform_plugin.benchmarks.detector.ap_parity_report: the statistics on known inputs (mean, sample std, the paired
gap, the within-target rule and its 0.01 floor), which runs count, and the files."""
from __future__ import annotations

import csv
import json
import math

import pytest

from deform_plugin.benchmarks.detector import ap_parity_report as report

ITERS = 100


def run(row, seed, value, config="ddetr", iterations=ITERS, status="ok", stopped_early=None, mid=None, **extra):
    """A run's record as ap_parity.collect_run writes it, with final bbox mAP ``value`` (None: never evaluated)."""
    evaluations = [] if mid is None else [dict(iteration=ITERS // 2, seconds=1.0,
                                              metrics={"coco/bbox_mAP": mid})]
    if value is not None:
        evaluations.append(dict(iteration=iterations, seconds=1.0,
                                metrics={"coco/bbox_mAP": value, "coco/bbox_mAP_50": value + 0.2}))
    record = dict(name=f"{config}__{row}__seed{seed}", config=config, row=row, seed=seed, status=status,
                  iterations=iterations, planned_iterations=ITERS, stopped_early=stopped_early,
                  evaluations=evaluations, loss_curve=[[10, 5.0 + seed], [20, 4.0 + seed]], final_loss=4.0 + seed,
                  it_per_s=2.0, nonfinite_losses=0, init_mismatch=False, timing=None, log="train.log", error=None)
    record.update(extra)
    return record


def plan(rows, seeds=(0, 1, 2), eval_iterations=(ITERS,)):
    return dict(configs=[dict(name="ddetr", title="Deformable-DETR")], rows=list(rows), seeds=list(seeds),
                eval_iterations=list(eval_iterations), device="cpu", gpus=None, per_gpu=2, val_images=128,
                val_split_images=128, decay_iteration=80,
                schedule=dict(iters=ITERS, batch_size=2, lr=2e-4, backbone_lr_mult=1.0, warmup_iters=10,
                              scales=[96, 128], test_scale=128, backbone="trainable"))


def rows_of(summary):
    return {row["row"]: row for row in summary["configs"][0]["rows"]}


def test_mean_and_sample_std():
    mean, std = report.mean_std([0.30, 0.32, 0.34])
    assert mean == pytest.approx(0.32) and std == pytest.approx(0.02)  # n - 1 in the denominator
    assert report.mean_std([0.5]) == (0.5, None)
    assert report.mean_std([]) == (None, None)


@pytest.mark.parametrize("row_mean, base_std, expected", [
    (0.33, 0.02, True),     # within one baseline std
    (0.34, 0.02, True),     # exactly one std: within
    (0.341, 0.02, False),
    (0.329, 0.001, True),   # std below 0.01: the 0.01 floor applies
    (0.331, 0.001, False),
    (0.329, None, True),    # one baseline seed: 0.01
    (0.31, 0.02, True),     # below the baseline counts the same
], ids=["within-std", "at-std", "beyond-std", "floor-within", "floor-beyond", "one-seed", "below"])
def test_within_target_rule(row_mean, base_std, expected):
    assert report.within_target(row_mean, 0.32, base_std) is expected


def test_summary_per_row_with_paired_gaps_and_verdicts():
    runs = ([run("stock:fp32", s, v) for s, v in enumerate([0.30, 0.32, 0.34])]
            + [run("ours:fp32", s, v) for s, v in enumerate([0.31, 0.33, 0.35])]
            + [run("ours:bf16", s, v) for s, v in enumerate([0.33, 0.36, 0.36])])
    summary = report.summarize(plan(["stock:fp32", "ours:fp32", "ours:bf16"]), runs)
    rows = rows_of(summary)
    stock, fp32, bf16 = rows["stock:fp32"], rows["ours:fp32"], rows["ours:bf16"]
    assert (stock["n"], stock["mean"], stock["std"]) == (3, pytest.approx(0.32), pytest.approx(0.02))
    assert stock["within_target"] is None and stock["tolerance"] == pytest.approx(0.02)
    assert fp32["delta_mean"] == pytest.approx(0.01) and fp32["delta_std"] == pytest.approx(0.0, abs=1e-12)
    assert fp32["within_target"] is True
    assert bf16["mean"] == pytest.approx(0.35) and bf16["within_target"] is False  # 0.03 > 0.02
    assert stock["map50_mean"] == pytest.approx(0.52)
    assert stock["maps"] == {0: pytest.approx(0.30), 1: pytest.approx(0.32), 2: pytest.approx(0.34)}
    text = report.markdown(summary)
    assert "| ours:fp32 | 0.330 ± 0.020 | 0: 0.310, 1: 0.330, 2: 0.350 |" in text
    assert "**yes** (gap 0.010 <= 0.020)" in text and "**no** (gap 0.030 > 0.020)" in text


def test_runs_that_did_not_train_every_iteration_are_left_out_and_named():
    runs = ([run("stock:fp32", s, v) for s, v in enumerate([0.30, 0.31, 0.32])]
            + [run("ours:bf16", 0, 0.31), run("ours:bf16", 1, 0.20, iterations=60, stopped_early="time limit of 5 s"),
               run("ours:bf16", 2, None, status="killed", iterations=40)])
    summary = report.summarize(plan(["stock:fp32", "ours:bf16"]), runs)
    bf16 = rows_of(summary)["ours:bf16"]
    assert bf16["n"] == 1 and bf16["maps"] == {0: pytest.approx(0.31)} and bf16["std"] is None
    assert bf16["notes"] == ["seed 1 stopped early (time limit of 5 s) at 60/100 it, mAP 0.200",
                             "seed 2 killed at 40/100 it"]
    # The paired gap uses only the seeds where both rows count; the tolerance is the 0.01 floor (std 0.01 here).
    assert bf16["delta_n"] == 1 and bf16["delta_mean"] == pytest.approx(0.01)
    assert bf16["within_target"] is True
    assert "**yes** (gap 0.000 <= 0.010; ours:bf16 on 1 of 3 seeds)" in report.markdown(summary)


def test_a_row_without_any_counted_run_has_no_verdict():
    runs = [run("stock:fp32", 0, 0.3), run("ours:bf16", 0, None, status="failed", iterations=0)]
    bf16 = rows_of(report.summarize(plan(["stock:fp32", "ours:bf16"], seeds=[0]), runs))["ours:bf16"]
    assert bf16["within_target"] is None and bf16["mean"] is None
    assert "n/a (no run counts)" in report.markdown(report.summarize(plan(["stock:fp32", "ours:bf16"], [0]), runs))


def test_nonfinite_losses_and_mismatched_initial_weights_are_flagged():
    runs = [run("stock:fp32", 0, 0.3), run("ours:bf16", 0, 0.3, nonfinite_losses=2, init_mismatch=True)]
    notes = rows_of(report.summarize(plan(["stock:fp32", "ours:bf16"], seeds=[0]), runs))["ours:bf16"]["notes"]
    assert notes == ["2 non-finite logged losses", "initial weights did not load exactly (seeds [0])"]


def test_mid_schedule_evaluations_are_tabled_over_every_run_that_reached_them():
    runs = [run("stock:fp32", 0, 0.30, mid=0.10), run("stock:fp32", 1, 0.32, mid=0.14),
            run("ours:bf16", 0, None, status="killed", iterations=70, mid=0.12)]
    summary = report.summarize(plan(["stock:fp32", "ours:bf16"], seeds=[0, 1], eval_iterations=[50, 100]), runs)
    table = summary["configs"][0]["schedule"]
    assert table["stock:fp32"][50] == (pytest.approx(0.12), pytest.approx(math.sqrt(0.0008)), 2)
    assert table["ours:bf16"][50] == (pytest.approx(0.12), None, 1)
    assert table["ours:bf16"][100] == (None, None, 0)
    assert "| ours:bf16 | 0.120 (1) | - |" in report.markdown(summary)


def test_reports_are_written(tmp_path):
    runs = [run("stock:fp32", s, 0.3 + 0.01 * s) for s in range(2)] + [run("ours:bf16", s, 0.31) for s in range(2)]
    summary = report.summarize(plan(["stock:fp32", "ours:bf16"], seeds=[0, 1]), runs)
    text, paths = report.write_reports(summary, tmp_path)
    assert [p.name for p in paths] == ["ap_parity.md", "ap_parity.json", "ap_parity.csv", "ap_parity_ddetr.png"]
    assert (tmp_path / "ap_parity.md").read_text() == text
    assert json.loads((tmp_path / "ap_parity.json").read_text())["configs"][0]["rows"][1]["within_target"] is True
    with open(tmp_path / "ap_parity.csv") as handle:
        lines = list(csv.DictReader(handle))
    assert [(r["row"], r["seed"], r["bbox_mAP"], r["counts"]) for r in lines] == [
        ("stock:fp32", "0", "0.3", "True"), ("stock:fp32", "1", "0.31", "True"),
        ("ours:bf16", "0", "0.31", "True"), ("ours:bf16", "1", "0.31", "True")]
    assert (tmp_path / "ap_parity_ddetr.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
