"""deform_plugin.benchmarks.detector.parity_hook: the time limit ends a real mmengine loop gracefully (validation and
checkpoint at the new last iteration), a schedule file changes a real loop's end, learning rate step and validations,
pacing, progress and result files, and the wait for the initial weights."""
from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from mmengine.evaluator import BaseMetric
from mmengine.model import BaseModel
from mmengine.runner import Runner
from torch.utils.data import Dataset

from deform_plugin.benchmarks.detector.parity_hook import ParityRunHook


class ToyModel(BaseModel):
    """One linear layer; each training step takes ``step_s`` seconds, so that a time limit falls mid-run."""

    def __init__(self, step_s: float = 0.0):
        super().__init__()
        self.linear = torch.nn.Linear(2, 1)
        self.step_s = step_s

    def forward(self, inputs, labels=None, mode="tensor"):
        out = self.linear(inputs)  # default_collate stacked the batch
        if mode == "loss":
            time.sleep(self.step_s)
            return dict(loss=((out.squeeze(1) - labels) ** 2).mean())
        return [dict(pred=o) for o in out]


class ToyData(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        return dict(inputs=torch.tensor([float(index), 1.0]), labels=torch.tensor(float(index)))


class ToyMetric(BaseMetric):
    def process(self, data_batch, data_samples):
        self.results.extend(data_samples)

    def compute_metrics(self, results):
        return dict(images=float(len(results)))


def toy_runner(tmp_path, hook: ParityRunHook, max_iters: int, step_s: float, param_scheduler=None) -> Runner:
    loader = dict(dataset=ToyData(), batch_size=2, num_workers=0, collate_fn=dict(type="default_collate"))
    return Runner(param_scheduler=param_scheduler,
        model=ToyModel(step_s), work_dir=str(tmp_path / "work"),
        train_dataloader=dict(loader, sampler=dict(type="InfiniteSampler", shuffle=False)),
        val_dataloader=dict(loader, sampler=dict(type="DefaultSampler", shuffle=False)),
        val_evaluator=dict(type=ToyMetric), val_cfg=dict(),
        train_cfg=dict(by_epoch=False, max_iters=max_iters, val_interval=max_iters),
        optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.01)),
        default_hooks=dict(checkpoint=dict(type="CheckpointHook", by_epoch=False, interval=max_iters, save_last=True,
                                           save_optimizer=False)),
        custom_hooks=[hook], log_level="WARNING")


def test_time_limit_stops_the_loop_which_still_validates_and_saves(tmp_path):
    result, status = tmp_path / "parity.json", tmp_path / "status.json"
    hook = ParityRunHook(result_file=str(result), status_file=str(status), time_limit_s=0.25, label="toy")
    runner = toy_runner(tmp_path, hook, max_iters=200, step_s=0.05)
    runner.train()
    record = json.loads(result.read_text())
    done = record["iterations"]
    assert 1 <= done < 200 and runner.iter == done
    assert record["planned_iterations"] == 200 and record["stopped_early"] == "time limit of 0.25 s"
    assert record["train_seconds"] >= 0.25
    # The loop validated after its new last iteration, as at a planned end, and saved that iteration's checkpoint.
    assert [e["iteration"] for e in record["evaluations"]] == [done]
    assert record["evaluations"][0]["metrics"] == {"images": 8.0}
    assert (tmp_path / "work" / f"iter_{done}.pth").is_file()
    final = json.loads(status.read_text())
    assert final["done"] and final["iteration"] == done and final["max_iterations"] == done


def test_a_run_within_its_limits_trains_every_iteration(tmp_path):
    result = tmp_path / "parity.json"
    hook = ParityRunHook(result_file=str(result), time_limit_s=300, stop_at=time.time() + 300)
    toy_runner(tmp_path, hook, max_iters=6, step_s=0.0).train()
    record = json.loads(result.read_text())
    assert (record["iterations"], record["stopped_early"]) == (6, None)
    assert [e["iteration"] for e in record["evaluations"]] == [6]


def test_the_tools_deadline_is_named_when_it_stops_the_run(tmp_path):
    result = tmp_path / "parity.json"
    hook = ParityRunHook(result_file=str(result), time_limit_s=300, stop_at=time.time() + 0.2)
    toy_runner(tmp_path, hook, max_iters=200, step_s=0.05).train()
    assert json.loads(result.read_text())["stopped_early"] == "the tool's deadline"


