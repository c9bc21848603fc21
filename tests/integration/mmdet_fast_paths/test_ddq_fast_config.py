"""configs/fast/ddq-detr-...-fast.py: it loads and builds, its FastPathsHook selects the switches that fit DDQ-DETR,
and a small DDQ-DETR built from it and switched by its hook gives the plain config's losses and gradients."""
import copy
import types

import pytest
import stock_worker
import torch
from ddq_heads import ddq_in_float64, flat_losses
from emulated_graphs import EmulatedGraphRegion
from small_detectors import REPO_ROOT, float64_nms_refusal, small_detector, with_fractional_offsets

import deform_plugin  # noqa: F401  (mmcv stand-in where mmcv-lite is installed)

FAST_CONFIG = "configs/fast/ddq-detr-4scale_r50_8xb2-12e_coco_deform-plugin-fast.py"
SWITCHES = dict(sdpa_attention=True, batched_matching=True, batched_losses=True, sync_free_forward=True,
                cuda_graphs=True, ffn_recompute=True, float32_nms=True)
# mmcv's batched_nms runs NMS group by group from split_thr boxes on (10000: the encoder's proposals at COCO sizes),
# where bf16 scores fail; the small detector's encoder has a few hundred tokens, so the bf16 tests lower it.
GROUPED_NMS_FROM = 16


def _fast_config():
    from mmengine.config import Config
    return Config.fromfile(str(REPO_ROOT / FAST_CONFIG))


def test_the_fast_config_loads_and_builds_its_hooks():
    # Its model is built (shrunk) in the test below.
    from mmengine.registry import HOOKS

    from deform_plugin.engine import FastPathsHook, ShapeBucketsHook, fast_path_switches_from_config
    cfg = _fast_config()
    assert fast_path_switches_from_config(cfg) == SWITCHES
    assert cfg.optim_wrapper.constructor == "MergedParamGroupsOptimWrapperConstructor"
    assert cfg.model_wrapper_cfg == dict(type="FlatGradientsDataParallel")
    assert cfg.model.data_preprocessor.non_blocking and cfg.train_dataloader.pin_memory
    hooks = [HOOKS.build(hook) for hook in cfg.custom_hooks]
    assert [type(hook) for hook in hooks] == [FastPathsHook, ShapeBucketsHook]
    assert set(hooks[0].fast_paths.selected()) == set(SWITCHES)
    assert cfg.model.type == "DDQDETR" and cfg.model.decoder.num_layers == 6


