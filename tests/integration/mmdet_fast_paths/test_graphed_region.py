"""GraphedRegion's replay machinery (static buffers shared by signatures, the autograd function, gradient copies,
fallbacks) with graphs emulated on the CPU by re-running the captured work; on a GPU, the memory real captures
share."""
import copy

import pytest
import torch
from emulated_graphs import EmulatedGraphRegion
from emulated_graphs import SmallNet as _Net
from emulated_graphs import forward_backward as _step
from emulated_graphs import small_region as _small_region
from gloo_ranks import run_gloo_ranks
from torch import nn

from deform_plugin.cuda_graphs import CapturePolicy
from deform_plugin.integration.mmdet_fast_paths.graphed_region import GraphedRegion

# One pytest-xdist worker runs this whole module, so that its module-scoped fixture (processes) runs once.
pytestmark = pytest.mark.xdist_group("graphed_region")


@pytest.mark.parametrize("at_first_call", [True, False])
def test_graphed_region_replays_equal_eager_and_accumulate_gradients(at_first_call):
    torch.manual_seed(0)
    net = _Net().double()
    eager_net = copy.deepcopy(net)
    region = EmulatedGraphRegion(_small_region(net), net, name="test region",
                                 policy=CapturePolicy(capture_after=1 if at_first_call else 2))
    eager = _small_region(eager_net)
    generator = torch.Generator().manual_seed(1)
    calls = [(torch.randn(4, 6, generator=generator, dtype=torch.float64),
              torch.rand(4, generator=generator, dtype=torch.float64)) for _ in range(3)]
    calls.append((torch.randn(7, 6, generator=generator, dtype=torch.float64),
                  torch.rand(7, generator=generator, dtype=torch.float64)))
    calls += calls[-1:] * 2
    for i, (x, scale) in enumerate(calls):
        ours, constants = _step(region, x, scale, i)
        theirs, expected_constants = _step(eager, x, scale, i)
        assert constants == expected_constants
        torch.testing.assert_close(ours["out"], theirs["out"], rtol=0, atol=0)
        assert torch.equal(ours["flags"][0], theirs["flags"][0]) and ours["flags"][1] is None
        assert not ours["flags"][0].requires_grad
        # .grad accumulates over the calls (no zero_grad): a returned gradient aliasing a buffer that the next
        # replay overwrites would double or lose contributions.
        for p, q in zip(net.parameters(), eager_net.parameters()):
            assert (p.grad is None) == (q.grad is None)
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)
    assert net.unused.weight.grad is None and net.frozen.weight.grad is None
    if at_first_call:  # the first signature warms up eagerly; the second shape is captured at its first call
        assert (region.eager_calls, region.replays, len(region.captured), region.first_call_captures) == (1, 5, 2, 1)
    else:  # per signature: warm-up eagerly, then capture and replay
        assert (region.eager_calls, region.replays, len(region.captured), region.first_call_captures) == (2, 4, 2, 0)


@pytest.mark.parametrize("sharing", ["one-module-twice", "tied-parameters"])
def test_shared_parameters_stay_the_modules_own_through_captures(sharing):
    # Plain Deformable-DETR registers one class branch under every decoder layer's name; other models tie one
    # parameter into several modules. Either way the capture's aliases must leave every module holding its own
    # parameters (those the optimizer updates), and the replayed gradients must reach them.
    torch.manual_seed(0)
    branches = nn.ModuleList([nn.Linear(3, 3), nn.Linear(3, 3)]).double()
    if sharing == "one-module-twice":
        branches[1] = branches[0]
    else:
        branches[1].weight = branches[0].weight
    eager_branches = copy.deepcopy(branches)

    def region_fn(layers):
        return lambda x: (dict(out=layers[1](torch.tanh(layers[0](x)))), None)
    region = EmulatedGraphRegion(region_fn(branches), branches, name="shared branches")
    originals = [(module, name, parameter) for module in branches
                 for name, parameter in module.named_parameters(recurse=False)]
    x = torch.randn(4, 3, dtype=torch.float64)
    for call in range(3):  # warm-up, capture, replay
        for layers, call_fn in ((branches, region), (eager_branches, region_fn(eager_branches))):
            layers.zero_grad(set_to_none=True)
            outputs, _ = call_fn(x * (call + 1))
            outputs["out"].square().sum().backward()
        assert all(getattr(module, name) is parameter for module, name, parameter in originals)
        for ours, theirs in zip(branches.parameters(), eager_branches.parameters()):
            torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-12, atol=1e-12)
    assert (region.eager_calls, region.replays, len(region.captured)) == (1, 2, 1)


