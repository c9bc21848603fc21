"""Gradient slots for graphed regions, and FlatGradientsDataParallel: the gradients autograd would give (one
process), the mean of the ranks' gradients (two gloo ranks), and the config-level wiring."""
import copy
import json
from pathlib import Path

import pytest
import torch
from emulated_graphs import EmulatedGraphRegion, SmallNet, forward_backward, small_region
from gloo_ranks import run_gloo_workers
from torch import nn

from deform_plugin.engine.data_parallel import FlatGradientsDataParallel, ParameterGradientSlots

# One pytest-xdist worker runs this whole module, so that its module-scoped fixture (processes) runs once.
pytestmark = pytest.mark.xdist_group("data_parallel")


def _batch(step, rows=4, seed=0):
    generator = torch.Generator().manual_seed(seed + 10 * step)
    return (torch.randn(rows, 6, generator=generator, dtype=torch.float64),
            torch.rand(rows, generator=generator, dtype=torch.float64))


def _trainable_grads(net):
    return [None if p.grad is None else p.grad.clone() for p in net.parameters() if p.requires_grad]


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    """{worker name: its folder}: the three two-rank workers of this file, run in one pair of gloo ranks (spawning a
    pair costs seconds)."""
    return run_gloo_workers((_wrapper_worker, _train_step_worker, _runner_worker, _step_times_worker,
                             _timing_hook_worker), tmp_path_factory.mktemp("gloo"))


def test_slots_view_one_flat_buffer_per_dtype_in_parameter_order():
    net = SmallNet().double()
    net.b.float()
    slots = ParameterGradientSlots(net.parameters())
    trainable = [p for p in net.parameters() if p.requires_grad]
    assert slots.parameters == trainable
    assert {flat.dtype for flat in slots.flats} == {torch.float32, torch.float64} and len(slots.flats) == 2
    assert all(slots.slot(p).shape == p.shape and slots.slot(p).dtype == p.dtype for p in trainable)
    assert slots.slot(net.frozen.weight) is None
    float64 = [p for p in trainable if p.dtype == torch.float64]
    starts = [slots.slot(p).data_ptr() for p in float64]
    assert starts == sorted(starts) and len(set(starts)) == len(starts)
    assert all(flat.abs().sum() == 0 for flat in slots.flats)


def test_non_contiguous_parameters_get_no_slot():
    module = nn.Module()
    module.weight = nn.Parameter(torch.randn(4, 3).t())
    slots = ParameterGradientSlots(module.parameters())
    assert slots.slot(module.weight) is None and slots.unslotted == [module.weight] and slots.flats == []


def test_gather_moves_eager_gradients_into_the_slots_and_zero_fills_missing_ones():
    net = SmallNet().double()
    slots = ParameterGradientSlots(net.parameters())
    for flat in slots.flats:
        flat.fill_(7.0)  # what a replay of another signature may have left there
    forward_backward(small_region(net), *_batch(0), 0)
    expected = _trainable_grads(net)
    assert expected[-2] is None and expected[-1] is None  # `unused` gets none
    slots.gather()
    for parameter, want in zip([p for p in net.parameters() if p.requires_grad], expected):
        assert parameter.grad is slots.slot(parameter)
        torch.testing.assert_close(parameter.grad, torch.zeros_like(parameter) if want is None else want,
                                   rtol=0, atol=0)


