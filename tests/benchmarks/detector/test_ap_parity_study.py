"""deform_plugin.benchmarks.detector.ap_parity_study: how the runs are dealt to GPUs, the pace and the schedule decided
during the run (on status files written by the test), and the deadline ending runs that sleep through it."""
from __future__ import annotations

import json
import sys
import time

import pytest

from deform_plugin.benchmarks.detector import ap_parity, ap_parity_study
from deform_plugin.benchmarks.detector.ap_parity_config import PARITY_CONFIGS, Schedule, prepare_data
from deform_plugin.benchmarks.detector.parity_hook import write_json_atomically
from deform_plugin.benchmarks.detector.train_overlay import parse_row


def test_runs_are_dealt_to_gpus_slowest_rows_first():
    rows = [parse_row(r) for r in ("ours:bf16", "stock:fp32", "ours:bf16:no-buckets", "ours:fp32")]
    configs = [PARITY_CONFIGS["ddetr"], PARITY_CONFIGS["dino"]]
    runs = ap_parity_study.plan_runs(configs, rows, [0, 1, 2], [0, 1])
    assert [r.row.label for r in runs[:6]] == ["stock:fp32"] * 6
    assert [r.row.label for r in runs[6:12]] == ["ours:bf16:no-buckets"] * 6
    assert runs[0].name == "ddetr__stock-fp32__seed0"
    for gpu in (0, 1):
        mine = [r for r in runs if r.gpu == gpu]
        assert len(mine) == 12
        assert sum(r.row.stock for r in mine) == 3 and sum(not r.row.buckets for r in mine) == 3
        assert {r.config.name for r in mine if r.row.stock} == {"ddetr", "dino"}
    assert {r.gpu for r in ap_parity_study.plan_runs(configs, rows, [0], None)} == {None}

def test_the_deadline_ends_the_runs_and_the_report_names_them(tmp_path, monkeypatch, capsys):
    """Runs that sleep through the deadline: the one running is killed, the one waiting never starts, and the
    report is written with both named."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    monkeypatch.setattr(ap_parity_study, "EVAL_RESERVE_S", 1.0)
    monkeypatch.setattr(ap_parity_study, "REPORT_RESERVE_S", 2.0)
    monkeypatch.setattr(ap_parity_study, "row_command", lambda row, overlay, work_dir: sleeper)
    monkeypatch.setattr(ap_parity_study, "start_initial_weights",
                        lambda *args: ap_parity_study.launch(sleeper, tmp_path / "init.log", {}))
    started = time.perf_counter()
    status = ap_parity.main(["--device", "cpu", "--configs", "demo", "--rows", "stock:fp32", "ours:fp32", "--seeds",
                             "0", "--iters", "3", "--warmup-iters", "1", "--scales", "96", "--test-scale", "96",
                             "--per-gpu", "1", "--deadline", "6", "--work-dir", str(tmp_path / "work")])
    assert status == 1 and time.perf_counter() - started < 30
    records = {r["row"]: r for r in json.loads((tmp_path / "work" / "report" / "ap_parity.json").read_text())["runs"]}
    assert (records["stock:fp32"]["status"], records["ours:fp32"]["status"]) == ("killed", "not started")
    out = capsys.readouterr().out
    assert "1 runs not started: too late to train before the deadline" in out
    assert "killed: demo stock:fp32 seed 0: 0/3 it" in out
    assert "seed 0 killed at 0/3 it" in out and "seed 0 not started at 0/3 it" in out

@pytest.mark.parametrize("slowest, fastest, rate, expected", [
    (100, 108, 2.0, dict(iters=630, milestone=504, val_interval=315)),  # 0.9 x (100 + 2 it/s x 300 s)
    (100, 108, 0.1, dict(iters=226, milestone=181, val_interval=113)),  # at least twice the fastest run's iteration
    (100, 108, 100.0, dict(iters=3000, milestone=2400, val_interval=1500)),  # at most --max-iters
], ids=["fits", "floor", "cap"])
def test_the_decided_schedule(slowest, fastest, rate, expected):
    schedule = Schedule(iters=3000, auto=True, warmup_iters=50)
    decided = ap_parity_study.decide_schedule(slowest, fastest, rate, seconds_left=320.0, schedule=schedule)
    assert {k: decided[k] for k in expected} == expected

def test_the_pace_follows_the_slowest_run_and_the_schedule_is_decided_once(tmp_path, monkeypatch, capsys):
    """The tool's side of pacing and --iters auto, on status files written here (no training)."""
    monkeypatch.setattr(ap_parity_study, "CALIBRATE_S", 10.0)
    args = ap_parity.build_parser().parse_args(
        ["--device", "cpu", "--configs", "demo", "--rows", "stock:fp32", "ours:fp32", "--seeds", "0", "--iters",
         "auto", "--max-iters", "1000", "--warmup-iters", "20", "--deadline", "400", "--work-dir", str(tmp_path)])
    # Training stops at 400 - 85 = 315 s.
    study = ap_parity_study.Study(args, ap_parity.schedule_from(args), visible_gpus=0, started=0.0)
    assert study.pacing and study.schedule.auto
    data = prepare_data(None, None, tmp_path, generate=False)
    study.plan = study.plan_record(data, 128)
    files = {run.name: ap_parity_study.run_files(tmp_path, run) for run in study.runs}
    running = [ap_parity_study.Child(run, None, 0.0, None) for run in study.runs]
    stock, ours = (files[child.run.name] for child in running)

    def at(now, stock_iteration, ours_iteration):
        for status, iteration in ((stock.status, stock_iteration), (ours.status, ours_iteration)):
            write_json_atomically(status, dict(iteration=iteration))
        study._pace(running, files, now)
        return json.loads(study.pace_file(PARITY_CONFIGS["demo"]).read_text())["limit"]

    assert at(100.0, 5, 15) == 15  # the slowest run's iteration + PACE_SLACK
    assert at(102.0, 25, 35) == 35
    assert not study.schedule_file(PARITY_CONFIGS["demo"]).exists()  # 25 >= warm-up + 5, but not yet for 10 s
    assert at(112.0, 45, 55) == 55  # 20 iterations in 10 s: 2 it/s
    decided = json.loads(study.schedule_file(PARITY_CONFIGS["demo"]).read_text())
    projected = 45 + 2.0 * (315 - 112 - ap_parity_study.MID_EVAL_S)
    assert decided["iters"] == int(projected * ap_parity_study.AUTO_SAFETY) // 10 * 10
    assert json.loads((tmp_path / "plan.json").read_text())["configs"][0]["schedule"] == decided
    at(130.0, 80, 90)
    assert json.loads(study.schedule_file(PARITY_CONFIGS["demo"]).read_text()) == decided  # decided once
    assert "demo: schedule: " in capsys.readouterr().out
