"""Mask2Former's ground truth made without host syncs (batched_matching): mmdet's labels and masks for instance and
panoptic batches (things, stuff classes from the semantic maps, void), and with the one-pass losses the stock
panoptic losses and gradients, waiting for the GPU only for the cost matrices."""
import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from host_transfers import HostTransferSpy, cuda_syncs_of
from torch import nn

import deform_plugin  # noqa: F401  (mmcv stand-in where mmcv-lite is installed)
from deform_plugin.integration.mmdet_fast_paths import apply_fast_paths, mask2former_targets

ROOT = Path(__file__).resolve().parents[3]
THINGS, STUFF = 4, 3  # a handful of classes: things 0-3, stuff 4-6, 255 void
VOID = 255


@pytest.fixture(scope="module")
def panoptic_head():
    """The panoptic config's head with a small label space (and fewer queries and points); no test changes it."""
    from mmengine.config import Config
    from mmdet.registry import MODELS
    from mmdet.utils import register_all_modules
    register_all_modules(init_default_scope=True)
    cfg = Config.fromfile(str(ROOT / "configs/mask2former/mask2former_r50_8xb2-lsj-50e_coco-panoptic_deform-plugin.py"))
    head_cfg = cfg.model.panoptic_head.copy()
    head_cfg.update(train_cfg=cfg.model.train_cfg, test_cfg=cfg.model.test_cfg, num_queries=20,
                    num_things_classes=THINGS, num_stuff_classes=STUFF, in_channels=[64, 128, 256, 512])
    head_cfg.loss_cls.class_weight = [1.0] * (THINGS + STUFF) + [0.1]
    head_cfg.train_cfg.num_points = 256
    return MODELS.build(head_cfg)


def _fast_copy(head):
    fast = copy.deepcopy(head)
    holder = nn.Module()
    holder.panoptic_head = fast
    assert apply_fast_paths(holder, batched_matching=True)["batched_matching"] == 1
    assert "preprocess_gt" in vars(fast) and "copy_targets_ahead" in vars(fast)
    return fast


# Per image: (thing labels, stuff classes painted into the map, extra values in the map); None: no semantic map.
_CASES = {
    # things over two stuff classes and void; the next image has no thing, one stuff class, and a class id past
    # the label space (mmdet skips it)
    "panoptic": [((0, 3, 3), (4, 6), ()), ((), (5,), (9,))],
    "no-stuff": [((1, 2), (), ()), ((0,), (), ())],  # things and void only: labels and masks are the things'
    "instance": [((0, 1, 2), None, ()), ((3,), None, ())],  # no semantic maps (instance segmentation)
}