@pytest.mark.parametrize("split", [False, True], ids=["one-region", "two-regions"])
def test_replays_write_gradients_into_slots_without_autograd_accumulation(split):
    torch.manual_seed(0)
    net = SmallNet().double()
    eager_net = copy.deepcopy(net)
    slots = ParameterGradientSlots(net.parameters())
    if split:
        def first(x, scale):
            return (torch.tanh(net.a(x)) * scale[:, None],), None

        def second(hidden):
            return dict(out=net.frozen(net.b(hidden)), flags=[hidden > 0, None]), ("constant", hidden.shape[0])
        regions = [EmulatedGraphRegion(first, net, name="first", gradient_slots=slots,
                                       parameter_filter=lambda n: n.startswith("a.")),
                   EmulatedGraphRegion(second, net, name="second", gradient_slots=slots,
                                       parameter_filter=lambda n: not n.startswith("a."))]

        def call(x, scale):
            (hidden,), _ = regions[0](x, scale)
            return regions[1](hidden)
    else:
        regions = [EmulatedGraphRegion(small_region(net), net, name="slotted", gradient_slots=slots)]
        call = regions[0]
    eager = small_region(eager_net)
    for step in range(4):  # warm-up, capture, replays
        net.zero_grad(set_to_none=True)
        eager_net.zero_grad(set_to_none=True)
        forward_backward(call, *_batch(step), step)
        forward_backward(eager, *_batch(step), step)
        for p, q in zip(net.parameters(), eager_net.parameters()):
            assert (p.grad is None) == (q.grad is None)
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)
                if step >= 1:  # a captured or replayed step: the slot itself is the gradient
                    assert p.grad is slots.slot(p)
    assert all(region.replays == 3 for region in regions)


def test_gradients_accumulated_across_replays_are_summed():
    # Without zero_grad between two backwards (gradient accumulation) a replay must not overwrite what the
    # parameters hold in their slots.
    torch.manual_seed(0)
    net = SmallNet().double()
    eager_net = copy.deepcopy(net)
    slots = ParameterGradientSlots(net.parameters())
    region = EmulatedGraphRegion(small_region(net), net, name="slotted", gradient_slots=slots)
    eager = small_region(eager_net)
    for step in range(2):  # warm-up and capture
        net.zero_grad(set_to_none=True)
        forward_backward(region, *_batch(step), step)
    net.zero_grad(set_to_none=True)
    eager_net.zero_grad(set_to_none=True)
    for step in (2, 3, 4):
        forward_backward(region, *_batch(step), step)
        forward_backward(eager, *_batch(step), step)
    assert region.replays == 4
    for p, q in zip(net.parameters(), eager_net.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)


def _wrapper_worker(rank, out_dir):
    torch.manual_seed(rank)  # different weights on each rank: the wrapper broadcasts rank 0's
    net = SmallNet().double()
    net.register_buffer("running", torch.full((2,), float(rank)))
    wrapper = FlatGradientsDataParallel(net)
    region = EmulatedGraphRegion(small_region(net), net, name="ranked", gradient_slots=wrapper.gradient_slots)
    weights = [p.detach().clone() for p in net.parameters()]
    grads = []
    for step in range(4):
        net.zero_grad(set_to_none=True)
        forward_backward(region, *_batch(step, rows=4 + rank, seed=100 * rank), step)
        wrapper.average_gradients()
        grads.append(_trainable_grads(net))
    torch.save(dict(weights=weights, buffer=net.running.clone(), grads=grads,
                    counts=(region.eager_calls, region.replays)), out_dir / f"rank{rank}.pt")


def test_wrapper_averages_the_ranks_gradients_and_starts_from_rank_0s_weights(gloo_results):
    ranks = [torch.load(gloo_results["_wrapper_worker"] / f"rank{rank}.pt") for rank in range(2)]
    torch.manual_seed(0)
    net = SmallNet().double()
    for rank in ranks:
        assert rank["counts"] == (1, 3)
        assert torch.equal(rank["buffer"], torch.zeros(2))
        for got, want in zip(rank["weights"], net.parameters()):
            assert torch.equal(got, want.detach())
    eager = small_region(net)
    for step in range(4):
        per_rank = []
        for rank in range(2):
            net.zero_grad(set_to_none=True)
            forward_backward(eager, *_batch(step, rows=4 + rank, seed=100 * rank), step)
            per_rank.append(_trainable_grads(net))
        for rank in ranks:
            for got, *expected in zip(rank["grads"][step], *per_rank):
                if all(e is None for e in expected):  # used on no rank: zeros
                    torch.testing.assert_close(got, torch.zeros_like(got), rtol=0, atol=0)
                    continue
                torch.testing.assert_close(got, sum(expected) / 2, rtol=1e-12, atol=1e-12)


