"""Graph-replayed training gives the eager step's losses and gradients.

- on the CPU, the captured region of Deformable-DETR two-stage, DINO (padding masks from a device tensor of image
  sizes; DINO's denoising queries padded to a fixed count) and Mask2Former, run eagerly and replayed from emulated
  graphs, gives the stock ``loss`` to float64 rounding (Mask2Former: float32), dropout included;
- :class:`GraphedRegion`'s replay machinery (static buffers shared by signatures, the autograd function, gradient
  copies, fallbacks) with graphs emulated on the CPU by re-running the captured work;
- on a GPU, real CUDA graphs: losses and gradients over optimizer steps and two input shapes equal eager.
"""
import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import deform_plugin  # noqa: F401  (mmcv-lite stand-in; registers our module)
from deform_plugin.cuda_graphs import CapturePolicy
from deform_plugin.integration.mmdet_fast_paths import apply_fast_paths
from deform_plugin.integration.mmdet_fast_paths.graphed_region import GraphedRegion

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import stock_worker  # noqa: E402
from gloo_ranks import run_gloo_ranks  # noqa: E402

CONFIGS = {"deformable-detr-two-stage":
           "configs/deformable_detr/deformable-detr-refine-twostage_r50_16xb2-50e_coco_deform-plugin.py",
           "dino": "configs/dino/dino-4scale_r50_8xb2-12e_coco_deform-plugin.py",
           "mask2former": "configs/mask2former/mask2former_r50_8xb2-lsj-50e_coco_deform-plugin.py"}


class _ReRunGraph:
    """A stand-in for a CUDA graph on the CPU: replaying runs the captured work again."""

    def __init__(self, work):
        self.work = work

    def replay(self):
        with torch.enable_grad():
            self.work()


class EmulatedGraphRegion(GraphedRegion):
    """A region whose graphs re-run the captured work on the CPU; it captures a new shape of a warmed-up kind at its
    first call (``capture_after=1``) unless given another policy."""

    device_type = "cpu"

    def __init__(self, *args, policy=None, **kwargs):
        super().__init__(*args, policy=policy or CapturePolicy(capture_after=1), **kwargs)

    def capture_graph(self, work):
        # A capture launches nothing: keep the random state as it was (dropout draws at the replay only).
        state = torch.get_rng_state()
        work()
        torch.set_rng_state(state)
        return _ReRunGraph(work)


def _detector(name, dtype=torch.float64):
    from mmengine.config import Config
    torch.manual_seed(0)
    cfg = Config.fromfile(str(ROOT / CONFIGS[name]))
    # A ResNet-18, fewer queries (and sampled points) keep the float64 CPU steps short; the captured pieces are the
    # same.
    cfg.model.backbone.depth = 18
    if name == "mask2former":
        cfg.model.panoptic_head.in_channels = [64, 128, 256, 512]
        cfg.model.panoptic_head.num_queries = 20
        cfg.model.train_cfg.num_points = 256
    else:
        cfg.model.neck.in_channels = [128, 256, 512]
        cfg.model.num_queries = 100
    model = stock_worker.build_msda_owner(cfg)
    model.init_weights()
    return model.to(dtype=dtype).train()


