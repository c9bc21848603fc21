"""Graph-replayed training of the detectors gives the eager step's losses and gradients.

- on the CPU, the captured region of Deformable-DETR (plain and two-stage), DINO (padding masks from a device tensor
  of image sizes; DINO's denoising queries padded to a fixed count) and Mask2Former, run eagerly and replayed from
  emulated graphs, gives the stock ``loss`` to float64 rounding (Mask2Former: float32), dropout included;
- on a GPU, real CUDA graphs: losses and gradients over optimizer steps and two input shapes equal eager.
"""
import copy

import pytest
import stock_worker
import torch
from emulated_graphs import EmulatedGraphRegion
from small_detectors import (DETECTOR_CONFIGS, PANOPTIC_STUFF, PANOPTIC_THINGS, small_detector,
                             with_fractional_offsets)
from torch import nn

import deform_plugin  # noqa: F401  (mmcv-lite stand-in; registers our module)
from deform_plugin.cuda_graphs import CapturePolicy
from deform_plugin.integration.mmdet_fast_paths import apply_fast_paths

def _training_batch(height=224, width=256, sizes=((224, 256), (200, 232)), seed=0, device="cpu",
                    dtype=torch.float64, panoptic=False):
    """A batch with random boxes and their masks; ``panoptic``: labels of the small panoptic detector's things and
    each image's semantic map (its things, one or two stuff classes in bands, void elsewhere), as mmdet's
    ``LoadPanopticAnnotations`` and the padding data preprocessor make them (int32, 255 for void and padding)."""
    from mmengine.structures import InstanceData, PixelData
    inputs, samples = stock_worker.detection_inputs(batch=len(sizes), height=height, width=width, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1)
    num_thing_classes = PANOPTIC_THINGS if panoptic else 80
    for index, (sample, (h, w), num_gts) in enumerate(zip(samples, sizes, (3, 5, 2, 4))):
        sample.set_metainfo(dict(img_shape=(h, w), ori_shape=(h, w)))
        centre = torch.rand(num_gts, 2, generator=generator) * 0.6 + 0.2
        half = torch.rand(num_gts, 2, generator=generator) * 0.15 + 0.05
        boxes = torch.cat([centre - half, centre + half], 1) * torch.tensor([w, h, w, h])
        labels = torch.randint(0, num_thing_classes, (num_gts,), generator=generator)
        masks = _box_masks(boxes, height, width)
        sample.gt_instances = InstanceData(bboxes=boxes.to(device=device, dtype=dtype), labels=labels.to(device),
                                           masks=masks)
        if panoptic:
            sem_seg = torch.full((height, width), 255, dtype=torch.int32)
            first_stuff = PANOPTIC_THINGS + (seed + index) % PANOPTIC_STUFF
            sem_seg[:h // 3, :w] = first_stuff
            if index == 0:  # a second stuff class below the first image's things
                sem_seg[2 * h // 3:h, :w] = PANOPTIC_THINGS + (seed + 1) % PANOPTIC_STUFF
            for label, mask in zip(labels.tolist(), torch.from_numpy(masks.masks).bool()):
                sem_seg[mask] = label
            sample.gt_sem_seg = PixelData(sem_seg=sem_seg[None].to(device))
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
# stock mmdet. The DETRs run in float64.
_TEST_DTYPES = {name: torch.float32 if name.startswith("mask2former") else torch.float64 for name in DETECTOR_CONFIGS}
# Fewer layers than the configs' (see small_detector): the DETRs keep two encoder and two decoder layers, so that a
# layer runs on what another hands it (the refined reference points); Mask2Former one pixel-decoder layer and one round
# of three transformer-decoder layers over its feature levels (each on the masks of the one before). Narrow FFNs
# (256 channels): the fused and the recomputed FFNs run the same code at any width.
_TEST_LAYERS = {name: 1 if name.startswith("mask2former") else 2 for name in DETECTOR_CONFIGS}
# (padded height, each image's size) of the batches (160 px wide). Same padded shape, other image sizes: the first
# call runs the region eagerly (the warm-up), the second captures, all replay after; then another padded shape,
# captured at its first call. (Small images: the two-stage encoders still have more tokens, 376 to 426, than their
# top-k takes queries, 100.)
_BATCHES = [(128, ((128, 160), (112, 136))), (128, ((96, 160), (128, 80))), (128, ((128, 120), (128, 160))),
            (112, ((112, 160), (84, 124)))]
# Plain Deformable-DETR differs from the two-stage variant in its region's pieces only: no proposals (the queries'
# reference points come from their embeddings), one class and box branch registered under every decoder layer's
# name: the warm-up and a first-call capture of another shape. The refine variant has nothing of its own (its
# branches are two-stage's, its decoder plain's): the GPU test below runs it.
# The panoptic Mask2Former's region is the instance one's; its tail makes stuff targets from the semantic maps (their
# stuff classes copied to the host ahead of the forward): the same two batches.
_SHORT_RUNS = {"deformable-detr": [0, 3], "mask2former-panoptic": [0, 3]}
_CPU_REPLAY_DETECTORS = [name for name in DETECTOR_CONFIGS if name != "deformable-detr-refine"]


# DINO also with its backbone and neck graphed as a region of their own, as the DETRs run under DDP (DINO's region
# takes the most inputs; Deformable-DETR's passes the features the same way). Mask2Former keeps one region.
@pytest.mark.parametrize("name,split", [(name, False) for name in _CPU_REPLAY_DETECTORS] + [("dino", True)])
def test_replays_give_the_stock_losses_and_gradients_for_other_image_sizes(name, split):
    dtype = _TEST_DTYPES[name]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # DINO's denoising generator makes its query tables with the default dtype
    try:
        _check_replays_against_stock(name, dtype, split)
    finally:
        torch.set_default_dtype(previous)


def _check_replays_against_stock(name, dtype, split):
    layers = _TEST_LAYERS[name]
    stock = small_detector(name, dtype=dtype, layers=layers, feedforward_channels=256)
    fast = copy.deepcopy(stock)
    # Mask2Former as its fast config runs it: the replayed network feeds the one-pass matching and losses. The FFN
    # memory paths are captured and replayed too: Deformable-DETR's FFNs (dropout 0.1; one per encoder and decoder
    # layer) fuse their ReLU and dropout, DINO's and Mask2Former's (dropout 0) recompute their hidden layers in the
    # backward.
    mask2former = name.startswith("mask2former")
    changed = apply_fast_paths(fast, cuda_graphs=True, batched_matching=mask2former,
                               relu_dropout_fusion=True, ffn_recompute=True, split_graphs_at_features=split,
                               capture_policy=CapturePolicy(capture_after=1))
    assert changed["cuda_graphs"] == 1 and changed["sync_free_forward"] == 1  # the detector or the pixel decoder
    # Deformable-DETR's FFNs draw dropout (fused), DINO's and Mask2Former's do not (recomputed).
    deformable_detr = name.startswith("deformable-detr")
    assert changed["relu_dropout_fusion"] == (2 * layers if deformable_detr else 0)
    assert (changed["ffn_recompute"] > 0) == (not deformable_detr)
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
    batches = [_BATCHES[index] for index in _SHORT_RUNS.get(name, range(len(_BATCHES)))]
    for height, sizes in batches:
        inputs, samples = _training_batch(height=height, width=160, sizes=sizes, seed=len(sizes[0]) + sizes[1][0],
                                          dtype=dtype, panoptic=name == "mask2former-panoptic")
        expected, expected_grads = _loss_and_grads(stock, inputs, samples)
        got, got_grads = _loss_and_grads(fast, inputs, samples)
        if mask2former:  # the ground truth made without syncs took the stuff classes queued ahead of the forward
            assert "copy_targets_ahead" in vars(fast.panoptic_head)
            assert "_stuff_classes_ahead" not in vars(fast.panoptic_head)
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], **loss_tolerance, msg=key)
        for ours, theirs in zip(got_grads, expected_grads):
            if theirs is not None:
                torch.testing.assert_close(ours, theirs, **grad_tolerance)
    expected_counts = (1, 1, 1, 1) if name in _SHORT_RUNS else (1, 3, 2, 1)
    for each in regions:
        assert (each.eager_calls, each.replays, len(each.captured), each.first_call_captures) == expected_counts