class _FailingFirstCaptureRegion(EmulatedGraphRegion):
    """Captures of a signature that has not run eagerly fail (as where a library must run to choose a plan)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.eager_shapes = set()

    def _eager(self, inputs, key=None):
        self.eager_shapes.add(tuple(inputs[0].shape))
        return super()._eager(inputs, key)

    def capture(self, inputs):
        if tuple(inputs[0].shape) not in self.eager_shapes:
            raise ValueError("spatial_shapes is a tensor this op has not validated yet")
        return super().capture(inputs)


def test_a_new_shape_whose_first_capture_fails_warms_up_and_captures_at_its_next_call():
    net = _Net().double()
    region = _FailingFirstCaptureRegion(_small_region(net), net, name="test region")
    for rows in (2, 2, 3, 3, 3):
        _step(region, torch.randn(rows, 6, dtype=torch.float64), torch.rand(rows, dtype=torch.float64), 0)
    # rows 2: warm-up, capture; rows 3: the failed capture's call runs eagerly, the next captures, then replays.
    assert (region.eager_calls, region.replays, len(region.captured)) == (2, 3, 2)
    assert region.first_call_captures == 0 and not region.eager_reasons
    assert list(region.first_call_capture_failures.values()) == [
        "spatial_shapes is a tensor this op has not validated yet"]


def test_each_capture_logs_its_input_shapes_and_host_time(monkeypatch):
    from deform_plugin.cuda_graphs import cache
    lines = []
    monkeypatch.setattr(cache, "print_log", lambda message, logger=None: lines.append(message))
    net = _Net().double()
    region = EmulatedGraphRegion(_small_region(net), net, name="test region")
    for rows in (2, 2, 3, 3):
        _step(region, torch.randn(rows, 6, dtype=torch.float64), torch.rand(rows, dtype=torch.float64), 0)
    assert len(lines) == 2, lines  # one line per capture, none per replay
    for line, shapes in zip(lines, ("[[2, 6], [2]]", "[[3, 6], [3]]")):
        assert line.startswith(f"deform_plugin: test region inputs {shapes} captured in "), line
        assert "s capturing" in line and "MiB added" in line


def test_a_new_kind_of_call_warms_up_eagerly_before_its_capture():
    # Another dtype or mode compiles other kernels: only a new shape of a warmed-up kind skips the warm-up.
    net = _Net().double()
    region = EmulatedGraphRegion(_small_region(net), net, name="test region")
    for rows in (2, 2):
        _step(region, torch.randn(rows, 6, dtype=torch.float64), torch.rand(rows, dtype=torch.float64), 0)
    net.float()
    _step(region, torch.randn(3, 6), torch.rand(3), 0)
    assert (region.eager_calls, len(region.captured)) == (2, 1)
    _step(region, torch.randn(4, 6), torch.rand(4), 0)
    assert (region.eager_calls, len(region.captured), region.first_call_captures) == (2, 2, 1)


def test_inputs_that_require_grad_get_their_gradients_from_the_replay():
    # DINO's denoising label queries are looked up outside the region and enter it as inputs.
    torch.manual_seed(0)
    net, outside = _Net().double(), nn.Linear(6, 6).double()
    eager_net, eager_outside = copy.deepcopy(net), copy.deepcopy(outside)
    region = EmulatedGraphRegion(_small_region(net), net, name="test region")
    eager = _small_region(eager_net)
    generator = torch.Generator().manual_seed(1)
    for i in range(4):
        x = torch.randn(4, 6, generator=generator, dtype=torch.float64)
        scale = torch.rand(4, generator=generator, dtype=torch.float64)
        ours, _ = _step(region, outside(x), scale, i)
        theirs, _ = _step(eager, eager_outside(x), scale, i)
        torch.testing.assert_close(ours["out"], theirs["out"], rtol=0, atol=0)
        for p, q in zip(list(net.parameters()) + list(outside.parameters()),
                        list(eager_net.parameters()) + list(eager_outside.parameters())):
            assert (p.grad is None) == (q.grad is None)
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)
    assert (region.eager_calls, region.replays) == (1, 3)
    # A call whose input does not require grad is another signature.
    with torch.no_grad():
        plain = outside(x)
    region(plain, scale)
    assert region.eager_calls == 2


def test_freezing_a_layer_or_switching_mode_captures_anew():
    net = _Net().double()
    region = EmulatedGraphRegion(_small_region(net), net, name="test region")
    x, scale = torch.randn(4, 6, dtype=torch.float64), torch.rand(4, dtype=torch.float64)
    for _ in range(2):
        _step(region, x, scale, 0)
    net.a.requires_grad_(False)  # a graph differentiates a fixed set of parameters
    net.zero_grad(set_to_none=True)
    for _ in range(2):
        _step(region, x, scale, 0)
    assert net.a.weight.grad is None and net.b.weight.grad is not None
    net.eval()
    _step(region, x, scale, 0)
    assert len(region.captured) == 2 and region.eager_calls == 3


def test_a_second_forward_before_the_backward_runs_eagerly():
    net = _Net().double()
    region = EmulatedGraphRegion(_small_region(net), net, name="test region")
    x, scale = torch.randn(4, 6, dtype=torch.float64), torch.rand(4, dtype=torch.float64)
    y, other_scale = torch.randn(3, 6, dtype=torch.float64), torch.rand(3, dtype=torch.float64)
    for _ in range(2):  # both signatures captured
        _step(region, x, scale, 0)
        _step(region, y, other_scale, 0)
    replays, eager_calls = region.replays, region.eager_calls
    first, _ = region(x, scale)  # replayed; its backward has not run
    second, _ = region(x, scale)  # must not overwrite the first replay's activations and outputs
    third, _ = region(y, other_scale)  # another signature shares the pool and the output buffers
    assert region.replays == replays + 1 and region.eager_calls == eager_calls + 2
    torch.testing.assert_close(first["out"], second["out"])
    kept = first["out"].detach().clone()
    del first, second, third
    region(y, other_scale)  # the first replay's graph is gone: replays again
    assert region.replays == replays + 2
    out, _ = region(x, scale)  # the second replay's graph lives on in `out`, but its backward has run
    out["out"].sum().backward()
    region(x, scale)
    assert region.replays == replays + 4
    torch.testing.assert_close(out["out"], kept)


def test_no_grad_calls_and_failed_captures_run_eagerly_with_the_reason():
    net = _Net().double()
    region = EmulatedGraphRegion(lambda x: (dict(out=net.a(x), bad=3), None), net, name="test region")
    x = torch.randn(2, 6, dtype=torch.float64)
    with torch.no_grad():
        region(x)
        region(x)
    assert region.calls_seen == {}
    region(x)
    region(x)  # the capture meets a non-tensor output and falls back
    assert len(region.captured) == 0 and "int, not a tensor" in next(iter(region.eager_reasons.values()))
    region(x)
    assert region.eager_calls == 5 and region.replays == 0


class _OutOfMemoryRegion(EmulatedGraphRegion):
    """Captures run out of memory the first ``failures`` times; counts the releases of cached memory."""

    def __init__(self, *args, failures, **kwargs):
        super().__init__(*args, **kwargs)
        self.failures, self.releases = failures, 0

    def capture_graph(self, work):
        if self.failures:
            self.failures -= 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB.")
        return super().capture_graph(work)

    def release_cached_memory(self, device):
        self.releases += 1


@pytest.mark.parametrize("failures", [1, 2])
def test_a_capture_out_of_memory_is_retried_once_after_releasing_cached_memory(failures):
    net = _Net().double()
    region = _OutOfMemoryRegion(_small_region(net), net, name="test region", failures=failures)
    x, scale = torch.randn(4, 6, dtype=torch.float64), torch.rand(4, dtype=torch.float64)
    for _ in range(3):
        _step(region, x, scale, 0)
    assert region.releases == 1
    if failures == 1:  # the retry captured
        assert len(region.captured) == 1 and region.replays == 2 and not region.eager_reasons
    else:
        assert not region.captured and region.replays == 0
        assert "out of memory" in next(iter(region.eager_reasons.values()))


def test_max_graphs_bounds_the_captured_signatures():
    net = _Net().double()
    region = EmulatedGraphRegion(_small_region(net), net, name="test region",
                                 policy=CapturePolicy(capture_after=1, max_graphs=1))
    for rows in (2, 2, 3, 3, 3):
        _step(region, torch.randn(rows, 6, dtype=torch.float64), torch.rand(rows, dtype=torch.float64), 0)
    assert len(region.captured) == 1 and region.replays == 1
    assert "max_graphs" in next(iter(region.eager_reasons.values()))


class _RegionCaller(nn.Module):
    """What DistributedDataParallel wraps: a module whose forward is the region (as a detector's ``loss`` is), or
    two regions in a row that split the network's parameters (as a DETR's graphed backbone and transformer)."""

    def __init__(self, net, split=False):
        super().__init__()
        self.net = net
        if not split:
            self.regions = [EmulatedGraphRegion(_small_region(net), net, name="ddp region")]
            return

        def first(x, scale):
            return (torch.tanh(net.a(x)) * scale[:, None],), None

        def second(hidden):
            return dict(out=net.frozen(net.b(hidden)), flags=[hidden > 0, None]), ("constant", hidden.shape[0])
        self.regions = [EmulatedGraphRegion(first, net, name="first", parameter_filter=lambda n: n.startswith("a.")),
                        EmulatedGraphRegion(second, net, name="second",
                                            parameter_filter=lambda n: not n.startswith("a."))]

    def forward(self, x, scale):
        if len(self.regions) == 1:
            return self.regions[0](x, scale)
        (hidden,), _ = self.regions[0](x, scale)
        return self.regions[1](hidden)


def _ddp_batch(rank, step):
    generator = torch.Generator().manual_seed(100 * rank + step)
    rows = 4 + rank  # each rank its own signature
    return (torch.randn(rows, 6, generator=generator, dtype=torch.float64),
            torch.rand(rows, generator=generator, dtype=torch.float64))


# The second: the wrapper settings of the fast DETR configs (model_wrapper_cfg), gradients as views of the buckets.
_FAST_CONFIG_DDP = dict(broadcast_buffers=False, gradient_as_bucket_view=True, static_graph=True)
_DDP_CASES = {"default": ({}, False), "fast-config": (_FAST_CONFIG_DDP, False),
              "fast-config-two-regions": (_FAST_CONFIG_DDP, True)}


def _ddp_worker(rank, out_dir):
    from torch.nn.parallel import DistributedDataParallel
    kept = []  # every wrapper lives until the process exits: a reducer freed beside gloo's threads can deadlock
    for case, (ddp_options, split) in _DDP_CASES.items():  # each case its own network, region and wrapper
        torch.manual_seed(0)
        net = _Net().double()
        net.unused.requires_grad_(False)  # DDP (without find_unused_parameters) wants a gradient for the rest
        caller = _RegionCaller(net, split)
        model = DistributedDataParallel(caller, **ddp_options)
        kept.append(model)
        grads = []
        for step in range(4):  # warm-up, capture, replays
            model.zero_grad(set_to_none=True)
            _step(model, *_ddp_batch(rank, step), step)
            grads.append([p.grad.clone() for p in net.parameters() if p.requires_grad])
        torch.save(dict(grads=grads, counts=[(region.eager_calls, region.replays) for region in caller.regions]),
                   out_dir / f"{case}-rank{rank}.pt")


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    """Every case's results on both ranks, from one pair of gloo ranks (spawning a pair costs seconds)."""
    out_dir = tmp_path_factory.mktemp("ddp")
    run_gloo_ranks(_ddp_worker, out_dir)
    return out_dir