def _training_batch(height=224, width=256, sizes=((224, 256), (200, 232)), seed=0, device="cpu",
                    dtype=torch.float64):
    from mmengine.structures import InstanceData
    inputs, samples = stock_worker.detection_inputs(batch=len(sizes), height=height, width=width, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    for sample, (h, w), num_gts in zip(samples, sizes, (3, 5, 2, 4)):
        sample.set_metainfo(dict(img_shape=(h, w), ori_shape=(h, w)))
        centre = torch.rand(num_gts, 2, generator=generator) * 0.6 + 0.2
        half = torch.rand(num_gts, 2, generator=generator) * 0.15 + 0.05
        boxes = torch.cat([centre - half, centre + half], 1) * torch.tensor([w, h, w, h])
        sample.gt_instances = InstanceData(bboxes=boxes.to(device=device, dtype=dtype),
                                           labels=torch.randint(0, 80, (num_gts,), generator=generator).to(device),
                                           masks=_box_masks(boxes, height, width))
    return inputs.to(device=device, dtype=dtype), samples


def _box_masks(boxes, height, width):
    from mmdet.structures.mask import BitmapMasks
    rows = torch.arange(height).view(1, -1, 1)
    cols = torch.arange(width).view(1, 1, -1)
    x0, y0, x1, y1 = (boxes[:, i].view(-1, 1, 1) for i in range(4))
    masks = (rows >= y0) & (rows < y1) & (cols >= x0) & (cols < x1)
    return BitmapMasks(masks.to(torch.uint8).numpy(), height, width)


def _loss_and_grads(detector, inputs, samples, seed=3):
    torch.manual_seed(seed)
    losses = detector.loss(inputs, copy.deepcopy(samples))
    total = sum(value.sum() for value in losses.values() if isinstance(value, torch.Tensor))
    params = [p for p in detector.parameters() if p.requires_grad]
    grads = torch.autograd.grad(total, params, allow_unused=True)
    return {k: v.detach() for k, v in losses.items()}, grads


# mmdet's Mask2Former losses compare float32 ground-truth masks with points of the default dtype: float64 fails in
# stock mmdet. The other two run in float64.
_TEST_DTYPES = {"deformable-detr-two-stage": torch.float64, "dino": torch.float64, "mask2former": torch.float32}


# DINO also with its backbone and neck graphed as a region of their own, as the DETRs run under DDP (DINO's region
# takes the most inputs; Deformable-DETR's passes the features the same way). Mask2Former keeps one region.
@pytest.mark.parametrize("name,split", [(name, False) for name in CONFIGS] + [("dino", True)])
def test_replays_give_the_stock_losses_and_gradients_for_other_image_sizes(name, split):
    dtype = _TEST_DTYPES[name]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # DINO's denoising generator makes its query tables with the default dtype
    try:
        _check_replays_against_stock(name, dtype, split)
    finally:
        torch.set_default_dtype(previous)


def _check_replays_against_stock(name, dtype, split):
    stock = _detector(name, dtype=dtype)
    fast = copy.deepcopy(stock)
    # Mask2Former as its fast config runs it: the replayed network feeds the one-pass matching and losses. The FFN
    # memory paths are captured and replayed too: Deformable-DETR's twelve FFNs (dropout 0.1) fuse their ReLU and
    # dropout, DINO's and Mask2Former's (dropout 0) recompute their hidden layers in the backward.
    changed = apply_fast_paths(fast, cuda_graphs=True, batched_matching=name == "mask2former",
                               relu_dropout_fusion=True, ffn_recompute=True, split_graphs_at_features=split,
                               capture_policy=CapturePolicy(capture_after=1))
    assert changed["cuda_graphs"] == 1 and changed["sync_free_forward"] == 1  # the detector or the pixel decoder
    assert changed["relu_dropout_fusion"] == (12 if name == "deformable-detr-two-stage" else 0)
    assert (changed["ffn_recompute"] > 0) == (name != "deformable-detr-two-stage")
    assert changed.get("batched_matching", 1) == 1
    region = fast.graphed_training_region
    regions = fast.graphed_training_regions
    assert len(regions) == (2 if split else 1) and regions[-1] is region
    for each in regions:
        each.__class__ = EmulatedGraphRegion
    if split:  # the first region differentiates the backbone's and neck's parameters, the second all the others
        trainable = {id(p) for p in fast.parameters() if p.requires_grad}
        features = {id(p) for m in (fast.backbone, fast.neck) for p in m.parameters() if p.requires_grad}
        named = dict(fast.named_parameters())
        assert {id(named[n]) for n in named if named[n].requires_grad and regions[0].parameter_filter(n)} == features
        assert {id(named[n]) for n in named if named[n].requires_grad and regions[1].parameter_filter(n)} == (
            trainable - features)
    # float32: the same kernels on the same values, up to the order of gradient accumulation.
    loss_tolerance, grad_tolerance = (dict(rtol=1e-10, atol=1e-12), dict(rtol=1e-8, atol=1e-10)) if (
        dtype == torch.float64) else (dict(rtol=1e-5, atol=1e-6), dict(rtol=1e-4, atol=1e-6))
    # Same padded shape, other image sizes: the first call runs the region eagerly (the warm-up), the second
    # captures, all replay after; then another padded shape, captured at its first call.
    for height, sizes in [(224, ((224, 256), (200, 232))), (224, ((160, 256), (224, 128))),
                          (224, ((224, 200), (224, 256))), (192, ((192, 256), (150, 200)))]:
        inputs, samples = _training_batch(height=height, sizes=sizes, seed=len(sizes[0]) + sizes[1][0], dtype=dtype)
        expected, expected_grads = _loss_and_grads(stock, inputs, samples)
        got, got_grads = _loss_and_grads(fast, inputs, samples)
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], **loss_tolerance, msg=key)
        for ours, theirs in zip(got_grads, expected_grads):
            if theirs is not None:
                torch.testing.assert_close(ours, theirs, **grad_tolerance)
    for each in regions:
        assert (each.eager_calls, each.replays, len(each.captured), each.first_call_captures) == (1, 3, 2, 1)