# Batches of three padded shapes whose feature maps (strides 8-64) fall into one 64 px feature bucket, then one into
# another; each batch has a padded image, and in all but the second the first image fills the batch (stock has no
# padding token for it: the bucket's added tokens must stay out of its top-k). Plain Deformable-DETR's transformer
# differs from two-stage's in its pre-decoder only, which reads no token: its feature buckets are tested in
# inference (test_mmdet_feature_bucket_inference.py).
_FEATURE_BUCKET_BATCHES = [(128, 160, ((128, 160), (112, 136))), (120, 152, ((96, 152), (120, 80))),
                           (104, 160, ((104, 160), (84, 124))), (136, 160, ((136, 160), (100, 150)))]


@pytest.mark.parametrize("name", ["deformable-detr-two-stage", "dino"])
def test_feature_buckets_give_the_unpadded_losses_and_gradients(name):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        # Dropout off: it draws over the padded tokens. mmdet makes the reference points and valid ratios in float32:
        # padding changes their rounding (relative 1e-7), hence the tolerances and the fractional sampling offsets.
        stock = with_fractional_offsets(
            _without_dropout(small_detector(name, dtype=torch.float64, layers=2, feedforward_channels=256)))
        fast = copy.deepcopy(stock)
        apply_fast_paths(fast, cuda_graphs=True, feature_bucket_size=64, capture_policy=CapturePolicy(capture_after=1))
        assert fast.graphed_feature_bucket_size == 64
        features_region, region = fast.graphed_training_regions
        for each in (features_region, region):
            each.__class__ = EmulatedGraphRegion
        for height, width, sizes in _FEATURE_BUCKET_BATCHES:
            inputs, samples = _training_batch(height=height, width=width, sizes=sizes, seed=height + width)
            expected, expected_grads = _loss_and_grads(stock, inputs, samples)
            got, got_grads = _loss_and_grads(fast, inputs, samples)
            assert set(got) == set(expected)
            for key in expected:
                torch.testing.assert_close(got[key], expected[key], rtol=1e-7, atol=1e-9, msg=key)
            for ours, theirs in zip(got_grads, expected_grads):
                if theirs is not None:
                    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    finally:
        torch.set_default_dtype(previous)
    # Four batch shapes: the features region meets each once (its warm-up, then a capture of each new one); the
    # transformer's region two buckets: the first warmed up, then captured and replayed for two other batch shapes.
    assert len(features_region.captured) == 3 and features_region.eager_calls == 1
    assert len(region.captured) == 2 and region.replays == 3 and region.eager_calls == 1


