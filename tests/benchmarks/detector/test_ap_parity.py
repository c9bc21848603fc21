"""deform_plugin.benchmarks.detector.ap_parity: the checks of the command line, and one tiny study on the CPU. The
demo config's stock row (mmdet's own training script in a process without deform_plugin, mmcv's PyTorch MSDA) and
its fast row (our script) train 3 iterations from the same initial weights, paced, are evaluated on 8 val images,
and are reported; the report is then rebuilt from the work dir.

The shapes set is read from (or generated once into) its default cache, as the demo does.
"""
from __future__ import annotations

import contextlib
import csv
import io
import json
import shutil
from pathlib import Path

import pytest
import torch

from deform_plugin.benchmarks.detector import ap_parity
from deform_plugin.benchmarks.detector.loss_curves import read_scalars
from deform_plugin.benchmarks.detector.train_overlay import read_base_config

# One pytest-xdist worker runs this whole module, so that its module-scoped fixture (processes) runs once.
pytestmark = pytest.mark.xdist_group("ap_parity")

STUDY_ITERS = 3
STUDY_SEED = 3
STUDY_ARGS = ["--device", "cpu", "--configs", "demo", "--rows", "stock:fp32", "ours:fp32", "--seeds", str(STUDY_SEED),
              "--iters", str(STUDY_ITERS), "--batch-size", "2", "--scales", "96", "128", "--test-scale", "128",
              "--val-images", "8", "--val-every", "0", "--workers", "0", "--logger-interval", "1",
              "--warmup-iters", "1", "--progress-every", "600"]


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """One tiny study: (exit status, work dir, report dir, stdout, run records by row)."""
    work = tmp_path_factory.mktemp("ap_parity")
    out = work / "report"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):  # each run gets one OpenMP thread (--threads 1, the default)
        status = ap_parity.main(STUDY_ARGS + ["--work-dir", str(work), "--out-dir", str(out)])
    records = {}
    for folder in (work / "runs").iterdir():
        record = json.loads((folder / "run.json").read_text())
        records[record["row"]] = record
    return status, work, out, stdout.getvalue(), records


def test_the_study_trains_both_rows_from_the_same_initial_weights(study):
    status, work, _, _, records = study
    stock, ours = records["stock:fp32"], records["ours:fp32"]
    assert status == 0, [r["error"] for r in records.values()]
    weights = work / "inits" / "demo" / f"seed{STUDY_SEED}.pth"
    saved = torch.load(weights, weights_only=True)
    assert saved["meta"]["seed"] == STUDY_SEED and saved["meta"]["built_by"].startswith("stock mmdet")
    for record in (stock, ours):
        assert (record["status"], record["iterations"], record["planned_iterations"]) == ("ok", 3, 3)
        assert record["init_loaded"] and not record["init_mismatch"] and record["stopped_early"] is None
        config = read_base_config(Path(record["log"]).parent / "config.py")
        assert config.load_from == str(weights) and config.randomness.seed == STUDY_SEED
    # Stock ran mmcv's module without deform_plugin; ours ran our module.
    assert stock["timing"]["deform_plugin_loaded"] is False
    assert list(stock["timing"]["msda_modules"]) == ["mmcv.ops.multi_scale_deform_attn.MultiScaleDeformableAttention"]
    assert ours["timing"]["deform_plugin_loaded"] is True
    assert list(ours["timing"]["msda_modules"]) == ["deform_plugin.models.msda.MultiScaleDeformableAttention"]
    # Same weights, same data order, exact fast paths in fp32: the logged losses agree to float rounding.
    assert [i for i, _ in stock["loss_curve"]] == [1, 2, 3] == [i for i, _ in ours["loss_curve"]]
    for (_, a), (_, b) in zip(stock["loss_curve"], ours["loss_curve"]):
        assert b == pytest.approx(a, rel=1e-4)


def test_the_recorded_map_is_the_evaluators(study):
    _, _, _, _, records = study
    for record in records.values():
        (evaluation,) = record["evaluations"]
        assert evaluation["iteration"] == STUDY_ITERS
        logged = [r for r in read_scalars(str(Path(record["log"]).parent)) if "coco/bbox_mAP" in r]
        assert len(logged) == 1
        assert evaluation["metrics"] == {k: v for k, v in logged[0].items() if k.startswith("coco/")}
        assert set(evaluation["metrics"]) >= {"coco/bbox_mAP", "coco/bbox_mAP_50", "coco/bbox_mAP_75"}
        assert 0.0 <= evaluation["metrics"]["coco/bbox_mAP"] <= 1.0
    # The evaluation ran on the subset's 8 images: mmengine's val loop logged one batch of 8.
    log = Path(records["stock:fp32"]["log"]).read_text()
    assert "Iter(val) [1/1]" in log