def _training_batch(sizes, height=96, width=128, seed=0):
    from mmengine.structures import InstanceData
    inputs, samples = stock_worker.detection_inputs(batch=len(sizes), height=height, width=width, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    for sample, (h, w), num_gts in zip(samples, sizes, (3, 5)):
        sample.set_metainfo(dict(img_shape=(h, w), ori_shape=(h, w)))
        centre = torch.rand(num_gts, 2, generator=generator, dtype=torch.float64) * 0.6 + 0.2
        half = torch.rand(num_gts, 2, generator=generator, dtype=torch.float64) * 0.15 + 0.05
        sample.gt_instances = InstanceData(bboxes=torch.cat([centre - half, centre + half], 1) * torch.tensor(
            [w, h, w, h]), labels=torch.randint(0, 80, (num_gts,), generator=generator))
    return inputs, samples


def _losses_and_gradients(detector, inputs, samples):
    torch.manual_seed(3)  # the denoising queries are random
    losses = flat_losses(detector.loss(inputs, copy.deepcopy(samples)))
    params = [p for p in detector.parameters() if p.requires_grad]
    grads = torch.autograd.grad(sum(value.sum() for value in losses.values()), params, allow_unused=True)
    return {name: value.detach() for name, value in losses.items()}, grads


def _assert_stocks_to_rounding(got, expected):
    """``(losses, gradients)`` equal to stock's: the same loss names in order, float64 values within rounding (SDPA,
    the batch's gathers and the one-pass sums add in other orders)."""
    (losses, grads), (stock_losses, stock_grads) = got, expected
    assert list(losses) == list(stock_losses)
    for name in stock_losses:
        torch.testing.assert_close(losses[name], stock_losses[name], rtol=1e-8, atol=1e-10, msg=name)
    for ours, theirs in zip(grads, stock_grads):
        assert (ours is None) == (theirs is None)
        if theirs is not None:
            torch.testing.assert_close(ours, theirs, rtol=1e-7, atol=1e-8)


@pytest.fixture
def float64():
    with ddq_in_float64():
        yield


def test_the_fast_configs_switches_give_the_plain_configs_losses_and_gradients(float64):
    from mmengine.registry import HOOKS
    refusal = float64_nms_refusal()
    if refusal:
        pytest.skip(refusal)
    # Built from the fast config (shrunk: two encoder and two decoder layers, so that the second decoder layer takes
    # the distinct queries the first's NMS kept; narrow FFNs; 30 queries, 45 dense ones); the plain config's model is
    # the same (its config differs in the data preprocessor's copy only), with the same weights.
    # Fractional sampling offsets: an image that fills the batch puts the encoder's samples on pixel centres
    # otherwise, where the sampling has no derivative and the offsets' gradients depend on float rounding.
    fast = with_fractional_offsets(small_detector("ddq", layers=2, feedforward_channels=256, queries=30,
                                                  config=FAST_CONFIG))
    stock = copy.deepcopy(fast)
    hooks = [HOOKS.build(hook) for hook in _fast_config().custom_hooks]
    hooks[0].before_run(types.SimpleNamespace(model=fast, hooks=hooks, optim_wrapper=None))
    assert "loss" in vars(fast.bbox_head) and fast.data_preprocessor._deform_plugin_flips_channels
    # The graphed region is the whole network, the distinct queries selected on the device (the matching and losses
    # run eagerly on its outputs): CUDA graphs emulated on the CPU. The first call runs it eagerly (its kind's
    # warm-up), the second captures it at once (ShapeBucketsHook is in the run) and replays it.
    (region,) = fast.graphed_training_regions
    region.__class__ = EmulatedGraphRegion
    # Two images that fill the batch, then (the same padded shape, replayed) a padded second image, whose padding
    # tokens tie (one score and one box each): the NMS before the decoder keeps the one that mmcv's sort puts first.
    for sizes in (((96, 128), (96, 128)), ((96, 128), (80, 104))):
        inputs, samples = _training_batch(sizes)
        expected, expected_grads = _losses_and_gradients(stock, inputs, samples)
        for _ in range(2 if sizes[1] == sizes[0] else 1):
            _assert_stocks_to_rounding(_losses_and_gradients(fast, inputs, samples), (expected, expected_grads))
        if sizes[1] == sizes[0]:
            assert (region.eager_calls, region.replays, len(region.captured)) == (1, 1, 1)
    assert (region.eager_calls, region.replays, len(region.captured)) == (1, 2, 1)


def test_split_at_the_features_the_two_regions_give_the_plain_losses_and_gradients(float64):
    # Under DistributedDataParallel without gradient slots the backbone and neck are a region of their own, and the
    # whole-network region takes their features (the DINO-style inputs after them).
    from deform_plugin.cuda_graphs import CapturePolicy
    from deform_plugin.integration.mmdet_fast_paths import apply_fast_paths
    refusal = float64_nms_refusal()
    if refusal:
        pytest.skip(refusal)
    stock = with_fractional_offsets(small_detector("ddq", layers=2, feedforward_channels=256, queries=30))
    fast = copy.deepcopy(stock)
    apply_fast_paths(fast, capture_policy=CapturePolicy(capture_after=1), split_graphs_at_features=True,
                     **SWITCHES)
    regions = fast.graphed_training_regions
    assert len(regions) == 2
    for region in regions:
        region.__class__ = EmulatedGraphRegion
    inputs, samples = _training_batch(((96, 128), (80, 104)))
    expected, expected_grads = _losses_and_gradients(stock, inputs, samples)
    for _ in range(2):  # the warm-up, then a capture at once and its replay
        _assert_stocks_to_rounding(_losses_and_gradients(fast, inputs, samples), (expected, expected_grads))
    assert [(region.eager_calls, region.replays) for region in regions] == [(1, 1), (1, 1)]


def test_the_training_region_reads_nothing_from_the_host_and_nothing_back():
    # A CUDA graph cannot capture a read back nor a copy from pageable host memory: the whole training region, its
    # NMS and dense-query sort included, makes neither (run eagerly on the CPU, where the calls are the same).
    from host_transfers import HostTransferSpy
    from mmengine.registry import HOOKS
    fast = small_detector("ddq", dtype=torch.float32, layers=2, feedforward_channels=256, queries=30,
                          config=FAST_CONFIG)
    hooks = [HOOKS.build(hook) for hook in _fast_config().custom_hooks]
    hooks[0].before_run(types.SimpleNamespace(model=fast, hooks=hooks, optim_wrapper=None))
    (region,) = fast.graphed_training_regions
    calls, network = [], region.fn

    def spied(*inputs, **kwargs):
        with HostTransferSpy() as spy:
            outputs = network(*inputs, **kwargs)
        calls.extend(spy.calls)
        return outputs
    region.fn = spied
    inputs, samples = _training_batch(((96, 128), (80, 104)))
    for sample in samples:
        sample.gt_instances.bboxes = sample.gt_instances.bboxes.float()
    losses = flat_losses(fast.loss(inputs.float(), samples))
    assert region.eager_calls == 1 and losses["loss_cls"] > 0
    # _corners: the CPU reference op's sampling tables; the PyTorch NMS path's own loop (a GPU runs Triton's).
    assert [call for call in calls if call[1] not in ("_corners", "greedy_nms_first_kept_reference")] == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_on_cuda_the_fast_step_follows_the_plain_step_over_optimizer_steps():
    from host_transfers import cuda_syncs_of

    from deform_plugin.cuda_graphs import CapturePolicy
    from deform_plugin.integration.mmdet_fast_paths import apply_fast_paths
    # Fractional sampling offsets and images that fill the batch: see the CPU test above (a padded image's padding
    # tokens tie in the NMS, which may then keep another one than stock's).
    stock = with_fractional_offsets(small_detector("ddq", dtype=torch.float32, layers=2, feedforward_channels=256,
                                                   queries=30)).cuda()
    fast = copy.deepcopy(stock)
    apply_fast_paths(fast, capture_policy=CapturePolicy(capture_after=1), **SWITCHES)
    (region,) = fast.graphed_training_regions
    optimizer = torch.optim.SGD([p for p in stock.parameters() if p.requires_grad], lr=1e-3)

    def step(model, inputs, samples):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        losses = flat_losses(model.loss(inputs, copy.deepcopy(samples)))
        total = sum(value.sum() for value in losses.values())
        total.backward()
        return float(total), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    syncs = None
    for index, sizes in enumerate([((128, 160), (128, 160))] * 3):
        inputs, samples = _training_batch(sizes, height=128, width=160, seed=index)
        inputs = inputs.float().cuda()
        for sample in samples:
            sample.gt_instances = sample.gt_instances.to("cuda")
            sample.gt_instances.bboxes = sample.gt_instances.bboxes.float()
        with torch.no_grad():  # both models hold the same weights at every step, as the optimizer leaves them
            for theirs, ours in zip(stock.parameters(), fast.parameters()):
                ours.copy_(theirs)
        (stock_total, stock_grads), (fast_total, fast_grads) = (step(model, inputs, samples)
                                                                for model in (stock, fast))
        optimizer.step()
        assert abs(fast_total - stock_total) <= 1e-4 * abs(stock_total), (index, fast_total, stock_total)
        assert len(fast_grads) == len(stock_grads)
        difference = sum(float((f - s).norm() ** 2) for f, s in zip(fast_grads, stock_grads)) ** 0.5
        assert difference <= 1e-3 * sum(float(s.norm() ** 2) for s in stock_grads) ** 0.5, index
        if index == 2:
            syncs = [cuda_syncs_of(lambda: step(model, inputs, samples)) for model in (stock, fast)]
    # The first batch warmed the region's kind up eagerly; its shape was captured at the second and replayed at the
    # third (and by the sync counts' calls).
    assert (region.eager_calls, len(region.captured)) == (1, 1) and region.replays >= 2
    # What is left waiting in the fast step: the loss's one copy (tests/integration/mmdet_fast_paths/test_ddq_losses.py
    # counts the loss alone); the NMS that selects the distinct queries runs on the device inside the region.
    assert syncs[1] < syncs[0], syncs


def _with_grouped_nms(detector):
    detector.cache_dict["dqs_cfg"] = dict(detector.cache_dict["dqs_cfg"], split_thr=GROUPED_NMS_FROM)
    return detector


def test_the_fast_configs_switches_train_a_bf16_autocast_step_where_the_plain_configs_fail():
    # CPU autocast: bf16 class scores reach the NMS as under CUDA's, and DDQAuxLoss's stock targets fail as well.
    from mmengine.registry import HOOKS
    stock = _with_grouped_nms(small_detector("ddq", dtype=torch.float32, layers=2, feedforward_channels=256,
                                             queries=30, config=FAST_CONFIG))
    fast = copy.deepcopy(stock)
    hooks = [HOOKS.build(hook) for hook in _fast_config().custom_hooks]
    hooks[0].before_run(types.SimpleNamespace(model=fast, hooks=hooks, optim_wrapper=None))
    inputs, samples = _training_batch(((96, 128), (80, 104)))
    inputs = inputs.float()
    for sample in samples:
        sample.gt_instances.bboxes = sample.gt_instances.bboxes.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match="Index put requires the source and destination dtypes match"):
            _losses_and_gradients(stock, inputs, samples)
        losses, grads = _losses_and_gradients(fast, inputs, samples)
    assert all(torch.isfinite(value).all() for value in losses.values())
    assert losses["loss_cls"] > 0 and losses["aux_enc_aux_loss_cls[0]"] > 0
    assert all(torch.isfinite(grad).all() for grad in grads if grad is not None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA autocast and CUDA graphs need a CUDA device")
def test_on_cuda_the_fast_switches_train_bf16_autocast_steps_where_stocks_fail():
    from deform_plugin.cuda_graphs import CapturePolicy
    from deform_plugin.integration.mmdet_fast_paths import apply_fast_paths
    stock = _with_grouped_nms(small_detector("ddq", dtype=torch.float32, layers=2, feedforward_channels=256,
                                             queries=30)).cuda()
    fast = copy.deepcopy(stock)
    apply_fast_paths(fast, capture_policy=CapturePolicy(capture_after=1), **SWITCHES)
    (region,) = fast.graphed_training_regions

    def step(model, inputs, samples):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            losses = flat_losses(model.loss(inputs, copy.deepcopy(samples)))
        sum(value.sum() for value in losses.values()).backward()
        return losses

    inputs, samples = _training_batch(((128, 160), (112, 136)), height=128, width=160)
    inputs = inputs.float().cuda()
    for sample in samples:
        sample.gt_instances = sample.gt_instances.to("cuda")
        sample.gt_instances.bboxes = sample.gt_instances.bboxes.float()
    with pytest.raises(RuntimeError, match="Index put requires the source and destination dtypes match"):
        step(stock, inputs, samples)
    for _ in range(3):  # eager (the kind's warm-up), captured, replayed
        losses = step(fast, inputs, samples)
        assert all(torch.isfinite(value).all() for value in losses.values())
        assert all(torch.isfinite(p.grad).all() for p in fast.parameters() if p.grad is not None)
    assert (region.eager_calls, len(region.captured)) == (1, 1) and region.replays >= 1
