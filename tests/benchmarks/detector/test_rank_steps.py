"""deform_plugin.benchmarks.detector.rank_steps: the communication estimate and each rank's wait, scaling against one
GPU, and the report's multi-GPU tables."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from deform_plugin.benchmarks.detector import rank_steps


def test_the_smallest_all_reduce_is_the_communication_and_each_ranks_excess_its_wait():
    communication, waits = rank_steps.communication_and_waits([6.0, 1.0, 2.5])
    assert communication == 1.0 and waits == [5.0, 0.0, 1.5]
    assert rank_steps.communication_and_waits([0.75]) == (0.75, [0.0])  # one rank waits for no one
    with pytest.raises(ValueError, match="got none"):
        rank_steps.communication_and_waits([])


def _record(step, compute_ms, all_reduce_ms, step_ms):
    return dict(step=step, compute_ms=compute_ms, all_reduce_ms=all_reduce_ms, step_ms=step_ms)


# Two ranks, five steps. Step 1 (outside the window below) is huge; step 3 reduced nothing (gradient accumulation);
# rank 1 has no record of step 5 (its figures ended early): the window's figures use steps 2 and 4.
TWO_RANKS = dict(world_size=2, clock="cuda events", ranks=[
    [_record(1, 900.0, 900.0, 2000.0), _record(2, 40.0, 6.0, 50.0), _record(3, None, None, 45.0),
     _record(4, 44.0, 3.0, 52.0), _record(5, 1.0, 1.0, 3.0)],
    [_record(1, 900.0, 900.0, 2000.0), _record(2, 45.0, 1.0, 50.0), _record(3, None, None, 47.0),
     _record(4, 42.0, 4.0, 52.0)],
])


def test_rank_figures_are_means_over_the_windows_steps_that_every_rank_reduced():
    figures = rank_steps.rank_step_figures(TWO_RANKS, (2, 5))
    assert figures["steps"] == 2 and figures["clock"] == "cuda events"
    # Per step: communication min(6, 1) = 1 and min(3, 4) = 3; waits (5, 0) and (0, 1).
    assert figures["communication_ms"] == pytest.approx(2.0)
    assert figures["ranks"] == [
        dict(rank=0, compute_ms=pytest.approx(42.0), all_reduce_ms=pytest.approx(4.5), wait_ms=pytest.approx(2.5),
             step_ms=pytest.approx(51.0)),
        dict(rank=1, compute_ms=pytest.approx(43.5), all_reduce_ms=pytest.approx(2.5), wait_ms=pytest.approx(0.5),
             step_ms=pytest.approx(51.0))]
    assert rank_steps.rank_step_figures(TWO_RANKS, (3, 3)) is None  # no reduction there
    assert rank_steps.rank_step_figures(None, (1, 5)) is None
    assert rank_steps.rank_step_figures(dict(world_size=0, clock="host", ranks=[]), (1, 5)) is None


def test_the_median_step_is_of_replayed_iterations_where_graphs_replay():
    graphed = [dict(iteration=1, seconds=9.0, kind="eager"), dict(iteration=2, seconds=0.5, kind="capture"),
               dict(iteration=3, seconds=0.06, kind="replay"), dict(iteration=4, seconds=0.05, kind="replay")]
    assert rank_steps.median_step_ms(graphed, (2, 4)) == pytest.approx(55.0)
    stock = [dict(iteration=i, seconds=s, kind=None) for i, s in enumerate([9.0, 0.2, 0.1, 0.3], start=1)]
    assert rank_steps.median_step_ms(stock, (2, 4)) == pytest.approx(200.0)
    assert rank_steps.median_step_ms(graphed, (1, 2)) is None  # only a warm-up and a capture


def _rows():
    one = dict(config="c.py", row="ours:bf16", gpus=1, steady_img_s=20.0, median_step_ms=100.0)
    two = dict(config="c.py", row="ours:bf16", gpus=2, steady_img_s=36.0, median_step_ms=125.0,
               rank_steps=rank_steps.rank_step_figures(TWO_RANKS, (2, 5)))
    alone = dict(config="d.py", row="ours:bf16", gpus=4, steady_img_s=50.0, median_step_ms=90.0)
    return [one, two, alone]


def test_scaling_compares_each_row_with_the_same_row_on_one_gpu():
    rows = _rows()
    rank_steps.add_scaling(rows)
    one, two, alone = rows
    assert "scaling_img_s" not in one
    assert two["scaling_img_s"] == pytest.approx(1.8) and two["scaling_per_step"] == pytest.approx(1.6)  # 2*100/125
    assert (two["one_gpu_img_s"], two["one_gpu_step_ms"]) == (20.0, 100.0)
    assert alone["scaling_img_s"] is None and alone["scaling_per_step"] is None  # no one-GPU row of d.py


def test_the_multi_gpu_tables_show_scaling_and_each_ranks_step():
    rows = _rows()
    rank_steps.add_scaling(rows)
    lines = rank_steps.multi_gpu_tables(rows, (2, 5))
    assert "| c.py | ours:bf16 | 2 | 36.00 | 20.00 | 1.80x | 125.0 ms | 100.0 ms | 1.60x |" in lines
    assert "| d.py | ours:bf16 | 4 | 50.00 | - | - | 90.0 ms | - | - |" in lines
    assert any("CUDA events on each rank's compute stream" in line for line in lines)
    header = next(line for line in lines if line.startswith("| config | row | GPUs | rank |"))
    assert header.endswith("| wait for slower ranks | communication (est.) | step |")
    assert lines[-3:] == ["| c.py | ours:bf16 | 2 | 0 | 2 | 42.00 | 4.50 | 2.50 | | 51.00 |",
                          "| c.py | ours:bf16 | 2 | 1 | 2 | 43.50 | 2.50 | 0.50 | | 51.00 |",
                          "| c.py | ours:bf16 | 2 | mean | 2 | 42.75 | 3.50 | 1.50 | 2.00 | 51.00 |"]
    assert rank_steps.multi_gpu_tables(rows[:1], (2, 5)) == []  # one GPU only: no such tables
    untimed = [dict(rows[1], rank_steps=None)]
    assert "another model wrapper" in rank_steps.multi_gpu_tables(untimed, (2, 5))[-1]


def test_the_report_of_a_run_on_one_and_two_gpus(tmp_path):
    from deform_plugin.benchmarks.detector import train_report
    from deform_plugin.benchmarks.detector.train_overlay import Settings
    settings = Settings(iters=5, first_iters=1, steady_start=2)

    def result(gpus, img_per_s, seconds, data_parallel_steps=None):
        per_iteration = [dict(iteration=i, seconds=seconds, kind="replay") for i in range(1, 6)]
        timing = dict(windows=[dict(first=2, last=5, img_per_s=img_per_s, ms_per_iter=1000 * seconds)],
                      per_iteration=per_iteration, data_parallel_steps=data_parallel_steps, device_name="cpu",
                      cuda=None)
        return dict(config="/configs/c.py", row="ours:bf16", gpus=gpus, status="ok", timing=timing)

    results = [result(1, 20.0, 0.1), result(2, 32.0, 0.125, TWO_RANKS)]
    report = train_report.summarize(results, settings, SimpleNamespace(root=tmp_path, num_images=4, seed=0))
    one, two = report["rows"]
    assert (one["speedup"], two["speedup"]) == (1.0, 1.0)  # each against the first row on as many GPUs
    assert two["scaling_img_s"] == pytest.approx(1.6) and two["scaling_per_step"] == pytest.approx(1.6)
    assert (two["communication_ms"], two["rank_wait_ms"]) == (pytest.approx(2.0), pytest.approx(1.5))
    assert report["settings"]["gpus"] == [1, 2]
    text = train_report.markdown(report)
    assert "| c.py | 2 | ours:bf16 | ok | 32.00 |" in text
    assert "| c.py | ours:bf16 | 2 | 32.00 | 20.00 | 1.60x | 125.0 ms | 100.0 ms | 1.60x |" in text
    assert "| c.py | ours:bf16 | 2 | mean | 2 | 42.75 | 3.50 | 1.50 | 2.00 | 51.00 |" in text
