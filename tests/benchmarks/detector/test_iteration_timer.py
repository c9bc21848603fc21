"""deform_plugin.benchmarks.detector.iteration_timer: the timing hook's windows, compile and shape counts, and what
graphed training did, on a fake runner."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from deform_plugin.benchmarks.detector.iteration_timer import IterationTimerHook


class FakeClock:
    """Seconds that advance only when the test says; counts how often the hook read it."""

    def __init__(self):
        self.now, self.reads = 100.0, 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now


def run_fake_training(hook, iterations, seconds_per_iter=0.5, images_per_iter=2, tmp_path=None):
    runner = SimpleNamespace(iter=0, work_dir=str(tmp_path), model=None, optim_wrapper=None)
    hook.before_train(runner)
    for batch_idx in range(iterations):
        hook.clock.now += seconds_per_iter
        hook.after_train_iter(runner, batch_idx, data_batch=dict(inputs=[None] * images_per_iter))
    hook.after_train(runner)
    return runner


def test_timer_windows_sync_only_at_boundaries(tmp_path):
    clock = FakeClock()
    out = tmp_path / "timing.json"
    hook = IterationTimerHook(windows=[(1, 2), (1, 6), (4, 6), (5, 9)], warmup_iters=2, out_file=str(out),
                              clock=clock)
    run_fake_training(hook, iterations=6, tmp_path=tmp_path)
    assert hook.boundaries == [0, 2, 3, 4, 6, 9]
    # Window marks (each with a device sync on a GPU) before training and after iterations 2, 3, 4 and 6 (9 is
    # never reached); every iteration's end is read once more, without a sync.
    assert sorted(hook._marks) == [0, 2, 3, 4, 6]
    assert clock.reads == 5 + 6
    result = json.loads(out.read_text())
    windows = {(w["first"], w["last"]): w for w in result["windows"]}
    assert windows[(1, 2)]["images"] == 4 and windows[(1, 2)]["seconds"] == pytest.approx(1.0)
    assert windows[(1, 6)]["img_per_s"] == pytest.approx(12 / 3.0)
    assert windows[(4, 6)]["img_per_s"] == pytest.approx(6 / 1.5)
    assert windows[(4, 6)]["ms_per_iter"] == pytest.approx(500.0)
    assert windows[(5, 9)]["img_per_s"] is None and windows[(5, 9)]["seconds"] is None
    assert (result["iterations_run"], result["images_run"]) == (6, 12)


def test_timer_counts_our_compiles_and_checks_the_plugin(tmp_path):
    import deform_plugin  # noqa: F401
    hook = IterationTimerHook(windows=[(1, 2)], warmup_iters=1, out_file=str(tmp_path / "t.json"),
                              expect_plugin=True, clock=FakeClock())
    run_fake_training(hook, iterations=2, tmp_path=tmp_path)
    result = json.loads((tmp_path / "t.json").read_text())
    assert result["deform_plugin_loaded"] is True
    assert set(result["compiled_variants_end"]) >= {"msda_forward", "msda_backward"}
    assert result["compiled_after_warmup"] == result["compiled_total"] - sum(
        result["compiled_variants_after_warmup"].values())
    stock_hook = IterationTimerHook(windows=[(1, 1)], expect_plugin=False, clock=FakeClock())
    with pytest.raises(RuntimeError, match="must stay stock"):
        stock_hook.before_train(SimpleNamespace(iter=0))


def _timed_batches(tmp_path, model, sizes):
    """The timing hook's result after one batch of images of each ``sizes`` entry."""
    runner = SimpleNamespace(iter=0, work_dir=str(tmp_path), model=model, optim_wrapper=None)
    hook = IterationTimerHook(windows=[(1, 3)], warmup_iters=1, out_file=str(tmp_path / "t.json"), clock=FakeClock())
    hook.before_train(runner)
    for batch_idx, batch in enumerate(sizes):
        images = [torch.zeros(3, h, w, dtype=torch.uint8) for h, w in batch]
        hook.after_train_iter(runner, batch_idx, data_batch=dict(inputs=images))
    hook.after_train(runner)
    return json.loads((tmp_path / "t.json").read_text())


