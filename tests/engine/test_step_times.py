"""deform_plugin.engine.step_times: each step's compute, all-reduce and whole milliseconds from its marks (host clock
here; CUDA events where there is a GPU)."""
import pytest
import torch

from deform_plugin.engine.step_times import StepTimes


class StepClock:
    """Host seconds that move only when the test says."""

    def __init__(self):
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


def _step(times, clock, compute_s, reduce_s=None, rest_s=0.0):
    times.start()
    clock.now += compute_s
    if reduce_s is not None:
        times.mark("gradients_ready")
        clock.now += reduce_s
        times.mark("reduced")
    clock.now += rest_s
    times.end()


def test_each_step_splits_into_compute_all_reduce_and_the_whole_step():
    clock = StepClock()
    times = StepTimes("cpu", clock=clock)
    assert not times.uses_events
    _step(times, clock, compute_s=0.05, reduce_s=0.002, rest_s=0.008)
    _step(times, clock, compute_s=0.04)  # an accumulation step: no reduction
    _step(times, clock, compute_s=0.03, reduce_s=0.01, rest_s=0.005)
    records = times.records()
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[0] == pytest.approx(dict(step=1, compute_ms=50.0, all_reduce_ms=2.0, step_ms=60.0))
    assert records[1] == dict(step=2, compute_ms=None, all_reduce_ms=None, step_ms=pytest.approx(40.0))
    assert records[2] == pytest.approx(dict(step=3, compute_ms=30.0, all_reduce_ms=10.0, step_ms=45.0))


def test_a_step_that_never_ended_is_dropped_and_marks_outside_a_step_are_ignored():
    clock = StepClock()
    times = StepTimes("cpu", clock=clock)
    times.mark("gradients_ready")  # a reduction called on its own, outside any train step
    times.end()
    times.start()  # this train step raises before its end
    clock.now += 1.0
    _step(times, clock, compute_s=0.02, reduce_s=0.001)
    assert times.records() == [pytest.approx(dict(step=2, compute_ms=20.0, all_reduce_ms=1.0, step_ms=21.0))]


def test_an_unknown_mark_is_refused_by_name():
    with pytest.raises(ValueError, match="'backward_done' is not one of gradients_ready, reduced"):
        StepTimes("cpu").mark("backward_done")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events need a CUDA device")
def test_cuda_steps_are_timed_by_events_and_read_back_once_complete():
    times = StepTimes("cuda")
    assert times.uses_events
    x = torch.randn(2048, 2048, device="cuda")
    for _ in range(3):
        times.start()
        y = x @ x
        times.mark("gradients_ready")
        y += 1
        times.mark("reduced")
        times.end()
    records = times.records()
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert record["compute_ms"] > 0 and record["all_reduce_ms"] >= 0
        assert record["compute_ms"] + record["all_reduce_ms"] <= record["step_ms"] + 1e-3
