"""Whether a long training run holds: throughput, reserved device memory, graphs and losses late in the run against
the same at iteration 500.

A run's iteration timer records, per iteration, its host seconds, the memory the caching allocator reserved at its
end and the graphs captured so far, and counts on the device the iterations whose loss was NaN or inf. For a run of
at least :data:`MIN_ITERS` iterations, :func:`long_run_figures` compares the iterations before
:data:`REFERENCE_ITER` (the reference window) with the run's last ones: a graph pool that keeps growing, a slowdown
or a non-finite loss shows there. :func:`long_run_lines` is the report's table and :func:`plot_long_runs` its PNG.
"""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import List, Optional, Sequence

REFERENCE_ITER = 500
WINDOW = 100
MIN_ITERS = REFERENCE_ITER + WINDOW
SMOOTHING = 25  # iterations per point of the plot's ms/iter line


def _window(entries: Sequence[dict], first: int, last: int) -> List[dict]:
    return [e for e in entries if first <= e["iteration"] <= last]


def _mean_ms(entries: Sequence[dict]) -> Optional[float]:
    seconds = [e["seconds"] for e in entries if e.get("seconds") is not None]
    return 1000 * statistics.fmean(seconds) if seconds else None


def _at(entries: Sequence[dict], iteration: int, key: str):
    found = [e.get(key) for e in entries if e["iteration"] == iteration]
    return found[0] if found else None


def long_run_figures(timing: dict) -> Optional[dict]:
    """The figures of one row's timing summary, or None for a run shorter than :data:`MIN_ITERS` iterations."""
    entries = timing.get("per_iteration") or []
    last = max((e["iteration"] for e in entries), default=0)
    if last < MIN_ITERS:
        return None
    reference = _window(entries, REFERENCE_ITER - WINDOW + 1, REFERENCE_ITER)
    end = _window(entries, last - WINDOW + 1, last)
    reference_ms, end_ms = _mean_ms(reference), _mean_ms(end)
    later_reserved = [e["reserved_mib"] for e in _window(entries, REFERENCE_ITER + 1, last)
                      if e.get("reserved_mib") is not None]
    return dict(
        iterations=last, reference_window=[REFERENCE_ITER - WINDOW + 1, REFERENCE_ITER],
        end_window=[last - WINDOW + 1, last], reference_ms=reference_ms, end_ms=end_ms,
        end_over_reference_throughput=(reference_ms / end_ms if reference_ms and end_ms else None),
        reserved_mib_at_reference=_at(entries, REFERENCE_ITER, "reserved_mib"),
        reserved_mib_at_end=_at(entries, last, "reserved_mib"),
        reserved_mib_max_after_reference=max(later_reserved) if later_reserved else None,
        graphs_at_reference=_at(entries, REFERENCE_ITER, "graphs"), graphs_at_end=_at(entries, last, "graphs"),
        losses_checked=timing.get("losses_checked"), nonfinite_losses=timing.get("nonfinite_losses"))


def _fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def long_run_lines(rows: Sequence[dict]) -> List[str]:
    """Markdown lines: one table row per metrics row that carries ``long_run`` figures; [] where none does."""
    long_rows = [m for m in rows if m.get("long_run")]
    if not long_rows:
        return []
    first = long_rows[0]["long_run"]
    lines = ["", f"Long runs: iterations {first['reference_window'][0]}-{first['reference_window'][1]} against the "
                 f"last {WINDOW} (mean ms per iteration, host clock), device memory reserved by the caching "
                 "allocator, graphs captured, iterations whose loss was NaN or inf (counted on the device):", "",
             "| config | GPUs | row | iterations | ms/iter at the reference | ms/iter at the end | throughput end / "
             "reference | reserved MiB at the reference | at the end (max after the reference) | graphs at the "
             "reference | at the end | non-finite losses (of checked) |",
             "|---|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for m in long_rows:
        f = m["long_run"]
        lines.append(
            f"| {m['config']} | {m.get('gpus', 1)} | {m['row']} | {f['iterations']} | {_fmt(f['reference_ms'])} "
            f"| {_fmt(f['end_ms'])} | {_fmt(f['end_over_reference_throughput'], '.3f')} "
            f"| {_fmt(f['reserved_mib_at_reference'], '.0f')} | {_fmt(f['reserved_mib_at_end'], '.0f')} "
            f"({_fmt(f['reserved_mib_max_after_reference'], '.0f')}) | {_fmt(f['graphs_at_reference'], 'd')} "
            f"| {_fmt(f['graphs_at_end'], 'd')} | {_fmt(f['nonfinite_losses'], 'd')} "
            f"({_fmt(f['losses_checked'], 'd')}) |")
    return lines


def plot_long_runs(results: Sequence[dict], path: Path) -> Optional[str]:
    """A PNG of reserved MiB and smoothed ms/iter against the iteration, one line per long row; None where no row
    ran :data:`MIN_ITERS` iterations."""
    from ..common import plot_lines
    memory, times = {}, {}
    for result in results:
        entries = (result.get("timing") or {}).get("per_iteration") or []
        if len(entries) < MIN_ITERS:
            continue
        label = f"{Path(result['config']).stem} {result['row']}"
        memory[label] = [(e["iteration"], e.get("reserved_mib")) for e in entries if e.get("reserved_mib")]
        times[label] = []
        for start in range(1, len(entries) + 1, SMOOTHING):
            chunk = _window(entries, start, start + SMOOTHING - 1)
            times[label].append((start + SMOOTHING // 2, _mean_ms(chunk)))
    if not memory and not times:
        return None
    panels = [dict(series=memory, xlabel="iteration", ylabel="reserved MiB", xlog=False, ylog=False,
                   vline=REFERENCE_ITER),
              dict(series=times, xlabel="iteration", ylabel=f"ms/iter (mean of {SMOOTHING})", xlog=False,
                   ylog=True, vline=REFERENCE_ITER)]
    return plot_lines(path, panels, title="long runs")