# ---- the replay machinery, on a small region ----------------------------------------------------------------------

class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.b = nn.Linear(5, 3)
        self.unused = nn.Linear(2, 2)
        self.frozen = nn.Linear(3, 3).requires_grad_(False)


def _small_region(net):
    def fn(x, scale):
        hidden = torch.tanh(net.a(x)) * scale[:, None]
        out = net.frozen(net.b(hidden))
        return dict(out=out, flags=[hidden > 0, None]), ("constant", x.shape[0])
    return fn


def _step(call, x, scale, grad_seed):
    outputs, constants = call(x, scale)
    generator = torch.Generator().manual_seed(grad_seed)
    upstream = torch.randn(outputs["out"].shape, generator=generator, dtype=outputs["out"].dtype)
    (outputs["out"] * upstream).sum().backward()
    return outputs, constants


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


@pytest.mark.parametrize("max_num_target", [0, 1, 3, 7, 25])
def test_the_padded_denoising_mask_is_mmdets_for_the_real_queries(max_num_target):
    from mmdet.models.layers import CdnQueryGenerator

    from deform_plugin.integration.mmdet_fast_paths.graphed_training import (_padded_denoising_count,
                                                                             padded_denoising_mask)
    num_matching = 10
    generator = CdnQueryGenerator(num_classes=80, embed_dims=32, num_matching_queries=num_matching,
                                  group_cfg=dict(dynamic=True, num_dn_queries=20))
    num_groups = generator.get_num_groups(max_num_target)
    stock = generator.generate_dn_mask(max_num_target, num_groups, device="cpu")
    num_denoising = 2 * max_num_target * num_groups
    padded = _padded_denoising_count(generator, num_denoising)
    # Up to 20 targets the count is fixed (2 * num_dn_queries); 25 targets make one group of 50 queries.
    assert padded == (40 if max_num_target <= 20 else 64)
    ours = padded_denoising_mask(num_denoising, 2 * max_num_target, padded, num_matching, "cpu")
    real = torch.cat([torch.arange(num_denoising), torch.arange(padded, padded + num_matching)])
    padding = torch.arange(num_denoising, padded)
    assert torch.equal(ours[real][:, real], stock)
    assert ours[real][:, padding].all() and ours[padding][:, real].all()
    assert torch.equal(ours[padding][:, padding], ~torch.eye(len(padding), dtype=torch.bool))


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