def test_wrapper_refuses_a_run_without_a_process_group_and_per_step_buffer_broadcasts():
    with pytest.raises(ValueError, match="process group"):
        FlatGradientsDataParallel(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="broadcast_buffers=True"):
        FlatGradientsDataParallel(nn.Linear(2, 2), broadcast_buffers=True)


def _toy_model():
    """An mmengine model with one linear layer whose loss is the mean squared output (inputs: a batch tensor, or the
    list of samples the default collate gives)."""
    from mmengine.model import BaseModel

    class Toy(BaseModel):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(3, 1).double()

        def forward(self, inputs, data_samples=None, mode="tensor"):
            batch = torch.stack(inputs) if isinstance(inputs, list) else inputs
            return dict(loss=(self.linear(batch) ** 2).mean())

    return Toy()


def _train_step_worker(rank, out_dir):
    # The wrapper's train_step through mmengine's optim wrapper (SGD: the update is lr times the averaged gradient).
    from mmengine.optim import OptimWrapper

    torch.manual_seed(0)
    model = _toy_model()
    wrapper = FlatGradientsDataParallel(model)
    optim = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.5))
    inputs = torch.arange(6, dtype=torch.float64).reshape(2, 3) * (rank + 1)
    log_vars = wrapper.train_step(dict(inputs=inputs), optim)
    torch.save(dict(weight=model.linear.weight.detach().clone(), loss=log_vars["loss"]), out_dir / f"rank{rank}.pt")


def test_wrapper_train_step_updates_every_rank_with_the_mean_gradient(gloo_results):
    ranks = [torch.load(gloo_results["_train_step_worker"] / f"rank{rank}.pt") for rank in range(2)]
    torch.manual_seed(0)
    linear = nn.Linear(3, 1).double()
    start = linear.weight.detach().clone()
    grads = []
    for rank in range(2):
        linear.zero_grad()
        inputs = torch.arange(6, dtype=torch.float64).reshape(2, 3) * (rank + 1)
        (linear(inputs) ** 2).mean().backward()
        grads.append(linear.weight.grad.clone())
    expected = start - 0.5 * (grads[0] + grads[1]) / 2
    for rank in ranks:
        torch.testing.assert_close(rank["weight"], expected, rtol=1e-12, atol=1e-12)
    assert ranks[0]["loss"] != ranks[1]["loss"]  # each rank logs its own loss, as under DDP


def test_fast_paths_hook_takes_the_wrappers_slots_and_none_under_ddp_or_off_cuda():
    from deform_plugin.engine import FastPathsHook

    class FakeWrapper(nn.Module):  # registered below as a model wrapper, with slots
        pass

    hook = FastPathsHook(cuda_graphs=True)
    net = SmallNet().double()
    assert hook._gradient_slots(net) is None  # parameters on the CPU: no graphs to write slots
    assert FastPathsHook()._gradient_slots(net) is None  # cuda_graphs off
    from mmengine.registry import MODEL_WRAPPERS
    MODEL_WRAPPERS.register_module(module=FakeWrapper, force=True)
    try:
        wrapped = FakeWrapper()
        wrapped.module = net
        assert hook._gradient_slots(wrapped) is None  # a wrapper without slots (DistributedDataParallel)
        wrapped.gradient_slots = ParameterGradientSlots(net.parameters())
        assert hook._gradient_slots(wrapped) is wrapped.gradient_slots
    finally:
        MODEL_WRAPPERS._module_dict.pop("FakeWrapper")


def test_the_fast_configs_with_graphed_training_select_the_flat_gradients_wrapper():
    from mmengine.config import Config
    root = Path(__file__).resolve().parents[2]
    for name in ("deformable-detr-refine-twostage_r50_16xb2-50e_coco_deform-plugin-fast.py",
                 "dino-4scale_r50_8xb2-12e_coco_deform-plugin-fast.py",
                 "mask2former_r50_8xb2-lsj-50e_coco_deform-plugin-fast.py"):
        cfg = Config.fromfile(str(root / "configs" / "fast" / name))
        assert cfg.model_wrapper_cfg == dict(type="FlatGradientsDataParallel"), name


