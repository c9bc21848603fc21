"""``ParityRunHook``: what the AP parity tool (:mod:`.ap_parity`) needs from inside each training run.

- A start that does not wait for the initial weights: ``wait_for`` (the run's ``load_from``) may be written while
  the run starts; ``before_run``, which mmengine calls before it loads ``load_from``, waits for the file.
- A wall-clock limit: once training has run ``time_limit_s`` seconds, or the clock passes ``stop_at`` (seconds
  since the epoch, the tool's deadline), the iteration that just ended becomes the last: the loop then validates
  and saves its checkpoint as at a planned end. The result records that the run stopped early, and where.
- Pacing: with ``pace_file``, after each iteration the run waits while its iteration count has reached the file's
  ``limit`` (the tool keeps it a few iterations ahead of the slowest run of the config), so that fast runs leave
  the GPU to the slow ones instead of finishing first.
- A schedule decided during the run: with ``schedule_file``, the file's ``iters``, ``milestone`` and
  ``val_interval``, once it appears, become the loop's last iteration, the step of every ``MultiStepLR`` and the
  validation interval (the tool writes it before any run of the config reaches either point).
- Progress: ``status_file`` is rewritten every ``status_every_s`` seconds (iteration, planned iterations, seconds
  of training), for the tool's progress lines and its pacing.
- The result: ``result_file`` gets every evaluation's metrics as the evaluator returned them, the iterations run,
  the seconds of training (the evaluations during training left out) and of each evaluation.

The hook reads the host clock (and the small pace and schedule files) after each iteration and never synchronises
the device. A stock run imports it without deform_plugin (:mod:`deform_plugin.benchmarks.stock_process`)::

    custom_imports = dict(imports=['deform_plugin.benchmarks.detector.parity_hook'], allow_failed_imports=False)
    custom_hooks = [dict(type='ParityRunHook', result_file='run/parity.json', time_limit_s=300)]
"""
from __future__ import annotations

import json
import math
import os
import time
from collections import Counter
from pathlib import Path
from typing import Callable, List, Optional

from mmengine.dist import is_main_process
from mmengine.hooks import Hook
from mmengine.logging import print_log
from mmengine.registry import HOOKS


def write_json_atomically(path: Path, data: dict) -> None:
    """Write ``data`` so that a reader never sees half a file (a temporary file renamed into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(data, indent=1))
    os.replace(temporary, path)


def read_json(path: Optional[Path]) -> Optional[dict]:
    """The JSON in ``path``, or None where there is none (yet)."""
    if path is None:
        return None
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def _plain(value):
    """A metric as JSON can hold it (numpy scalars and tensors to float; NaN and inf kept as floats)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def _schedulers(runner) -> list:
    schedulers = getattr(runner, "param_schedulers", None) or []
    if isinstance(schedulers, dict):
        return [s for group in schedulers.values() for s in group]
    return list(schedulers)