def _ddp_worker(rank, out_dir, ddp_options, split):
    from torch.nn.parallel import DistributedDataParallel
    torch.manual_seed(0)
    net = _Net().double()
    net.unused.requires_grad_(False)  # DDP (without find_unused_parameters) wants a gradient for the rest
    caller = _RegionCaller(net, split)
    model = DistributedDataParallel(caller, **ddp_options)
    grads = []
    for step in range(4):  # warm-up, capture, replays
        model.zero_grad(set_to_none=True)
        _step(model, *_ddp_batch(rank, step), step)
        grads.append([p.grad.clone() for p in net.parameters() if p.requires_grad])
    torch.save(dict(grads=grads, counts=[(region.eager_calls, region.replays) for region in caller.regions]),
               out_dir / f"rank{rank}.pt")


# The second: the wrapper settings of the fast DETR configs (model_wrapper_cfg), gradients as views of the buckets.
@pytest.mark.parametrize("ddp_options,split", [
    ({}, False), (dict(broadcast_buffers=False, gradient_as_bucket_view=True, static_graph=True), False),
    (dict(broadcast_buffers=False, gradient_as_bucket_view=True, static_graph=True), True)],
    ids=["default", "fast-config", "fast-config-two-regions"])
def test_replayed_gradients_are_averaged_across_ranks_under_ddp(tmp_path, ddp_options, split):
    # DistributedDataParallel reduces a parameter's gradient when autograd accumulates it: the replay's backward
    # hands the parameters their gradients through the same accumulators, so ranks that replay (or run eagerly)
    # end with the mean of every rank's gradients; with two regions, each region's gradients as its backward
    # returns them.
    run_gloo_ranks(_ddp_worker, tmp_path, ddp_options, split)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
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


def test_detectors_without_the_stock_pieces_are_left_alone():
    from deform_plugin.integration.mmdet_fast_paths.graphed_training import enable_cuda_graph_training
    assert enable_cuda_graph_training(nn.Linear(2, 2)) is None
    detector = _detector("dino", dtype=torch.float32)
    detector.loss = lambda *args: None  # a user's own loss
    assert enable_cuda_graph_training(detector) is None


# ---- real CUDA graphs ---------------------------------------------------------------------------------------------

def _without_dropout(model):
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        elif isinstance(module, nn.MultiheadAttention):  # its attention dropout is a float, not a module
            module.dropout = 0.0
    return model


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("name,split,slots", [(name, False, False) for name in CONFIGS] + [("dino", True, False)]
                         + [(name, False, True) for name in CONFIGS])