SLOW_RANK_SECONDS = 0.2  # rank 1's extra forward time per step in _step_times_worker


def _step_times_worker(rank, out_dir):
    # Rank 1's forward is slower: rank 0 reaches the all-reduce first and waits there. Gradient accumulation over two
    # steps: steps 1 and 3 reduce nothing. The host clock's readings (one per mark; CLOCK_MONOTONIC, one clock for
    # every process of the machine) are kept to compare the ranks' moments.
    import time

    from mmengine.optim import OptimWrapper

    torch.manual_seed(0)
    model = _toy_model()
    forward = model.forward

    def slow_forward(*args, **kwargs):
        if rank == 1:
            time.sleep(SLOW_RANK_SECONDS)
        return forward(*args, **kwargs)
    model.forward = slow_forward
    wrapper = FlatGradientsDataParallel(model, time_steps=True)
    readings = []
    wrapper.step_times.clock = lambda: readings.append(time.perf_counter()) or readings[-1]
    optim = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.5), accumulative_counts=2)
    for step in range(4):
        wrapper.train_step(dict(inputs=torch.ones(2, 3, dtype=torch.float64) * (step + rank)), optim)
    torch.save(dict(records=wrapper.step_times.records(), readings=readings), out_dir / f"rank{rank}.pt")


def test_every_rank_times_its_compute_and_all_reduce_and_no_reduction_ends_before_the_last_rank_arrives(
        gloo_results):
    ranks = [torch.load(gloo_results["_step_times_worker"] / f"rank{rank}.pt") for rank in range(2)]
    marks = []  # per rank: step -> {mark: host seconds}
    for rank in ranks:
        readings = iter(rank["readings"])
        steps = {}
        for step in (1, 2, 3, 4):
            names = ("start", "gradients_ready", "reduced", "end") if step % 2 == 0 else ("start", "end")
            steps[step] = {name: next(readings) for name in names}
        assert next(readings, None) is None
        marks.append(steps)
        assert [r["step"] for r in rank["records"]] == [1, 2, 3, 4]
        for record in rank["records"]:
            at = steps[record["step"]]
            assert record["step_ms"] == pytest.approx(1000 * (at["end"] - at["start"]))
            if record["step"] % 2:  # accumulated, not reduced
                assert record["compute_ms"] is None and record["all_reduce_ms"] is None
                continue
            assert record["compute_ms"] == pytest.approx(1000 * (at["gradients_ready"] - at["start"]))
            assert record["all_reduce_ms"] == pytest.approx(1000 * (at["reduced"] - at["gradients_ready"]))
    for step in (2, 4):
        # The marks bracket the reduction: no rank's ends before every rank's gradients were ready, and rank 1's
        # slow forward falls in its compute.
        last_ready = max(steps[step]["gradients_ready"] for steps in marks)
        assert all(steps[step]["reduced"] >= last_ready for steps in marks)
        assert ranks[1]["records"][step - 1]["compute_ms"] >= 1000 * SLOW_RANK_SECONDS


def _timing_hook_worker(rank, out_dir):
    # The training benchmark's timing hook turns the wrapper's step times on and gathers both ranks' to rank 0.
    from types import SimpleNamespace

    from mmengine.optim import OptimWrapper

    from deform_plugin.benchmarks.detector.iteration_timer import IterationTimerHook

    torch.manual_seed(0)
    model = _toy_model()
    wrapper = FlatGradientsDataParallel(model)
    optim = OptimWrapper(torch.optim.SGD(model.parameters(), lr=0.5))
    hook = IterationTimerHook(windows=[(1, 2)], warmup_iters=1, out_file=str(out_dir / "timing.json"))
    runner = SimpleNamespace(iter=0, work_dir=str(out_dir), model=wrapper, optim_wrapper=optim)
    hook.before_train(runner)
    if rank == 1:  # a clock that moves one second per reading: rank 1's figures are told apart from rank 0's
        seconds = iter(range(100))
        wrapper.step_times.clock = lambda: float(next(seconds))
    for batch_idx in range(2):
        inputs = torch.ones(2, 3, dtype=torch.float64)
        wrapper.train_step(dict(inputs=inputs), optim)
        hook.after_train_iter(runner, batch_idx, data_batch=dict(inputs=inputs))
    hook.after_train(runner)


