"""deform_plugin.benchmarks.detector.train_report: the CSV, the table's columns and the ramp-up ratios."""
from __future__ import annotations

import csv

import pytest



def test_the_csv_appends_rows_and_sets_a_file_of_other_columns_aside(tmp_path):
    from deform_plugin.benchmarks.detector import train_report
    windows = dict(first=(1, 1), all=(1, 3), steady=(2, 3))
    row = train_report.row_metrics(dict(config="c.py", row="ours:fp32", status="ok"), windows)
    row.update(steady_img_s=1.5, batch_shapes=4)
    machine = dict(device="cpu", cuda=None, torch="torch ?", triton="triton ?", mmcv="mmcv ?", mmengine="mmengine ?",
                   mmdet="mmdet ?", python="3", commit="abc")
    report = dict(timestamp="2026-11-26T12:00:00", machine=machine, rows=[row], results=[],
                  settings=dict(iters=3, batch_size=2, workers=1, windows={k: list(v) for k, v in windows.items()}),
                  source=dict(images=4, seed=0))
    (tmp_path / "train_benchmark.csv").write_text("timestamp,row,img_s\n2026-01-01,stock:fp32,1.0\n")
    train_report.write_reports(report, tmp_path)
    train_report.write_reports(report, tmp_path)
    with open(tmp_path / "train_benchmark.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["row"], r["steady_img_s"], r["batch_shapes"]) for r in rows] == [("ours:fp32", "1.5", "4")] * 2
    older = list(tmp_path.glob("train_benchmark.*.older-columns.csv"))
    assert len(older) == 1 and "stock:fp32,1.0" in older[0].read_text()


def test_the_table_shows_reserved_memory_and_signatures_that_ran_eagerly():
    from deform_plugin.benchmarks.detector import train_report
    windows = dict(first=(1, 1), all=(1, 3), steady=(2, 3))
    timing = dict(windows=[dict(first=2, last=3, img_per_s=4.0, ms_per_iter=500.0)], peak_allocated_mib=9681.4,
                  peak_reserved_mib=61234.0, graphed_training=dict(captures=9, capture_seconds=1.62, eager_calls=30,
                                                                   replays=40, fallbacks=7))
    row = train_report.row_metrics(dict(config="c.py", row="ours:fp32", status="ok", timing=timing), windows)
    assert (row["peak_reserved_mib"], row["graph_captures"], row["graph_fallbacks"]) == (61234.0, 9, 7)
    machine = dict(device="cpu", cuda=None, torch="torch ?", triton="triton ?", mmcv="mmcv ?", mmengine="mmengine ?",
                   mmdet="mmdet ?", python="3", commit="abc")
    report = dict(machine=machine, rows=[row], results=[],
                  settings=dict(iters=3, batch_size=2, workers=1, windows={k: list(v) for k, v in windows.items()}),
                  source=dict(images=4, seed=0))
    table_row = train_report.markdown(report).splitlines()[-1]
    assert "| 9 (1.6 s; 7 eager) |" in table_row and "| 9681 (61234) |" in table_row
    row.update(graph_fallbacks=0)
    assert "| 9 (1.6 s) |" in train_report.markdown(report).splitlines()[-1]
    timing["graphed_training"]["capture_phase_seconds"] = dict(forward=0.7, backward=0.8, instantiate=0.2)
    row = train_report.row_metrics(dict(config="c.py", row="ours:fp32", status="ok", timing=timing), windows)
    report["rows"] = [row]
    assert ("| 9 (1.6 s: forward 0.7, backward 0.8, of which instantiation 0.2; 7 eager) |"
            in train_report.markdown(report).splitlines()[-1])


def test_the_ramp_up_column_is_the_first_100_iterations_of_a_longer_run():
    from deform_plugin.benchmarks.detector import train_report
    windows = dict(first=(1, 20), first_100=(1, 100), all=(1, 250), steady=(151, 250))
    timing = dict(windows=[dict(first=1, last=100, img_per_s=15.0, ms_per_iter=133.3),
                           dict(first=1, last=250, img_per_s=24.0, ms_per_iter=83.3),
                           dict(first=151, last=250, img_per_s=37.5, ms_per_iter=53.3)])
    row = train_report.row_metrics(dict(config="c.py", row="ours:bf16", status="ok", timing=timing), windows)
    assert row["first_100_over_steady"] == pytest.approx(0.4) and row["all_over_steady"] == pytest.approx(0.64)
    machine = dict(device="cpu", cuda=None, torch="torch ?", triton="triton ?", mmcv="mmcv ?", mmengine="mmengine ?",
                   mmdet="mmdet ?", python="3", commit="abc")
    report = dict(machine=machine, rows=[row], results=[],
                  settings=dict(iters=250, batch_size=2, workers=1, windows={k: list(v) for k, v in windows.items()}),
                  source=dict(images=4, seed=0))
    lines = train_report.markdown(report).splitlines()
    header = next(line for line in lines if line.startswith("| config |"))
    assert "| img/s it 1-100 |" in header and "| 1-100 / steady |" in header
    assert "| 37.50 | 53.3 | 15.00 | - | 0.40 |" in next(line for line in lines if "| ours:bf16 |" in line)