def test_timer_counts_padded_batch_shapes_and_pixels(tmp_path):
    model, wrapper = torch.nn.Module(), torch.nn.Module()  # the wrapper stands for DDP's
    model.data_preprocessor = SimpleNamespace(pad_size_divisor=32)
    wrapper.module = model
    sizes = [[(40, 60), (30, 70)], [(64, 64), (50, 50)], [(33, 65), (10, 10)]]  # padded: 64x96, 64x64, 64x96
    result = _timed_batches(tmp_path, wrapper, sizes)
    assert (result["batch_shapes"], result["batch_shapes_after_warmup"]) == (2, 1)
    image_pixels = sum(h * w for batch in sizes for h, w in batch)
    assert result["padded_over_image_pixels"] == pytest.approx(2 * (64 * 96 + 64 * 64 + 64 * 96) / image_pixels)
    assert [e["shape"] for e in result["per_iteration"]] == [[64, 96], [64, 64], [64, 96]]
    assert [e["run_shape"] for e in result["per_iteration"]] == [None] * 3


def test_timer_counts_the_pixels_of_the_shape_a_batch_ran_at(tmp_path):
    model = torch.nn.Module()
    # ShapeBucketsHook's further padding (a borrowed shape, the ranks' common one) leaves the shape it ran at here.
    model.data_preprocessor = SimpleNamespace(pad_size_divisor=32, deform_plugin_training_shape=(96, 128))
    sizes = [[(40, 60), (30, 70)]]  # its own padding: 64x96
    result = _timed_batches(tmp_path, model, sizes)
    image_pixels = sum(h * w for batch in sizes for h, w in batch)
    assert result["padded_over_image_pixels"] == pytest.approx(2 * 96 * 128 / image_pixels)
    assert [(e["shape"], e["run_shape"]) for e in result["per_iteration"]] == [([64, 96], [96, 128])]


def test_timer_counts_the_fixed_size_pad_of_lsj_configs(tmp_path):
    from mmdet.models.data_preprocessors import BatchFixedSizePad
    model = torch.nn.Module()
    model.data_preprocessor = SimpleNamespace(pad_size_divisor=32, batch_augments=[BatchFixedSizePad(size=(96, 128))])
    sizes = [[(40, 60), (30, 70)], [(96, 128), (50, 50)], [(33, 65), (10, 10)], [(100, 40), (20, 20)]]
    result = _timed_batches(tmp_path, model, sizes)
    # Every batch padded to 96x128, except the one with a taller image (128x128 after the divisor).
    assert (result["batch_shapes"], result["batch_shapes_after_warmup"]) == (2, 1)
    image_pixels = sum(h * w for batch in sizes for h, w in batch)
    assert result["padded_over_image_pixels"] == pytest.approx(2 * (3 * 96 * 128 + 128 * 128) / image_pixels)


def test_timer_reports_the_graph_captures_of_graphed_training(tmp_path):
    region = SimpleNamespace(captured={"a": 1, "b": 2}, capture_seconds=1.5, eager_calls=3, replays=7,
                             eager_reasons={"c": "too many"}, first_call_captures=1,
                             first_call_capture_failures={"d": "cudnn.benchmark"},
                             capture_phase_seconds=dict(forward=0.5, backward=0.75, instantiate=0.25))
    other = SimpleNamespace(captured={"e": 3}, capture_seconds=0.5, eager_calls=0, replays=1, eager_reasons={},
                            first_call_captures=0, first_call_capture_failures={},
                            capture_phase_seconds=dict(forward=0.25, backward=0.25, instantiate=0.125))
    detector, second = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    detector.graphed_training_region, second.graphed_training_region = region, other
    model = torch.nn.Sequential(detector, second)
    result = _timed_batches(tmp_path, model, [[(32, 32)]])
    assert result["graphed_training"] == dict(
        captures=3, capture_seconds=2.0, capture_phase_seconds=dict(forward=0.75, backward=1.0, instantiate=0.375),
        eager_calls=3, replays=8, fallbacks=1, first_call_captures=1, first_call_capture_failures=1)
    assert _timed_batches(tmp_path, torch.nn.Linear(2, 2), [[(32, 32)]])["graphed_training"] is None