def test_the_timing_hook_gathers_every_ranks_step_times_to_rank_0(gloo_results):
    result = json.loads((gloo_results["_timing_hook_worker"] / "timing.json").read_text())
    figures = result["data_parallel_steps"]
    assert (figures["world_size"], figures["clock"]) == (2, "host")
    first, second = figures["ranks"]
    assert second == [dict(step=1, compute_ms=1000.0, all_reduce_ms=1000.0, step_ms=3000.0),
                      dict(step=2, compute_ms=1000.0, all_reduce_ms=1000.0, step_ms=3000.0)]
    assert [r["step"] for r in first] == [1, 2] and first != second  # rank 0's own, on the host clock
    assert all(r["compute_ms"] > 0 and 0 <= r["all_reduce_ms"] < r["step_ms"] for r in first)


class _RankDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        return dict(inputs=torch.tensor([float(index), 1.0, -0.5 * index], dtype=torch.float64))


def _runner_worker(rank, out_dir):
    # What tools/dist_train.sh builds from a config: mmengine's Runner, launcher 'pytorch', the wrapper from
    # model_wrapper_cfg through MODEL_WRAPPERS; each rank trains on its own shard (DefaultSampler).
    from mmengine.runner import Runner

    import deform_plugin.engine  # noqa: F401  (registers the wrapper, as the fast configs' custom_imports do)

    torch.manual_seed(rank)  # rank 1's own initial weights are replaced by rank 0's
    runner = Runner(model=_toy_model(), work_dir=str(out_dir / f"work{rank}"), launcher="pytorch",
                    env_cfg=dict(dist_cfg=dict(backend="gloo")),
                    cfg=dict(model_wrapper_cfg=dict(type="FlatGradientsDataParallel")),
                    train_dataloader=dict(dataset=_RankDataset(), batch_size=2, num_workers=0,
                                          sampler=dict(type="DefaultSampler", shuffle=False)),
                    train_cfg=dict(by_epoch=False, max_iters=2, val_interval=100),
                    optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1)),
                    default_hooks=dict(checkpoint=None, logger=None), default_scope=None)
    assert type(runner.model).__name__ == "FlatGradientsDataParallel"
    runner.train()
    torch.save(dict(weight=runner.model.module.linear.weight.detach().clone(),
                    bias=runner.model.module.linear.bias.detach().clone()), out_dir / f"rank{rank}.pt")


def test_the_runner_trains_every_rank_with_the_mean_gradient(gloo_results):
    ranks = [torch.load(gloo_results["_runner_worker"] / f"rank{rank}.pt") for rank in range(2)]
    torch.manual_seed(0)
    linear = nn.Linear(3, 1).double()
    data = _RankDataset()
    shards = [[0, 2, 4, 6], [1, 3, 5, 7]]  # DefaultSampler without shuffling: rank r takes r, r + 2, ...
    for step in range(2):
        grads = []
        for shard in shards:
            linear.zero_grad()
            batch = torch.stack([data[i]["inputs"] for i in shard[2 * step:2 * step + 2]])
            (linear(batch) ** 2).mean().backward()
            grads.append([linear.weight.grad.clone(), linear.bias.grad.clone()])
        with torch.no_grad():
            linear.weight -= 0.1 * (grads[0][0] + grads[1][0]) / 2
            linear.bias -= 0.1 * (grads[0][1] + grads[1][1]) / 2
    for rank in ranks:
        torch.testing.assert_close(rank["weight"], linear.weight.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(rank["bias"], linear.bias.detach(), rtol=1e-12, atol=1e-12)