def _ground_truth(case, dtype=torch.int32, height=24, width=32, seed=0):
    """Per image its InstanceData (labels, BitmapMasks of non-overlapping things) and its semantic map as the
    panoptic pipeline makes it (things and stuff by class, void elsewhere) or None."""
    from mmdet.structures.mask import BitmapMasks
    from mmengine.structures import InstanceData, PixelData
    generator = torch.Generator().manual_seed(seed)
    instances, maps = [], []
    for things, stuff, extra in _CASES[case]:
        sem_seg = torch.full((height, width), VOID, dtype=torch.int32)
        for band, label in enumerate(stuff or ()):  # horizontal bands of stuff
            sem_seg[band * height // 4:(band + 1) * height // 4] = label
        for label in extra:
            sem_seg[-2:, :4] = label
        masks = np.zeros((len(things), height, width), dtype=np.uint8)
        for index, label in enumerate(things):
            top = int(torch.randint(0, height - 6, (1,), generator=generator))
            masks[index, top:top + 6, 6 * index:6 * index + 5] = 1  # side by side: no overlap
            sem_seg[torch.from_numpy(masks[index]).bool()] = label
        instances.append(InstanceData(labels=torch.tensor(things, dtype=torch.long),
                                      masks=BitmapMasks(masks, height, width)))
        maps.append(None if stuff is None else PixelData(sem_seg=sem_seg[None].to(dtype)))
    return instances, maps


def _assert_same_targets(ours, theirs):
    assert len(ours) == len(theirs)
    for got, expected in zip(ours, theirs):
        assert got.labels.dtype == expected.labels.dtype and torch.equal(got.labels, expected.labels)
        assert got.masks.dtype == expected.masks.dtype and torch.equal(got.masks, expected.masks)


# The panoptic pipeline's maps are int32; the stuff labels keep the map's dtype whatever it is.
@pytest.mark.parametrize("case, dtype", [("panoptic", torch.int32), ("panoptic", torch.uint8),
                                         ("no-stuff", torch.int32), ("instance", None)],
                         ids=["panoptic-int32", "panoptic-uint8", "no-stuff", "instance"])
def test_sync_free_ground_truth_is_mmdets_without_a_host_read(case, dtype, panoptic_head):
    stock = panoptic_head
    fast = _fast_copy(stock)
    instances, maps = _ground_truth(case, dtype)
    with HostTransferSpy() as spy:
        expected = stock.preprocess_gt(instances, maps)
    if case == "panoptic":  # mmdet: torch.unique and a read of each class it finds
        assert [operation for operation, _ in spy.calls].count("unique") == 2 and len(spy.calls) > 2 * 3
        assert [len(gt.labels) for gt in expected] == [3 + 2, 1]  # the stuff classes join the things
    with HostTransferSpy() as spy:
        got = fast.preprocess_gt(instances, maps)
    assert spy.calls == []
    _assert_same_targets(got, expected)


def test_stuff_classes_copied_ahead_serve_the_preprocessing_of_those_samples_only(monkeypatch, panoptic_head):
    from mmdet.structures import DetDataSample
    stock = panoptic_head
    fast = _fast_copy(stock)
    made = []
    original = mask2former_targets.StuffClassesOnHost
    monkeypatch.setattr(mask2former_targets, "StuffClassesOnHost",
                        lambda *args: made.append(1) or original(*args))
    instances, maps = _ground_truth("panoptic")
    samples = []
    for gt_instances, sem_seg in zip(instances, maps):
        sample = DetDataSample(gt_instances=gt_instances)
        sample.gt_sem_seg = sem_seg
        samples.append(sample)
    fast.copy_targets_ahead(samples)
    assert made == [1]
    _assert_same_targets(fast.preprocess_gt(instances, maps), stock.preprocess_gt(instances, maps))
    assert made == [1] and "_stuff_classes_ahead" not in vars(fast)  # taken, not made again
    fast.copy_targets_ahead(samples)
    other_maps = [copy.deepcopy(sem_seg) for sem_seg in maps]  # equal maps of other samples: found anew
    _assert_same_targets(fast.preprocess_gt(instances, other_maps), stock.preprocess_gt(instances, maps))
    assert made == [1, 1, 1]
    fast.copy_targets_ahead([DetDataSample(gt_instances=gt) for gt in instances])  # no maps: nothing to copy
    assert made == [1, 1, 1]


def _panoptic_loss_inputs(head, seed=0):
    """A panoptic batch and random predictions of four decoder layers at a quarter of its size."""
    generator = torch.Generator().manual_seed(seed)
    instances, maps = _ground_truth("panoptic", height=64, width=96, seed=seed)
    layers, images, queries = 4, len(instances), head.num_queries
    cls_scores = [torch.randn(images, queries, THINGS + STUFF + 1, generator=generator) for _ in range(layers)]
    mask_preds = [torch.randn(images, queries, 16, 24, generator=generator) * 3 for _ in range(layers)]
    metas = [dict(img_shape=(64, 96))] * images
    return cls_scores, mask_preds, instances, maps, metas


def _loss_and_gradients(head, inputs):
    cls_scores, mask_preds, instances, maps, metas = inputs
    leaves = [t.clone().requires_grad_() for t in cls_scores + mask_preds]
    torch.manual_seed(7)  # the sampled points: the fast path draws mmdet's numbers in mmdet's order
    targets = head.preprocess_gt(instances, maps)
    losses = head.loss_by_feat(leaves[:len(cls_scores)], leaves[len(cls_scores):], targets, metas)
    sum(value.sum() for value in losses.values()).backward()
    return losses, [leaf.grad for leaf in leaves]


def test_panoptic_targets_and_one_pass_losses_give_the_stock_losses_and_gradients_with_one_host_copy(panoptic_head):
    stock = panoptic_head
    fast = _fast_copy(stock)
    inputs = _panoptic_loss_inputs(stock)
    expected, expected_grads = _loss_and_gradients(stock, inputs)
    with HostTransferSpy() as spy:
        got, got_grads = _loss_and_gradients(fast, inputs)
    assert [operation for operation, _ in spy.calls] == ["cpu"]  # the cost matrices' copy
    assert list(got) == list(expected) and len(expected) == 12
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)
    for ours, theirs in zip(got_grads, expected_grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs are a CUDA matter")
def test_panoptic_targets_and_one_pass_losses_wait_for_the_gpu_once(panoptic_head):
    stock = copy.deepcopy(panoptic_head).cuda()
    fast = _fast_copy(stock)
    cls_scores, mask_preds, instances, maps, metas = _panoptic_loss_inputs(stock)
    for gt in instances:
        gt.labels = gt.labels.cuda()
    maps = [sem_seg.to("cuda") for sem_seg in maps]
    inputs = ([t.cuda() for t in cls_scores], [t.cuda() for t in mask_preds], instances, maps, metas)
    syncs = [cuda_syncs_of(lambda: _loss_and_gradients(head, inputs)) for head in (stock, fast)]
    # Stock: per image the thing masks' pageable copy, torch.unique and a read per class it finds, then the
    # matching's and losses' syncs; ours: the one copy of every cost matrix, and a wait on the event after the stuff
    # classes' copy, which the sync debug mode does not count (it waits for the work queued before the copy: under
    # cuda_graphs the copy is queued ahead of the forward).
    assert syncs[0] >= 2 * 4 + 4 * 2 and syncs[1] == 1, syncs