def test_the_study_writes_its_report(study):
    _, work, out, stdout, _ = study
    text = (out / "ap_parity.md").read_text()
    assert "| stock:fp32 |" in text and "| baseline |" in text and "| ours:fp32 |" in text
    assert "evaluated on 8 of the val split's images" in text
    assert text.splitlines()[0] in stdout  # the report is printed as well
    summary = json.loads((out / "ap_parity.json").read_text())
    assert [(r["row"], r["n"]) for r in summary["configs"][0]["rows"]] == [("stock:fp32", 1), ("ours:fp32", 1)]
    with open(out / "ap_parity.csv") as handle:
        assert [r["row"] for r in csv.DictReader(handle)] == ["stock:fp32", "ours:fp32"]
    assert (out / "ap_parity_demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plan = json.loads((work / "plan.json").read_text())
    assert plan["rows"] == ["stock:fp32", "ours:fp32"] and plan["schedule"]["iters"] == STUDY_ITERS
    # Both runs ran at once, paced to the slower one's iteration (the file the tool kept for them).
    assert plan["pacing"] and json.loads((work / "pace" / "demo.json").read_text())["limit"] >= 10


def test_report_only_rebuilds_the_same_report(study, tmp_path, capsys):
    _, work, out, _, _ = study
    assert ap_parity.main(["--report-only", str(work), "--out-dir", str(tmp_path)]) == 0
    assert (tmp_path / "ap_parity.md").read_text() == (out / "ap_parity.md").read_text()


def _split_by_row(work, tmp_path):
    """Two copies of the study's work dir, each planning one row's runs (as two device calls would leave them)."""
    halves = []
    for row in ("stock:fp32", "ours:fp32"):
        half = tmp_path / row.replace(":", "-")
        shutil.copytree(work, half, ignore=shutil.ignore_patterns("*.pth"))
        plan = json.loads((half / "plan.json").read_text())
        plan["rows"] = [row]
        plan["runs"] = [run for run in plan["runs"] if run["row"] == row]
        (half / "plan.json").write_text(json.dumps(plan))
        halves.append(half)
    return halves


def test_report_only_joins_work_dirs_into_the_report_of_one(study, tmp_path):
    _, work, out, _, _ = study
    stock_half, ours_half = _split_by_row(work, tmp_path)
    assert ap_parity.main(["--report-only", str(stock_half), str(ours_half), "--out-dir", str(tmp_path / "r")]) == 0
    assert (tmp_path / "r" / "ap_parity.md").read_text() == (out / "ap_parity.md").read_text()


def test_report_only_refuses_work_dirs_that_cannot_share_a_report(study, tmp_path, capsys):
    _, work, _, _, _ = study
    stock_half, ours_half = _split_by_row(work, tmp_path)
    with pytest.raises(SystemExit):
        ap_parity.main(["--report-only", str(stock_half), str(work)])
    assert f"run demo__stock-fp32__seed{STUDY_SEED} is in {str(stock_half)!r} and in {str(work)!r}" in (
        capsys.readouterr().err)
    plan = json.loads((ours_half / "plan.json").read_text())
    plan["schedule"]["iters"] += 1
    (ours_half / "plan.json").write_text(json.dumps(plan))
    with pytest.raises(SystemExit):
        ap_parity.main(["--report-only", str(stock_half), str(ours_half)])
    assert f"{str(ours_half)!r} has another schedule than {str(stock_half)!r}" in capsys.readouterr().err


def _args(*argv):
    return ap_parity.build_parser().parse_args(list(argv))


@pytest.mark.parametrize("argv, visible, message", [
    (["--configs", "ddetr", "yolo"], 1, "--configs: unknown config 'yolo' (known: ddetr, dino, demo)"),
    (["--seeds", "0", "1", "0"], 1, "--seeds: 0 given more than once"),
    (["--rows", "stock:fp32", "stock:fp32"], 1, "--rows: stock:fp32 given more than once"),
    (["--device", "cpu", "--rows", "stock:fp32", "ours:bf16"], 0,
     "--rows ours:bf16: mixed precision (bf16) needs --device cuda (the training scripts' AMP runs on CUDA)"),
    (["--gpus", "0,3"], 2, "--gpus: GPU 3 is not available (2 visible: 0-1)"),
    ([], 0, "--device cuda, but no CUDA device is visible here (use --device cpu for a CPU run)"),
    (["--deadline", "60"], 1, "--deadline 60 leaves no time to train: it must exceed the 85 s kept for evaluation "
                              "and the report"),
    (["--val-images", "0"], 1, "--val-images 0 must be at least 1"),
    (["--per-gpu", "0"], 1, "--per-gpu 0 must be at least 1"),
], ids=["config", "seed", "row", "bf16-on-cpu", "gpu-index", "no-gpu", "deadline", "val-images", "per-gpu"])
def test_a_bad_value_is_named(argv, visible, message):
    assert ap_parity.argument_problems(_args(*argv), visible) == [message]


def test_the_defaults_are_valid_on_two_gpus():
    assert ap_parity.argument_problems(_args("--gpus", "0,1"), visible_gpus=2) == []