@pytest.mark.parametrize("case", list(_DDP_CASES))
def test_replayed_gradients_are_averaged_across_ranks_under_ddp(ddp_results, case):
    # DistributedDataParallel reduces a parameter's gradient when autograd accumulates it: the replay's backward
    # hands the parameters their gradients through the same accumulators, so ranks that replay (or run eagerly)
    # end with the mean of every rank's gradients; with two regions, each region's gradients as its backward
    # returns them.
    split = _DDP_CASES[case][1]
    ranks = [torch.load(ddp_results / f"{case}-rank{rank}.pt") for rank in range(2)]
    assert [r["counts"] for r in ranks] == [[(1, 3)] * (2 if split else 1)] * 2
    torch.manual_seed(0)
    net = _Net().double()
    net.unused.requires_grad_(False)
    eager = _small_region(net)
    for step in range(4):
        per_rank = []
        for rank in range(2):
            net.zero_grad(set_to_none=True)
            _step(eager, *_ddp_batch(rank, step), step)
            per_rank.append([p.grad.clone() for p in net.parameters() if p.requires_grad])
        for rank in range(2):
            for got, *expected in zip(ranks[rank]["grads"][step], *per_rank):
                torch.testing.assert_close(got, sum(expected) / 2, rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_later_signatures_reuse_the_memory_of_earlier_captures():
    # Every signature captures into one pool; the activations one capture frees must serve the next (on one capture
    # stream), or a run that meets many image sizes keeps each signature's activations reserved until it runs out.
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Conv2d(32, 32, 3, padding=1) for _ in range(4)]).cuda()
    region = GraphedRegion(lambda x: (net(x).relu(), None), net, name="pool test")

    def step(size):
        out, _ = region(torch.randn(4, 32, size, size, device="cuda"))
        out.sum().backward()
        torch.cuda.synchronize()
        return torch.cuda.memory_reserved()

    sizes = [256, 248, 240, 232, 224, 216]  # decreasing: every later request fits a block the first one freed
    warm = step(sizes[0])
    first = step(sizes[0]) - warm
    for size in sizes[1:]:
        step(size)
        last = step(size)
    assert len(region.captured) == len(sizes) and not region.eager_reasons
    # Without reuse each capture adds about ``first`` again (five times here).
    assert last - warm - first <= 0.5 * first, (first, last - warm - first)
