"""deform_plugin.benchmarks.detector.long_run: a long run's late throughput, memory, graphs and losses against
iteration 500's, from the timing hook's per-iteration records."""
from __future__ import annotations

import pytest

from deform_plugin.benchmarks.detector.long_run import (
    MIN_ITERS,
    long_run_figures,
    long_run_lines,
    plot_long_runs,
)


def _timing(iterations, seconds_before=0.05, seconds_after=0.06, growth_mib=0.0):
    entries = [dict(iteration=i, seconds=seconds_before if i <= 500 else seconds_after,
                    reserved_mib=1000.0 + (growth_mib * (i - 500) if i > 500 else 0.0),
                    graphs=min(i // 50, 12)) for i in range(1, iterations + 1)]
    return dict(per_iteration=entries, losses_checked=iterations, nonfinite_losses=0)


def test_a_run_too_short_for_the_windows_has_no_figures():
    assert long_run_figures(_timing(MIN_ITERS - 1)) is None
    assert long_run_figures(dict(per_iteration=[])) is None


def test_late_throughput_memory_and_graphs_are_compared_with_iteration_500s():
    figures = long_run_figures(_timing(2000, growth_mib=0.5))
    assert figures["reference_window"] == [401, 500] and figures["end_window"] == [1901, 2000]
    assert figures["reference_ms"] == pytest.approx(50.0) and figures["end_ms"] == pytest.approx(60.0)
    assert figures["end_over_reference_throughput"] == pytest.approx(50 / 60)
    assert figures["reserved_mib_at_reference"] == 1000.0
    assert figures["reserved_mib_at_end"] == figures["reserved_mib_max_after_reference"] == 1750.0
    assert (figures["graphs_at_reference"], figures["graphs_at_end"]) == (10, 12)
    assert (figures["nonfinite_losses"], figures["losses_checked"]) == (0, 2000)


def test_the_report_table_and_plot_name_each_long_row(tmp_path):
    timing = _timing(700)
    rows = [dict(config="a.py", gpus=1, row="ours:bf16", long_run=long_run_figures(timing)),
            dict(config="a.py", gpus=1, row="stock:fp32", long_run=None)]
    lines = long_run_lines(rows)
    assert len(lines) == 6 and lines[-1].startswith("| a.py | 1 | ours:bf16 | 700 | 50.0 | 60.0 | 0.833 | 1000 |")
    assert long_run_lines(rows[1:]) == []
    results = [dict(config="configs/a.py", row="ours:bf16", timing=timing),
               dict(config="configs/a.py", row="stock:fp32", timing=_timing(100))]
    path = plot_long_runs(results, tmp_path / "long.png")
    assert path is not None and (tmp_path / "long.png").stat().st_size > 0
    assert plot_long_runs(results[1:], tmp_path / "none.png") is None