@pytest.mark.parametrize("amp", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_cuda_graph_training_matches_eager_over_optimizer_steps(name, split, slots, amp):
    from deform_plugin.engine.data_parallel import ParameterGradientSlots
    # Dropout off: replayed dropout draws other numbers than eager dropout.
    eager = _without_dropout(_detector(name, dtype=torch.float32)).cuda()
    apply_fast_paths(eager, sync_free_forward=True)
    graphed = copy.deepcopy(eager)
    # As the fast configs run them (Mask2Former's one-pass matching draws stock's random points in stock's order);
    # with gradient slots as FastPathsHook gives them to a model that DistributedDataParallel does not wrap.
    gradient_slots = ParameterGradientSlots(graphed.parameters()) if slots else None
    apply_fast_paths(graphed, cuda_graphs=True, batched_matching=name == "mask2former",
                     split_graphs_at_features=split, gradient_slots=gradient_slots,
                     capture_policy=CapturePolicy(capture_after=1))
    regions = graphed.graphed_training_regions
    assert len(regions) == (2 if split else 1)
    optimizer = torch.optim.SGD([p for p in eager.parameters() if p.requires_grad], lr=1e-3)
    shapes = [(224, 256), (224, 256), (256, 224), (224, 256), (256, 224), (256, 224), (224, 256)]
    for step, (h, w) in enumerate(shapes):
        inputs, samples = _training_batch(h, w, sizes=((h, w), (h - 32, w - 16 * step)), seed=step, device="cuda",
                                          dtype=torch.float32)
        # Both models hold the same weights at every step: the graphed one gets the eager one's in place, as an
        # optimizer would, so its replays must read the updated weights. (Stepping each model on its own
        # gradients would compare chaotic trajectories: an untrained two-stage top-k and matching are full of
        # near-ties that rounding differences flip.)
        with torch.no_grad():
            for theirs, ours in zip(eager.parameters(), graphed.parameters()):
                ours.copy_(theirs)
        results = []
        for model in (eager, graphed):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(step)  # DINO's denoising queries are random
            with torch.autocast("cuda", dtype=amp or torch.float32, enabled=amp is not None):
                losses = model.loss(inputs, copy.deepcopy(samples))
            total = sum(v.sum() for v in losses.values() if isinstance(v, torch.Tensor))
            total.backward()
            results.append((float(total), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
            if model is graphed and slots and step > 0:
                # Replayed or captured: the slots are the gradients the regions computed (DINO's label embedding
                # gets its gradient eagerly, through the denoising queries' inputs to the region).
                from_regions = [p for region in regions for entry in region.captured.values()
                                for p, has in zip(entry.params, entry.param_has_grad) if has]
                assert from_regions and all(p.grad is gradient_slots.slot(p) for p in from_regions)
        optimizer.step()
        (eager_total, eager_grads), (graph_total, graph_grads) = results
        # MSDA's backward adds with atomics, in any order.
        loss_tolerance, grad_tolerance = (2e-2, 5e-2) if amp else (1e-4, 1e-3)
        assert abs(graph_total - eager_total) <= loss_tolerance * abs(eager_total), (step, graph_total, eager_total)
        assert len(graph_grads) == len(eager_grads)
        num = sum(float((g - e).norm() ** 2) for g, e in zip(graph_grads, eager_grads)) ** 0.5
        den = sum(float(e.norm() ** 2) for e in eager_grads) ** 0.5
        assert num <= grad_tolerance * den, (step, num / den)
    # The first shape warms up eagerly and captures at its second call; the second shape is captured at its first.
    for region in regions:
        assert (region.replays, len(region.captured), region.first_call_captures) == (6, 2, 1)
        assert not region.eager_reasons and not region.first_call_capture_failures


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


@pytest.mark.parametrize("num_gts", [(3, 5), (0, 4), (2, 0)], ids=["gts3-5", "gts0-4", "gts2-0"])
def test_dino_denoising_queries_are_mmdets_without_its_blocking_copies(num_gts):
    """The graphed DINO's denoising queries: mmdet's generator pieces, collated from the host's target counts and
    normalised by factors copied without blocking; the same queries as mmdet's ``CdnQueryGenerator.__call__`` for
    the same random draws, and one call left that would block on a GPU (the label noise's ``nonzero``, whose size
    is random)."""
    from host_transfers import HostTransferSpy
    from mmdet.models.layers import CdnQueryGenerator
    from mmdet.structures import DetDataSample
    from mmengine.structures import InstanceData

    from deform_plugin.integration.mmdet_fast_paths.graphed_training import _denoising_queries
    generator = CdnQueryGenerator(num_classes=5, embed_dims=16, num_matching_queries=30,
                                  label_noise_scale=0.5, box_noise_scale=1.0,
                                  group_cfg=dict(dynamic=True, num_groups=None, num_dn_queries=20))
    samples, rng = [], torch.Generator().manual_seed(sum(num_gts))
    for count in num_gts:
        xy = torch.rand(count, 2, generator=rng) * 40
        sample = DetDataSample(metainfo=dict(img_shape=(64, 96)))
        sample.gt_instances = InstanceData(bboxes=torch.cat([xy, xy + 5 + torch.rand(count, 2, generator=rng) * 20], 1),
                                           labels=torch.randint(0, 5, (count,), generator=rng))
        samples.append(sample)
    torch.manual_seed(0)
    stock_label, stock_bbox, _, stock_meta = generator(samples)
    torch.manual_seed(0)
    with HostTransferSpy() as spy:
        label, bbox, group_size, meta = _denoising_queries(generator, samples)
    assert torch.equal(label, stock_label) and torch.equal(bbox, stock_bbox)
    assert meta == stock_meta and group_size == 2 * max(num_gts)
    assert spy.calls == [("nonzero", "generate_dn_label_query")]