def test_timer_counts_a_split_detectors_shapes_once_and_all_of_its_capture_time(tmp_path):
    def region(captured, seconds, reports):
        return SimpleNamespace(captured=captured, capture_seconds=seconds, eager_calls=1, replays=4, eager_reasons={},
                               first_call_captures=1, first_call_capture_failures={}, reports_signatures=reports,
                               capture_phase_seconds=dict(forward=seconds / 2, backward=seconds / 2, instantiate=0.0))
    # The backbone's region captures the same two shapes as the transformer's, in 0.5 of the 2 seconds.
    backbone, rest = region({"a": 1, "b": 2}, 0.5, False), region({"a": 1, "b": 2}, 1.5, True)
    detector = torch.nn.Linear(2, 2)
    detector.graphed_training_region, detector.graphed_training_regions = rest, (backbone, rest)
    result = _timed_batches(tmp_path, torch.nn.Sequential(detector), [[(32, 32)]])
    assert result["graphed_training"] == dict(
        captures=2, capture_seconds=2.0, capture_phase_seconds=dict(forward=1.0, backward=1.0, instantiate=0.0),
        eager_calls=1, replays=4, fallbacks=0, first_call_captures=1, first_call_capture_failures=0)


def test_timer_splits_the_run_by_what_graphed_training_did(tmp_path):
    from deform_plugin.benchmarks.detector.train_report import iteration_split, replay_median_ms, split_table
    region = SimpleNamespace(captured={}, capture_seconds=0.0, eager_calls=0, replays=0, eager_reasons={},
                             first_call_captures=0, first_call_capture_failures={}, capture_phase_seconds={})
    detector = torch.nn.Linear(2, 2)
    detector.graphed_training_region = region
    clock = FakeClock()
    hook = IterationTimerHook(windows=[(1, 5)], warmup_iters=1, out_file=str(tmp_path / "t.json"), clock=clock)
    runner = SimpleNamespace(iter=0, work_dir=str(tmp_path), model=torch.nn.Sequential(detector), optim_wrapper=None)
    hook.before_train(runner)
    # iteration: (seconds, what the region did): eager warm-up, eager warm-up of another shape, capture, replays.
    steps = [(2.0, "eager"), (0.5, "eager"), (0.75, "capture"), (0.25, "replay"), (0.125, "replay")]
    for batch_idx, (seconds, kind) in enumerate(steps):
        clock.now += seconds
        if kind == "eager":
            region.eager_calls += 1
        elif kind == "capture":
            region.captured[batch_idx] = object()
            region.replays += 1  # a capture's iteration replays too: it counts as the capture
        else:
            region.replays += 1
        hook.after_train_iter(runner, batch_idx, data_batch=dict(inputs=[None, None]))
    hook.after_train(runner)
    result = json.loads((tmp_path / "t.json").read_text())
    assert [(e["iteration"], e["kind"]) for e in result["per_iteration"]] == [
        (1, "eager"), (2, "eager"), (3, "capture"), (4, "replay"), (5, "replay")]
    assert [e["seconds"] for e in result["per_iteration"]] == pytest.approx([s for s, _ in steps])
    split = iteration_split(result["per_iteration"], (1, 5))
    assert split == dict(first=dict(iterations=1, seconds=2.0), eager=dict(iterations=1, seconds=0.5),
                         capture=dict(iterations=1, seconds=0.75), replay=dict(iterations=2, seconds=0.375))
    assert iteration_split(result["per_iteration"], (4, 5)) == dict(replay=dict(iterations=2, seconds=0.375))
    assert replay_median_ms(result["per_iteration"], (1, 5)) == pytest.approx(187.5)  # (250 + 125) / 2
    assert replay_median_ms(result["per_iteration"], (2, 4)) == pytest.approx(250.0)
    assert replay_median_ms(result["per_iteration"], (1, 3)) is None  # no replay there
    table = split_table([dict(config="c.py", row="ours:bf16", split=split, steady_replay_median_ms=187.5)], (1, 5),
                        (4, 5))
    assert table[-3].endswith("| replay | other | replay median, it 4-5 |")
    assert table[-1] == ("| c.py | 1 | ours:bf16 | 1, 2.00 s, 2000 | 1, 0.50 s, 500 | 1, 0.75 s, 750 | 2, 0.38 s, 188 "
                         "| - | 187.5 ms |")
    # Stock training (no graphed region): every iteration after the first is "other".
    stock = IterationTimerHook(windows=[(1, 3)], out_file=str(tmp_path / "s.json"), clock=FakeClock())
    run_fake_training(stock, iterations=3, tmp_path=tmp_path)
    stock_split = iteration_split(json.loads((tmp_path / "s.json").read_text())["per_iteration"], (1, 3))
    assert stock_split == dict(first=dict(iterations=1, seconds=0.5), other=dict(iterations=2, seconds=1.0))