def test_feature_buckets_pad_each_level_to_the_bucket_with_stocks_masks():
    from deform_plugin.integration.mmdet_fast_paths.padded_levels import bucketed_level_shape, pad_levels
    from deform_plugin.integration.mmdet_fast_paths.sync_free_forward import level_masks_from_image_sizes
    assert bucketed_level_shape((101, 167), (801, 1333), 128) == (112, 176)  # stride 8: 16 cells
    assert bucketed_level_shape((13, 21), (801, 1333), 128) == (14, 22)  # stride 64: 2 cells
    assert bucketed_level_shape((13, 21), (801, 1333), 32) == (13, 21)  # stride 64: one cell at least
    features = [torch.randn(2, 3, 17, 23), torch.randn(2, 3, 9, 12)]
    sizes = torch.tensor([[130, 180], [101, 75]])
    levels = pad_levels(features, sizes, (133, 180), 64)
    stock_masks = level_masks_from_image_sizes([f.shape[-2:] for f in features], sizes, 133, 180, torch.float32)
    assert [tuple(f.shape[-2:]) for f in levels.features] == [(24, 24), (12, 12)]
    for feat, padded, mask, padded_mask in zip(features, levels.features, stock_masks, levels.masks):
        h, w = feat.shape[-2:]
        assert torch.equal(padded[..., :h, :w], feat) and not padded[..., h:, :].any() and not padded[..., w:].any()
        assert torch.equal(padded_mask[:, :h, :w], mask) and padded_mask[:, h:].all() and padded_mask[:, :, w:].all()
    assert levels.unpadded_shapes.tolist() == [[17, 23], [9, 12]]
    # The unpadded tokens, flattened level by level as the encoder takes them, in stock's order.
    flat = torch.cat([f.flatten(2) for f in levels.features], 2)
    assert torch.equal(flat[..., levels.token_index], torch.cat([f.flatten(2) for f in features], 2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("name", ["deformable-detr-two-stage", "dino"])
@pytest.mark.parametrize("amp", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_feature_buckets_on_cuda_graphs_match_eager(name, amp):
    eager = with_fractional_offsets(_without_dropout(small_detector(name, dtype=torch.float32))).cuda()
    apply_fast_paths(eager, sync_free_forward=True)
    graphed = copy.deepcopy(eager)
    apply_fast_paths(graphed, cuda_graphs=True, feature_bucket_size=128, capture_policy=CapturePolicy(capture_after=1))
    features_region, region = graphed.graphed_training_regions
    # Six batch shapes, two 128 px feature buckets.
    shapes = [(224, 256), (232, 248), (216, 256), (224, 240), (296, 256), (304, 240)]
    for step, (h, w) in enumerate(shapes):
        inputs, samples = _training_batch(h, w, sizes=((h, w), (h - 40, w - 24)), seed=step, device="cuda",
                                          dtype=torch.float32)
        totals = []
        for model in (eager, graphed):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            with torch.autocast("cuda", dtype=amp or torch.float32, enabled=amp is not None):
                losses = model.loss(inputs, copy.deepcopy(samples))
            total = sum(v.sum() for v in losses.values() if isinstance(v, torch.Tensor))
            total.backward()
            totals.append((float(total), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
        (eager_total, eager_grads), (graph_total, graph_grads) = totals
        # In bf16 the padded GEMMs round differently from the unpadded ones (other shapes, other kernels), and an
        # untrained detector's top-k and matching hold near-ties that such rounding flips (measured on an H200: up
        # to 14% of the gradients' norm, losses within 2%); in fp32 the two agree to float rounding.
        loss_tolerance, grad_tolerance = (2e-2, 0.3) if amp else (1e-4, 1e-3)
        assert abs(graph_total - eager_total) <= loss_tolerance * abs(eager_total), (step, graph_total, eager_total)
        assert all(bool(g.isfinite().all()) for g in graph_grads)
        num = sum(float((g - e).norm() ** 2) for g, e in zip(graph_grads, eager_grads)) ** 0.5
        den = sum(float(e.norm() ** 2) for e in eager_grads) ** 0.5
        assert num <= grad_tolerance * den, (step, num / den)
    # The first call warms up eagerly; every new shape after it is captured at its first call and replayed.
    assert len(region.captured) == 2 and region.replays == 5 and region.eager_calls == 1
    assert len(features_region.captured) == 5 and features_region.replays == 5


def test_feature_bucket_size_is_checked():
    from deform_plugin.integration.mmdet_fast_paths import FastPaths
    with pytest.raises(ValueError, match=r"feature_bucket_size must be an int >= 0 .* got -8"):
        FastPaths(feature_bucket_size=-8)
    with pytest.raises(ValueError, match=r"feature_bucket_size .* got True"):
        FastPaths(feature_bucket_size=True)


@pytest.mark.parametrize("max_num_target", [0, 1, 3, 7, 25])
def test_the_padded_denoising_mask_is_mmdets_for_the_real_queries(max_num_target):
    from mmdet.models.layers import CdnQueryGenerator

    from deform_plugin.integration.mmdet_fast_paths.graphed_inputs import (padded_denoising_count,
                                                                           padded_denoising_mask)
    num_matching = 10
    generator = CdnQueryGenerator(num_classes=80, embed_dims=32, num_matching_queries=num_matching,
                                  group_cfg=dict(dynamic=True, num_dn_queries=20))
    num_groups = generator.get_num_groups(max_num_target)
    stock = generator.generate_dn_mask(max_num_target, num_groups, device="cpu")
    num_denoising = 2 * max_num_target * num_groups
    padded = padded_denoising_count(generator, num_denoising)
    # Up to 20 targets the count is fixed (2 * num_dn_queries); 25 targets make one group of 50 queries.
    assert padded == (40 if max_num_target <= 20 else 64)
    ours = padded_denoising_mask(num_denoising, 2 * max_num_target, padded, num_matching, "cpu")
    real = torch.cat([torch.arange(num_denoising), torch.arange(padded, padded + num_matching)])
    padding = torch.arange(num_denoising, padded)
    assert torch.equal(ours[real][:, real], stock)
    assert ours[real][:, padding].all() and ours[padding][:, real].all()
    assert torch.equal(ours[padding][:, padding], ~torch.eye(len(padding), dtype=torch.bool))


def test_detectors_without_the_stock_pieces_are_left_alone():
    from deform_plugin.integration.mmdet_fast_paths.graphed_training import enable_cuda_graph_training
    assert enable_cuda_graph_training(nn.Linear(2, 2)) is None
    detector = small_detector("dino", dtype=torch.float32)
    detector.loss = lambda *args: None  # a user's own loss
    assert enable_cuda_graph_training(detector) is None


def _without_dropout(model):
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        elif isinstance(module, nn.MultiheadAttention):  # its attention dropout is a float, not a module
            module.dropout = 0.0
    return model


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("name,split,slots", [(name, False, False) for name in DETECTOR_CONFIGS]
                         + [("dino", True, False)] + [(name, False, True) for name in DETECTOR_CONFIGS])
@pytest.mark.parametrize("amp", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_cuda_graph_training_matches_eager_over_optimizer_steps(name, split, slots, amp):
    from deform_plugin.engine.data_parallel import ParameterGradientSlots
    # Dropout off: replayed dropout draws other numbers than eager dropout.
    eager = _without_dropout(small_detector(name, dtype=torch.float32)).cuda()
    apply_fast_paths(eager, sync_free_forward=True)
    graphed = copy.deepcopy(eager)
    # As the fast configs run them (Mask2Former's one-pass matching draws stock's random points in stock's order);
    # with gradient slots as FastPathsHook gives them to a model that DistributedDataParallel does not wrap.
    gradient_slots = ParameterGradientSlots(graphed.parameters()) if slots else None
    apply_fast_paths(graphed, cuda_graphs=True, batched_matching=name.startswith("mask2former"),
                     split_graphs_at_features=split, gradient_slots=gradient_slots,
                     capture_policy=CapturePolicy(capture_after=1))
    regions = graphed.graphed_training_regions
    assert len(regions) == (2 if split else 1)
    optimizer = torch.optim.SGD([p for p in eager.parameters() if p.requires_grad], lr=1e-3)
    shapes = [(224, 256), (224, 256), (256, 224), (224, 256), (256, 224), (256, 224), (224, 256)]
    for step, (h, w) in enumerate(shapes):
        inputs, samples = _training_batch(h, w, sizes=((h, w), (h - 32, w - 16 * step)), seed=step, device="cuda",
                                          dtype=torch.float32, panoptic=name == "mask2former-panoptic")
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

    from deform_plugin.integration.mmdet_fast_paths.graphed_inputs import denoising_queries
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
        label, bbox, group_size, meta = denoising_queries(generator, samples)
    assert torch.equal(label, stock_label) and torch.equal(bbox, stock_bbox)
    assert meta == stock_meta and group_size == 2 * max(num_gts)
    assert spy.calls == [("nonzero", "generate_dn_label_query")]