@HOOKS.register_module()
class ParityRunHook(Hook):
    """Stop training gracefully at a wall-clock limit, pace the run, take a schedule decided during the run, report
    progress, and record the run's evaluations.

    Args:
        result_file: the JSON written at the end of the run (and after each evaluation).
        status_file: the JSON rewritten during training for progress lines and pacing; None writes none.
        time_limit_s: seconds of training (from the first iteration's start) after which training stops; None for
            no limit.
        stop_at: a time (seconds since the epoch) after which training stops; None for none.
        status_every_s: seconds between rewrites of ``status_file``.
        wait_for: a file to wait for in ``before_run`` (written whole, by a rename); None waits for nothing.
        wait_timeout_s: how long to wait for it before failing the run.
        pace_file: a JSON ``{"limit": N}``: the run waits after iteration N until the limit grows; None: no pacing.
        pace_timeout_s: a pace file unchanged for this long is ignored from then on (its writer is gone).
        schedule_file: a JSON ``{"iters", "milestone", "val_interval"}`` to apply once it appears; None: none.
        label: a name carried into the files (the run).
        clock: seconds since the epoch; ``time.time`` unless a test passes its own.
    """

    # First among an iteration's hooks: the loop's new end is seen by every hook after it (the logger and the
    # deferred runtime info flush, the checkpoint's save_last) as a planned last iteration.
    priority = "HIGHEST"

    def __init__(self, result_file: str, status_file: Optional[str] = None, time_limit_s: Optional[float] = None,
                 stop_at: Optional[float] = None, status_every_s: float = 5.0, wait_for: Optional[str] = None,
                 wait_timeout_s: float = 900.0, pace_file: Optional[str] = None, pace_timeout_s: float = 120.0,
                 schedule_file: Optional[str] = None, label: Optional[str] = None,
                 clock: Optional[Callable[[], float]] = None) -> None:
        if time_limit_s is not None and not time_limit_s > 0:
            raise ValueError(f"time_limit_s must be positive or None, not {time_limit_s!r}")
        self.result_file = Path(result_file)
        self.status_file = Path(status_file) if status_file else None
        self.time_limit_s = time_limit_s
        self.stop_at = stop_at
        self.status_every_s = float(status_every_s)
        self.wait_for = Path(wait_for) if wait_for else None
        self.wait_timeout_s = float(wait_timeout_s)
        self.pace_file = Path(pace_file) if pace_file else None
        self.pace_timeout_s = float(pace_timeout_s)
        self.schedule_file = Path(schedule_file) if schedule_file else None
        self.label = label
        self.clock = clock or time.time
        self._started: Optional[float] = None
        self._last_iteration_end: Optional[float] = None
        self._planned: Optional[int] = None
        self._iterations = 0
        self._stopped_early: Optional[str] = None
        self._last_status = -math.inf
        self._evaluations: List[dict] = []
        self._val_started: Optional[float] = None
        self._schedule: Optional[dict] = None
        self._paced_seconds = 0.0

    def _deadline(self) -> Optional[float]:
        limits = [t for t in (self.stop_at, None if self.time_limit_s is None or self._started is None
                              else self._started + self.time_limit_s) if t is not None]
        return min(limits) if limits else None

    def before_run(self, runner) -> None:
        if self.wait_for is None or self.wait_for.is_file():
            return
        print_log(f"ParityRunHook: waiting for {self.wait_for}", logger="current")
        waited_from = self.clock()
        while not self.wait_for.is_file():
            if self.clock() - waited_from > self.wait_timeout_s:
                raise RuntimeError(f"{self.wait_for} did not appear within {self.wait_timeout_s:.0f} s")
            time.sleep(0.2)
        print_log(f"ParityRunHook: {self.wait_for} appeared after {self.clock() - waited_from:.1f} s",
                  logger="current")

    def before_train(self, runner) -> None:
        self._started = self.clock()
        self._planned = int(runner.max_iters)
        self._write_status(runner, force=True)

    def after_train_iter(self, runner, batch_idx: int, data_batch=None, outputs=None) -> None:
        self._iterations = batch_idx + 1
        self._last_iteration_end = self.clock()
        self._take_schedule(runner)
        self._stop_if_late(runner, self._last_iteration_end)
        self._write_status(runner, force=self._stopped_early is not None)
        self._pace(runner)

    def _stop_if_late(self, runner, now: float) -> None:
        deadline = self._deadline()
        if deadline is None or now < deadline or self._iterations >= runner.train_loop.max_iters:
            return
        # IterBasedTrainLoop ends when its counter reaches _max_iters, validating there as at a planned end.
        runner.train_loop._max_iters = self._iterations
        by_limit = self.time_limit_s is not None and now >= self._started + self.time_limit_s
        self._stopped_early = f"time limit of {self.time_limit_s:g} s" if by_limit else "the tool's deadline"
        print_log(f"ParityRunHook: stopping after iteration {self._iterations} of {self._planned}: "
                  f"{self._stopped_early} ({now - self._started:.0f} s of training)", logger="current")

    def _take_schedule(self, runner) -> None:
        """Apply the schedule file once it appears (the loop's end, MultiStepLR's step, the validation interval)."""
        if self._schedule is not None or self.schedule_file is None:
            return
        schedule = read_json(self.schedule_file)
        if schedule is None:
            return
        self._schedule = schedule
        iters = max(int(schedule["iters"]), self._iterations)
        loop = runner.train_loop
        loop._max_iters = iters
        loop.val_interval = int(schedule["val_interval"])
        loop.dynamic_intervals = [loop.val_interval]  # the loop resets val_interval from these every iteration
        for scheduler in _schedulers(runner):
            if hasattr(scheduler, "milestones"):
                scheduler.milestones = Counter([int(schedule["milestone"])])
        self._planned = iters
        print_log(f"ParityRunHook: schedule at iteration {self._iterations}: {iters} iterations, learning rate "
                  f"step at {schedule['milestone']}, validation every {loop.val_interval}", logger="current")

    def _pace(self, runner) -> None:
        """Wait while this run is at its config's pace limit (not after its last iteration, nor past its
        deadline, nor on a pace file that stopped changing)."""
        if self.pace_file is None or self._iterations >= runner.train_loop.max_iters:
            return
        waited_from = last_change = self.clock()
        limit = None
        while True:
            pace = read_json(self.pace_file)
            now = self.clock()
            if pace is None or self._iterations < int(pace["limit"]):
                break
            if pace["limit"] != limit:
                limit, last_change = pace["limit"], now
            if now - last_change > self.pace_timeout_s:
                print_log(f"ParityRunHook: {self.pace_file} unchanged for {self.pace_timeout_s:.0f} s: pacing off",
                          logger="current")
                self.pace_file = None
                break
            deadline = self._deadline()
            if deadline is not None and now >= deadline:
                break
            self._take_schedule(runner)
            time.sleep(0.05)
        self._paced_seconds += self.clock() - waited_from

    def before_val_epoch(self, runner) -> None:
        self._val_started = self.clock()

    def after_val_epoch(self, runner, metrics=None) -> None:
        seconds = None if self._val_started is None else self.clock() - self._val_started
        self._evaluations.append(dict(iteration=int(runner.iter), seconds=seconds,
                                      metrics={k: _plain(v) for k, v in (metrics or {}).items()}))
        self._write_result(runner)

    def after_train(self, runner) -> None:
        self._write_status(runner, force=True, done=True)
        self._write_result(runner)

    def summary(self) -> dict:
        # Seconds of training: from the first iteration's start to the last one's end, less the evaluations between
        # and the waits for the pace.
        evaluating = sum(e["seconds"] or 0.0 for e in self._evaluations if e["iteration"] < self._iterations)
        train_seconds = (None if self._started is None or self._last_iteration_end is None
                         else self._last_iteration_end - self._started - evaluating - self._paced_seconds)
        return dict(label=self.label, planned_iterations=self._planned, iterations=self._iterations,
                    stopped_early=self._stopped_early, train_seconds=train_seconds,
                    paced_seconds=self._paced_seconds, schedule=self._schedule, time_limit_s=self.time_limit_s,
                    stop_at=self.stop_at, evaluations=list(self._evaluations))

    def _write_result(self, runner) -> None:
        if is_main_process():
            write_json_atomically(self.result_file, self.summary())

    def _write_status(self, runner, force: bool = False, done: bool = False) -> None:
        now = self.clock()
        if self.status_file is None or not is_main_process() or (not force
                                                                 and now - self._last_status < self.status_every_s):
            return
        self._last_status = now
        write_json_atomically(self.status_file, dict(
            label=self.label, iteration=self._iterations, planned_iterations=self._planned,
            max_iterations=int(runner.train_loop.max_iters), seconds=now - (self._started or now),
            stopped_early=self._stopped_early, done=done, time=now))
