"""Where a data-parallel training step's time goes, per rank: compute, the gradient all-reduce, the whole step.

:class:`StepTimes` marks four moments of each step: its start, the gradients ready for reduction, the reduction done
(as the compute stream sees it) and the step's end. On a CUDA device each mark is an event recorded on the current
stream: recording launches nothing and waits for nothing, and a finished step's events are read back at a later
step's start, and only once its last event has completed (``Event.query``, which does not block), so the step keeps
no host sync and no mark falls inside a CUDA-graph capture (a graphed region captures within the forward, between
the start and the gradients-ready marks). On the CPU (gloo, whose all-reduce returns when it is done) the marks are
host clock readings.

The all-reduce as the compute stream sees it holds two things: the transfer itself, and the time a rank that
finished its backward early waits for the last one to arrive. :mod:`deform_plugin.benchmarks.detector.rank_steps`
separates them across the ranks' figures.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable, Deque, Dict, List, Optional, Tuple

import torch

# The marks of a step, in the order the step passes them.
MARKS = ("start", "gradients_ready", "reduced", "end")


class StepTimes:
    """The milliseconds of each training step's compute, gradient all-reduce and whole, without host syncs.

    A step is what runs between :meth:`start` and :meth:`end`; :meth:`mark` records ``gradients_ready`` and
    ``reduced`` in between (a step without a reduction, under gradient accumulation, has neither). A step that
    starts before the last one ended (its train step raised) replaces it.

    Args:
        device: where the steps run: CUDA events on the current stream for a CUDA device, the host clock otherwise.
        clock: host seconds as a float (``time.perf_counter`` unless a test passes its own).
    """

    def __init__(self, device, clock: Optional[Callable[[], float]] = None):
        self.uses_events = torch.device(device).type == "cuda"
        self.clock = clock or time.perf_counter
        self._read: List[dict] = []
        self._ended: Deque[Tuple[int, Dict[str, object]]] = deque()  # steps whose figures are not read yet
        self._open: Optional[Tuple[int, Dict[str, object]]] = None
        self._steps_started = 0
        self._spare_events: List[torch.cuda.Event] = []

    def start(self) -> None:
        """A new step starts (the first is step 1); the figures of ended steps whose events completed are read."""
        self._read_ended(wait=False)
        if self._open is not None:
            self._recycle(self._open[1])
        self._steps_started += 1
        self._open = (self._steps_started, {"start": self._now()})

    def mark(self, name: str) -> None:
        """Record ``name`` (``gradients_ready`` or ``reduced``) in the open step; nothing outside a step (a
        reduction called on its own)."""
        if name not in MARKS[1:-1]:
            raise ValueError(f"mark {name!r} is not one of {', '.join(MARKS[1:-1])}")
        if self._open is not None:
            self._open[1][name] = self._now()

    def end(self) -> None:
        """The open step ends (nothing where none is open)."""
        if self._open is None:
            return
        self._open[1]["end"] = self._now()
        self._ended.append(self._open)
        self._open = None

    def records(self) -> List[dict]:
        """Every ended step's figures, in step order (this waits for the device to finish the last ones):
        ``step`` (1-based), ``compute_ms`` (start to gradients ready), ``all_reduce_ms`` (gradients ready to
        reduced, as the compute stream sees it) and ``step_ms`` (start to end); ``compute_ms`` and
        ``all_reduce_ms`` are None in a step that reduced nothing."""
        self._read_ended(wait=True)
        return list(self._read)

    # -- internals --------------------------------------------------------------------------------------------------
    def _now(self):
        if not self.uses_events:
            return self.clock()
        event = self._spare_events.pop() if self._spare_events else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _milliseconds(self, first, last) -> float:
        return first.elapsed_time(last) if self.uses_events else 1000.0 * (last - first)

    def _read_ended(self, wait: bool) -> None:
        while self._ended:
            step, marks = self._ended[0]
            if self.uses_events:
                if wait:
                    marks["end"].synchronize()
                elif not marks["end"].query():
                    return  # later steps' events cannot have completed either (one stream, in order)
            reduced = "gradients_ready" in marks and "reduced" in marks
            self._read.append(dict(
                step=step,
                compute_ms=self._milliseconds(marks["start"], marks["gradients_ready"]) if reduced else None,
                all_reduce_ms=self._milliseconds(marks["gradients_ready"], marks["reduced"]) if reduced else None,
                step_ms=self._milliseconds(marks["start"], marks["end"])))
            self._ended.popleft()
            self._recycle(marks)

    def _recycle(self, marks: Dict[str, object]) -> None:
        if self.uses_events:
            self._spare_events.extend(marks.values())