def test_before_run_waits_for_the_initial_weights(tmp_path):
    weights = tmp_path / "seed0.pth"
    hook = ParityRunHook(result_file=str(tmp_path / "p.json"), wait_for=str(weights))
    writer = threading.Timer(0.3, weights.write_bytes, args=(b"weights",))
    writer.start()
    started = time.perf_counter()
    hook.before_run(runner=None)
    assert time.perf_counter() - started >= 0.25 and weights.is_file()
    writer.join()


def test_a_missing_initial_weights_file_fails_the_run_after_the_timeout(tmp_path):
    hook = ParityRunHook(result_file=str(tmp_path / "p.json"), wait_for=str(tmp_path / "never.pth"),
                         wait_timeout_s=0.2)
    with pytest.raises(RuntimeError, match="never.pth did not appear within 0 s"):
        hook.before_run(runner=None)


def test_a_time_limit_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="time_limit_s must be positive or None, not 0"):
        ParityRunHook(result_file=str(tmp_path / "p.json"), time_limit_s=0)


def test_a_schedule_file_sets_the_end_the_learning_rate_step_and_the_validations(tmp_path):
    schedule = tmp_path / "schedule.json"
    schedule.write_text(json.dumps(dict(iters=20, milestone=12, val_interval=10)))
    result = tmp_path / "parity.json"
    hook = ParityRunHook(result_file=str(result), schedule_file=str(schedule))
    runner = toy_runner(tmp_path, hook, max_iters=100, step_s=0.0,
                        param_scheduler=dict(type="MultiStepLR", by_epoch=False, milestones=[80], gamma=0.1))
    runner.train()
    record = json.loads(result.read_text())
    assert (record["iterations"], record["planned_iterations"], record["stopped_early"]) == (20, 20, None)
    assert [e["iteration"] for e in record["evaluations"]] == [10, 20]
    assert runner.optim_wrapper.get_lr()["lr"] == [pytest.approx(0.001)]  # stepped /10 at 12, not at 80
    assert record["schedule"] == dict(iters=20, milestone=12, val_interval=10)


def paced_runner(max_iters=100):
    loop = SimpleNamespace(max_iters=max_iters, _max_iters=max_iters)
    return SimpleNamespace(train_loop=loop, max_iters=max_iters, param_schedulers=[])


def test_a_paced_run_waits_at_its_limit_until_the_limit_grows(tmp_path):
    pace = tmp_path / "pace.json"
    pace.write_text(json.dumps(dict(limit=3)))
    hook = ParityRunHook(result_file=str(tmp_path / "p.json"), pace_file=str(pace))
    runner = paced_runner()
    hook.before_train(runner)
    started = time.perf_counter()
    hook.after_train_iter(runner, batch_idx=1)  # iteration 2: below the limit, no wait
    assert time.perf_counter() - started < 0.2
    raiser = threading.Timer(0.3, pace.write_text, args=(json.dumps(dict(limit=5)),))
    raiser.start()
    hook.after_train_iter(runner, batch_idx=2)  # iteration 3: waits until the limit is 5
    raiser.join()
    assert time.perf_counter() - started >= 0.25
    assert hook.summary()["paced_seconds"] >= 0.25


def test_pacing_stops_when_its_file_stops_changing_or_at_the_deadline(tmp_path):
    pace = tmp_path / "pace.json"
    pace.write_text(json.dumps(dict(limit=1)))
    hook = ParityRunHook(result_file=str(tmp_path / "p.json"), pace_file=str(pace), pace_timeout_s=0.2)
    runner = paced_runner()
    hook.before_train(runner)
    hook.after_train_iter(runner, batch_idx=0)
    assert hook.pace_file is None  # ignored from now on
    late = ParityRunHook(result_file=str(tmp_path / "q.json"), pace_file=str(pace), stop_at=time.time() + 0.2)
    late.before_train(runner)
    started = time.perf_counter()
    late.after_train_iter(runner, batch_idx=0)
    assert 0.15 <= time.perf_counter() - started < 2
