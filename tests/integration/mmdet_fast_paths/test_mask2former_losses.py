"""Mask2Former's matching and losses in one pass (batched_matching) give the stock losses and gradients, and wait
for the GPU once."""
import copy
from pathlib import Path

import pytest
import torch
from gloo_ranks import run_gloo_ranks
from host_transfers import cuda_syncs_of
from torch import nn

import deform_plugin  # noqa: F401  (mmcv stand-in where mmcv-lite is installed)
from deform_plugin.integration.mmdet_fast_paths import apply_fast_paths

ROOT = Path(__file__).resolve().parents[3]


def _mask2former_head():
    from mmengine.config import Config
    from mmdet.registry import MODELS
    from mmdet.utils import register_all_modules
    register_all_modules(init_default_scope=True)
    cfg = Config.fromfile(str(ROOT / "configs/mask2former/mask2former_r50_8xb2-lsj-50e_coco_deform-plugin.py"))
    head_cfg = cfg.model.panoptic_head.copy()
    head_cfg.update(train_cfg=cfg.model.train_cfg, test_cfg=cfg.model.test_cfg, num_queries=20)
    head_cfg.train_cfg.num_points = 256
    head_cfg.in_channels = [64, 128, 256, 512]
    return MODELS.build(head_cfg)


def _mask2former_loss_inputs(num_gts_per_image, num_classes, seed=0):
    from mmengine.structures import InstanceData
    generator = torch.Generator().manual_seed(seed)
    layers, queries, height, width = 4, 20, 16, 24
    cls_scores = [torch.randn(len(num_gts_per_image), queries, num_classes + 1, generator=generator)
                  for _ in range(layers)]
    mask_preds = [torch.randn(len(num_gts_per_image), queries, height, width, generator=generator) * 3
                  for _ in range(layers)]
    gts = []
    for num_gts in num_gts_per_image:
        masks = torch.rand(num_gts, 4 * height, 4 * width, generator=generator) < torch.rand(
            num_gts, 1, 1, generator=generator) * 0.5
        gts.append(InstanceData(labels=torch.randint(0, num_classes, (num_gts,), generator=generator), masks=masks))
    return cls_scores, mask_preds, gts, [dict(img_shape=(4 * height, 4 * width))] * len(num_gts_per_image)


@pytest.mark.parametrize("num_gts", [(3, 5), (0, 4), (0, 0), (25, 2)], ids=["gts3-5", "gts0-4", "gts0-0", "gts25-2"])
def test_mask2former_one_pass_matching_gives_the_stock_losses_and_gradients(num_gts, monkeypatch):
    from deform_plugin.integration.mmdet_fast_paths import mask2former_losses
    every_layer_at_once = []
    one_pass = mask2former_losses._mask_losses_of_every_layer
    monkeypatch.setattr(mask2former_losses, "_mask_losses_of_every_layer",
                        lambda *args: every_layer_at_once.append(one_pass(*args)) or every_layer_at_once[-1])
    classification_at_once = []
    one_pass_classification = mask2former_losses._classification_losses_of_every_layer
    monkeypatch.setattr(mask2former_losses, "_classification_losses_of_every_layer",
                        lambda *args: classification_at_once.append(one_pass_classification(*args))
                        or classification_at_once[-1])
    stock_head = _mask2former_head()
    fast_head = copy.deepcopy(stock_head)
    holder = nn.Module()
    holder.panoptic_head = fast_head
    changed = apply_fast_paths(holder, batched_matching=True)
    assert changed["batched_matching"] == 1 and "loss_by_feat" in vars(fast_head)
    cls_scores, mask_preds, gts, metas = _mask2former_loss_inputs(num_gts, stock_head.num_classes)
    results = []
    for head in (stock_head, fast_head):
        leaves = [t.clone().requires_grad_() for t in cls_scores + mask_preds]
        torch.manual_seed(7)  # the sample points are random: the fast path draws mmdet's numbers in mmdet's order
        losses = head.loss_by_feat(leaves[:4], leaves[4:], gts, metas)
        sum(value.sum() for value in losses.values()).backward()
        results.append((losses, [leaf.grad for leaf in leaves], torch.rand(1)))
    (stock, stock_grads, stock_next), (fast, fast_grads, fast_next) = results
    assert list(fast) == list(stock) and len(stock) == 12
    for name in stock:
        assert fast[name].shape == stock[name].shape, name
        torch.testing.assert_close(fast[name], stock[name], rtol=1e-5, atol=1e-6, msg=name)
    for got, expected in zip(fast_grads, stock_grads):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    assert torch.equal(fast_next, stock_next)  # as many random numbers drawn as stock draws
    # The mask losses of all layers in one pass where every gt is matched (20 queries), mmdet's per-layer
    # arithmetic where some are not (25 gts) or none exist.
    assert [result is not None for result in every_layer_at_once] == [sum(num_gts) in (8, 4)]
    assert [result is not None for result in classification_at_once] == [True]  # mmdet's weighted softmax CE
    assert mask2former_losses._batchable_mask2former_head(stock_head)
    assert not mask2former_losses._batchable_mask2former_head(fast_head)  # changed once only


