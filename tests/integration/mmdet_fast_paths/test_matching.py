"""hungarian_host_syncs: the fewer-syncs Hungarian assign, its cost terms and the DETR head's targets from it give
bitwise the stock assignments and targets."""
import pytest
import torch
from detr_heads import hungarian_assigner, random_boxes
from torch import nn

import deform_plugin  # noqa: F401  (mmcv stand-in where mmcv-lite is installed)
from deform_plugin.integration.mmdet_fast_paths import apply_fast_paths


@pytest.mark.parametrize("num_gts", [0, 1, 7, 40], ids=lambda n: f"gts{n}")
def test_fewer_syncs_assign_is_bitwise_the_stock_assignment(num_gts):
    from mmengine.structures import InstanceData

    from deform_plugin.integration.mmdet_fast_paths.matching import _assign_with_fewer_host_syncs
    generator = torch.Generator().manual_seed(num_gts)
    num_preds, height, width = 30, 64, 96
    xy = torch.rand(num_preds, 2, generator=generator) * torch.tensor([width, height]) * 0.7
    pred = InstanceData(scores=torch.randn(num_preds, 5, generator=generator),
                        bboxes=torch.cat([xy, xy + 5 + torch.rand(num_preds, 2, generator=generator) * 20], 1))
    gxy = torch.rand(num_gts, 2, generator=generator) * torch.tensor([width, height]) * 0.7
    gt = InstanceData(bboxes=torch.cat([gxy, gxy + 5 + torch.rand(num_gts, 2, generator=generator) * 20], 1),
                      labels=torch.randint(0, 5, (num_gts,), generator=generator))
    meta = dict(img_shape=(height, width))
    assigner = hungarian_assigner()
    stock = assigner.assign(pred_instances=pred, gt_instances=gt, img_meta=meta)
    fast = _assign_with_fewer_host_syncs(assigner, pred_instances=pred, gt_instances=gt, img_meta=meta)
    assert fast.num_gts == stock.num_gts
    assert torch.equal(fast.gt_inds, stock.gt_inds) and fast.gt_inds.dtype == stock.gt_inds.dtype
    assert torch.equal(fast.labels, stock.labels) and fast.labels.dtype == stock.labels.dtype
    if num_gts:
        assert int((stock.gt_inds > 0).sum()) == min(num_gts, num_preds)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", ["iou", "iof", "giou"])
def test_bbox_overlaps_without_sync_is_bitwise_mmdets(mode, dtype):
    from mmdet.structures.bbox import bbox_overlaps

    from deform_plugin.integration.mmdet_fast_paths.matching import bbox_overlaps_without_sync
    generator = torch.Generator().manual_seed(0)
    first = random_boxes(13, generator, degenerate=2).to(dtype)
    second = random_boxes(7, generator, degenerate=1).to(dtype)
    aligned = random_boxes(13, generator, degenerate=3).to(dtype)
    for eps in (1e-6, 1e-7):
        for a, b, is_aligned in ((first, second, False), (first, aligned, True), (first[:0], second, False)):
            stock = bbox_overlaps(a, b, mode=mode, is_aligned=is_aligned, eps=eps)
            ours = bbox_overlaps_without_sync(a, b, mode=mode, is_aligned=is_aligned, eps=eps)
            assert ours.dtype == stock.dtype and ours.shape == stock.shape
            assert torch.equal(ours, stock), (mode, is_aligned, eps)
    with pytest.raises(ValueError, match="mode must be"):
        bbox_overlaps_without_sync(first, second, mode="diou")
    with pytest.raises(ValueError, match="as many boxes"):
        bbox_overlaps_without_sync(first, second, is_aligned=True)


@pytest.mark.parametrize("box_format", ["xywh", "xyxy"])
def test_box_match_costs_without_sync_are_bitwise_mmdets(box_format):
    from mmdet.models.task_modules.assigners.match_cost import BBoxL1Cost, IoUCost
    from mmengine.structures import InstanceData

    from deform_plugin.integration.mmdet_fast_paths.matching import _match_cost
    generator = torch.Generator().manual_seed(1)
    pred = InstanceData(bboxes=random_boxes(30, generator, degenerate=2))
    gt = InstanceData(bboxes=random_boxes(6, generator))
    meta = dict(img_shape=(64, 96))
    for cost in (BBoxL1Cost(weight=5.0, box_format=box_format), IoUCost(iou_mode="giou", weight=2.0),
                 IoUCost(iou_mode="iou", weight=1.0)):
        stock = cost(pred_instances=pred, gt_instances=gt, img_meta=meta)
        assert torch.equal(_match_cost(cost, pred, gt, meta), stock), cost
    half = InstanceData(bboxes=pred.bboxes.half())  # IoUCost's fp16 overflow guard
    cost = IoUCost(iou_mode="giou", weight=2.0)
    assert torch.equal(_match_cost(cost, half, gt, meta), cost(pred_instances=half, gt_instances=gt, img_meta=meta))


@pytest.mark.parametrize("num_gts", [0, 3, 25], ids=lambda n: f"gts{n}")
def test_detr_head_targets_from_host_assignment_are_bitwise_stock(num_gts):
    from mmdet.registry import MODELS
    from mmdet.utils import register_all_modules
    from mmengine.structures import InstanceData
    register_all_modules(init_default_scope=True)
    head = MODELS.build(dict(
        type="DeformableDETRHead", num_classes=5, embed_dims=32, sync_cls_avg_factor=False,
        loss_cls=dict(type="FocalLoss", use_sigmoid=True, gamma=2.0, alpha=0.25, loss_weight=2.0),
        train_cfg=dict(assigner=dict(type="HungarianAssigner", match_costs=[
            dict(type="FocalLossCost", weight=2.0), dict(type="BBoxL1Cost", weight=5.0, box_format="xywh"),
            dict(type="IoUCost", iou_mode="giou", weight=2.0)]))))
    holder = nn.Module()
    holder.bbox_head = head
    generator = torch.Generator().manual_seed(num_gts)
    num_queries, height, width = 20, 48, 80
    cls_score = torch.randn(num_queries, 5, generator=generator)
    bbox_pred = torch.rand(num_queries, 4, generator=generator) * 0.5 + 0.1
    gxy = torch.rand(num_gts, 2, generator=generator) * torch.tensor([width, height]) * 0.6
    gt = InstanceData(bboxes=torch.cat([gxy, gxy + 4 + torch.rand(num_gts, 2, generator=generator) * 15], 1),
                      labels=torch.randint(0, 5, (num_gts,), generator=generator))
    meta = dict(img_shape=(height, width))
    stock = head._get_targets_single(cls_score, bbox_pred, gt, meta)
    assert apply_fast_paths(holder, hungarian_host_syncs=True) == {"hungarian_host_syncs": 1}
    assert "_get_targets_single" in vars(head)
    fast = head._get_targets_single(cls_score, bbox_pred, gt, meta)
    for name, a, b in zip(("labels", "label_weights", "bbox_targets", "bbox_weights", "pos_inds", "neg_inds"),
                          stock, fast):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert len(stock[4]) == min(num_gts, num_queries)
