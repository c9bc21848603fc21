"""A steady-state profile of training inside mmengine's own loop: a ``StepProfilerHook`` for ``custom_hooks``.

``tools/profile_step.py`` profiles a fixed-size step in its own loop; this hook profiles the iterations a user's run
makes (the Runner, the config's pipeline, DDP where launched), after their warm-up: iterations ``first`` to
``first + steps - 1``, on every rank. Each rank writes into ``out_dir``:

- ``profile_rank{R}.txt``: the wall time of the profiled iterations, then the operators by host (self CPU) time
  and by device time (``torch.profiler``'s ``key_averages`` tables);
- ``trace_rank{R}.json.gz``: the Chrome trace of the same iterations (``chrome://tracing`` or Perfetto open it).

The profiler adds host overhead to every operator it records: compare profiled rows with each other, and take
speeds from unprofiled runs. Usable from any config (a stock run imports it without deform_plugin through
:mod:`deform_plugin.benchmarks.stock_process`)::

    custom_imports = dict(imports=['deform_plugin.benchmarks.detector.step_profiler'], allow_failed_imports=False)
    custom_hooks = [dict(type='StepProfilerHook', first=151, steps=3, out_dir='profiles')]
"""
from __future__ import annotations

import gzip
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional, Tuple

import torch
from mmengine.dist import get_rank
from mmengine.hooks import Hook
from mmengine.logging import print_log
from mmengine.registry import HOOKS

TABLE_ROWS = 40


@HOOKS.register_module()
class StepProfilerHook(Hook):
    """Profile training iterations ``first`` to ``first + steps - 1`` (1-based) with ``torch.profiler``.

    Args:
        first: the first profiled iteration (after the warm-up: new shapes, captures, compiles).
        steps: how many iterations are profiled.
        out_dir: where each rank writes its tables and trace (default: ``<work_dir>/step_profile``).
    """

    priority = "LOWEST"  # around every other hook's work of the profiled iterations

    def __init__(self, first: int, steps: int = 3, out_dir: Optional[str] = None):
        if not (isinstance(first, int) and isinstance(steps, int) and first >= 1 and steps >= 1):
            raise ValueError(f"StepProfilerHook needs first >= 1 and steps >= 1 (ints), got first={first!r}, "
                             f"steps={steps!r}")
        self.first, self.steps, self.out_dir = first, steps, out_dir
        self._profiler = None
        self._started = 0.0

    @property
    def last(self) -> int:
        return self.first + self.steps - 1

    def before_train_iter(self, runner, batch_idx: int, data_batch=None) -> None:
        if runner.iter + 1 != self.first:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._profiler = start_profiler(torch.cuda.is_available())
        self._started = time.perf_counter()

    def after_train_iter(self, runner, batch_idx: int, data_batch=None, outputs=None) -> None:
        if self._profiler is None or runner.iter + 1 != self.last:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - self._started) * 1000 / self.steps
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        out_dir = Path(self.out_dir if self.out_dir is not None else os.path.join(runner.work_dir, "step_profile"))
        self.write(profiler, out_dir, get_rank(), wall_ms)
        print_log(f"StepProfilerHook: iterations {self.first}-{self.last} profiled ({wall_ms:.1f} ms per iteration "
                  f"under the profiler); wrote {out_dir}", logger="current")

    def write(self, profiler, out_dir: Path, rank: int, wall_ms: float) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        by_host, by_device = operator_tables(profiler, torch.cuda.is_available())
        lines = [f"rank {rank}: iterations {self.first}-{self.last}, {wall_ms:.1f} ms per iteration (wall, under "
                 "the profiler)", "", "By host time (self CPU):", by_host]
        if by_device is not None:
            lines += ["", "By device time:", by_device]
        (out_dir / f"profile_rank{rank}.txt").write_text("\n".join(lines) + "\n")
        with tempfile.TemporaryDirectory() as scratch:
            trace = Path(scratch) / "trace.json"
            profiler.export_chrome_trace(str(trace))
            with open(trace, "rb") as source, gzip.open(out_dir / f"trace_rank{rank}.json.gz", "wb") as target:
                shutil.copyfileobj(source, target)


def start_profiler(cuda: bool):
    """A ``torch.profiler.profile`` of host operators (and, with ``cuda``, device kernels), already entered."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(activities=activities)
    profiler.__enter__()
    return profiler


def operator_tables(profiler, cuda: bool, rows: int = TABLE_ROWS) -> Tuple[str, Optional[str]]:
    """``(by host time, by device time)``: a stopped ``profiler``'s operators, its ``key_averages`` tables sorted by
    self CPU time and, with ``cuda``, by self device time (None without)."""
    averages = profiler.key_averages()
    device_key = next((key for key in ("self_device_time_total", "self_cuda_time_total")
                       if cuda and _sortable(averages, key)), None)
    by_host = averages.table(sort_by="self_cpu_time_total", row_limit=rows)
    return by_host, None if device_key is None else averages.table(sort_by=device_key, row_limit=rows)


def _sortable(averages, key: str) -> bool:
    """Whether ``key_averages().table`` can sort by ``key`` in this torch (the device column was renamed)."""
    try:
        averages.table(sort_by=key, row_limit=1)
    except (AttributeError, KeyError, ValueError):
        return False
    return True