def test_mask2former_one_pass_losses_wait_for_the_gpu_once_on_the_cpu_too():
    """As the DETR heads' test above, for Mask2Former (the CUDA test below counts real syncs): recorded on the CPU,
    the one-pass matching and losses leave the one copy of the cost matrices."""
    from host_transfers import HostTransferSpy
    stock_head = _mask2former_head()
    fast_head = copy.deepcopy(stock_head)
    holder = nn.Module()
    holder.panoptic_head = fast_head
    apply_fast_paths(holder, batched_matching=True)
    cls_scores, mask_preds, gts, metas = _mask2former_loss_inputs((3, 5), stock_head.num_classes)
    recorded = []
    for head in (stock_head, fast_head):
        leaves = [t.clone().requires_grad_() for t in cls_scores + mask_preds]
        with HostTransferSpy() as spy:
            losses = head.loss_by_feat(leaves[:4], leaves[4:], gts, metas)
            sum(value.sum() for value in losses.values()).backward()
        recorded.append([operation for operation, _ in spy.calls])
    stock, fast = recorded
    assert len(stock) >= 4 * 2, stock  # per layer and image at least the cost copy
    assert fast == ["cpu"], fast


@pytest.mark.parametrize("naive_dice", [True, False])
def test_mask2former_cost_matrices_of_every_layer_at_once_are_mmdets(naive_dice):
    from mmengine.structures import InstanceData

    from deform_plugin.integration.mmdet_fast_paths.mask2former_losses import _layered_cost_matrices
    from deform_plugin.integration.mmdet_fast_paths.matching import _cost_matrix
    assigner = _mask2former_head().assigner
    assigner.match_costs[-1].naive_dice = naive_dice
    generator = torch.Generator().manual_seed(3)
    layers, queries, gts, points, classes = 3, 7, 4, 50, 9
    scores = torch.randn(layers, queries, classes + 1, generator=generator)
    mask_points = torch.randn(layers, queries, points, generator=generator) * 3
    gt_points = (torch.rand(layers, gts, points, generator=generator) < 0.4).float()
    labels = torch.randint(0, classes, (gts,), generator=generator)
    ours = _layered_cost_matrices(assigner, scores, mask_points, labels, gt_points)
    assert ours.shape == (layers, queries, gts)
    for layer in range(layers):
        theirs = _cost_matrix(assigner, InstanceData(scores=scores[layer], masks=mask_points[layer]),
                              InstanceData(labels=labels, masks=gt_points[layer]), dict(img_shape=(8, 8)))
        # float32 sums over 50 points, batched or not: equal to a few ulps of the largest terms on any BLAS
        torch.testing.assert_close(ours[layer], theirs, rtol=1e-5, atol=1e-5)
    # Cost terms it does not know: the caller falls back to mmdet's per-layer calls.
    from mmdet.models.task_modules.assigners.match_cost import FocalLossCost
    assigner.match_costs.append(FocalLossCost())
    assert _layered_cost_matrices(assigner, scores, mask_points, labels, gt_points) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs are a CUDA matter")
def test_mask2former_one_pass_losses_wait_for_the_gpu_once():
    stock_head = _mask2former_head().cuda()
    fast_head = copy.deepcopy(stock_head)
    holder = nn.Module()
    holder.panoptic_head = fast_head
    apply_fast_paths(holder, batched_matching=True)
    cls_scores, mask_preds, gts, metas = _mask2former_loss_inputs((3, 5), stock_head.num_classes)
    cls_scores, mask_preds = [t.cuda() for t in cls_scores], [t.cuda() for t in mask_preds]
    for gt in gts:
        gt.labels, gt.masks = gt.labels.cuda(), gt.masks.cuda()
    def loss_and_backward(head):
        leaves = [t.clone().requires_grad_() for t in cls_scores + mask_preds]
        losses = head.loss_by_feat(leaves[:4], leaves[4:], gts, metas)
        sum(value.sum() for value in losses.values()).backward()

    syncs = [cuda_syncs_of(lambda: loss_and_backward(head)) for head in (stock_head, fast_head)]
    # Stock: per (layer, image) the cost copy and the sampler's nonzero calls, per layer more; ours: the one copy
    # of every cost matrix to the host.
    assert syncs[0] >= 4 * 2 * 3 and syncs[1] == 1, syncs


def _mask2former_ddp_worker(rank, out_dir):
    stock_head = _mask2former_head()
    fast_head = copy.deepcopy(stock_head)
    holder = nn.Module()
    holder.panoptic_head = fast_head
    apply_fast_paths(holder, batched_matching=True)
    # Each rank its own gts: the normaliser is the mean of the ranks' matched-mask counts.
    inputs = _mask2former_loss_inputs(((3, 5), (1, 0))[rank], stock_head.num_classes, seed=rank)
    results = []
    for head in (stock_head, fast_head):
        torch.manual_seed(7)
        results.append({k: v.detach() for k, v in head.loss_by_feat(*inputs).items()})
    torch.save(results, out_dir / f"rank{rank}.pt")


def test_mask2former_one_pass_losses_average_the_normaliser_over_ranks_as_stock(tmp_path):
    run_gloo_ranks(_mask2former_ddp_worker, tmp_path)
    for rank in range(2):
        stock, fast = torch.load(tmp_path / f"rank{rank}.pt")
        assert list(fast) == list(stock)
        for name in stock:
            torch.testing.assert_close(fast[name], stock[name], rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")