def test_timer_rejects_bad_windows():
    with pytest.raises(ValueError, match=r"window \(3, 2\)"):
        IterationTimerHook(windows=[(3, 2)])


def test_timer_turns_on_the_wrappers_step_times_and_writes_them_per_rank(tmp_path):
    from deform_plugin.engine.step_times import StepTimes
    clock = FakeClock()

    class TimedWrapper(torch.nn.Module):  # stands for FlatGradientsDataParallel
        step_times = None

        def enable_step_times(self):
            self.step_times = StepTimes("cpu", clock=clock)
            return self.step_times

    wrapper = TimedWrapper()
    hook = IterationTimerHook(windows=[(1, 2)], warmup_iters=1, out_file=str(tmp_path / "t.json"), clock=clock)
    runner = SimpleNamespace(iter=0, work_dir=str(tmp_path), model=wrapper, optim_wrapper=None)
    hook.before_train(runner)
    assert wrapper.step_times is not None  # on before the first step
    for batch_idx, (compute_s, reduce_s) in enumerate([(0.25, 0.125), (0.5, 0.0625)]):
        wrapper.step_times.start()
        clock.now += compute_s
        wrapper.step_times.mark("gradients_ready")
        clock.now += reduce_s
        wrapper.step_times.mark("reduced")
        wrapper.step_times.end()
        hook.after_train_iter(runner, batch_idx, data_batch=dict(inputs=[None]))
    hook.after_train(runner)
    result = json.loads((tmp_path / "t.json").read_text())
    # One process: the gathered ranks are this one's figures alone.
    assert result["data_parallel_steps"] == dict(world_size=1, clock="host", ranks=[[
        dict(step=1, compute_ms=250.0, all_reduce_ms=125.0, step_ms=375.0),
        dict(step=2, compute_ms=500.0, all_reduce_ms=62.5, step_ms=562.5)]])
    stock = IterationTimerHook(windows=[(1, 1)], out_file=str(tmp_path / "s.json"), clock=FakeClock())
    run_fake_training(stock, iterations=1, tmp_path=tmp_path)  # a model without step times: nothing gathered
    assert json.loads((tmp_path / "s.json").read_text())["data_parallel_steps"] is None


def test_timer_counts_the_iterations_whose_loss_was_not_finite(tmp_path):
    out = tmp_path / "timing.json"
    hook = IterationTimerHook(windows=[(1, 4)], warmup_iters=1, out_file=str(out), clock=FakeClock())
    runner = SimpleNamespace(iter=0, work_dir=str(tmp_path), model=None, optim_wrapper=None)
    hook.before_train(runner)
    losses = [torch.tensor(1.0), torch.tensor(float("nan")), 2.5, torch.tensor(float("inf")), None]
    for batch_idx, loss in enumerate(losses):
        outputs = None if loss is None else dict(loss=loss, loss_cls=torch.tensor(0.5))
        hook.after_train_iter(runner, batch_idx, data_batch=dict(inputs=[None, None]), outputs=outputs)
    hook.after_train(runner)
    result = json.loads(out.read_text())
    assert (result["nonfinite_losses"], result["losses_checked"]) == (2, 4)
    # On a CPU no memory is reserved, and without graphed training no graphs are counted.
    assert [(e["reserved_mib"], e["graphs"]) for e in result["per_iteration"]] == [(None, None)] * 5
