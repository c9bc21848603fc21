"""The fast paths of the training step give the stock results.

- the SDPA attention brick gives the stock outputs and gradients (float64);
- the fewer-syncs Hungarian assign, the DETR head's targets from it and batched matching give bitwise the stock
  assignments, targets and losses;
- the sync-free loss normalisers give the stock losses.
"""
import copy
from pathlib import Path

import pytest
import stock_worker
import torch
from gloo_ranks import run_gloo_ranks
from mmcv.cnn.bricks.transformer import MultiheadAttention
from torch import nn

import deform_plugin  # noqa: F401  (mmcv stand-in where mmcv-lite is installed)
from deform_plugin.integration.mmdet_fast_paths import (apply_fast_paths, disable_sdpa_attention, enable_sdpa_attention,
                                                        sdpa_multihead_attention_class)



# ---- SDPA attention brick -----------------------------------------------------------------------------------------

def _attention_pair(batch_first, attn_drop=0.0):
    torch.manual_seed(0)
    # No dropout layer after the attention: mmcv builds its 'Dropout' through the registry of the current default
    # scope, and under mmdet's scope (set by any earlier test that builds an mmdet model) it gets p=0.1.
    stock = MultiheadAttention(embed_dims=32, num_heads=4, attn_drop=attn_drop, batch_first=batch_first,
                               dropout_layer=None).double()
    fast = copy.deepcopy(stock)
    assert enable_sdpa_attention(fast) == 1
    assert type(fast) is sdpa_multihead_attention_class()
    return stock, fast


def _run(module, inputs, kwargs):
    inputs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    query, key, query_pos, key_pos = inputs
    out = module(query=query, key=key, value=key, query_pos=query_pos, key_pos=key_pos, **kwargs)
    grad_out = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    grads = torch.autograd.grad(out, [query, key, query_pos, key_pos, *module.parameters()], grad_out)
    return out, grads


ATTENTION_CASES = [
    pytest.param(dict(batch_first=True, num_keys=None, mask=None), id="self-attn-batch-first"),
    pytest.param(dict(batch_first=False, num_keys=None, mask=None), id="self-attn-seq-first"),
    pytest.param(dict(batch_first=True, num_keys=None, mask="bool-2d"), id="self-attn-dn-mask"),
    pytest.param(dict(batch_first=True, num_keys=23, mask="bool-3d"), id="masked-cross-attn"),
    pytest.param(dict(batch_first=True, num_keys=23, mask="key-padding"), id="cross-attn-key-padding"),
]


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_sdpa_brick_matches_stock_outputs_and_gradients_float64(case):
    batch, num_queries, heads = 2, 17, 4
    num_keys = case["num_keys"] or num_queries
    stock, fast = _attention_pair(case["batch_first"])
    generator = torch.Generator().manual_seed(2)

    def tensor(length):
        shape = (batch, length, 32) if case["batch_first"] else (length, batch, 32)
        return torch.randn(shape, generator=generator, dtype=torch.float64)
    query, query_pos = tensor(num_queries), tensor(num_queries)
    key, key_pos = (query, query_pos) if case["num_keys"] is None else (tensor(num_keys), tensor(num_keys))
    kwargs = {}
    if case["mask"] == "bool-2d":  # DINO's denoising mask: True blocks attention
        mask = torch.rand(num_queries, num_keys, generator=generator) < 0.3
        mask.fill_diagonal_(False)
        kwargs["attn_mask"] = mask
    elif case["mask"] == "bool-3d":  # Mask2Former's masked attention, one map per (image, head)
        mask = torch.rand(batch * heads, num_queries, num_keys, generator=generator) < 0.5
        mask[..., 0] = False
        kwargs["attn_mask"] = mask
    elif case["mask"] == "key-padding":
        padding = torch.zeros(batch, num_keys, dtype=torch.bool)
        padding[1, -5:] = True
        kwargs["key_padding_mask"] = padding
    out_stock, grads_stock = _run(stock, [query, key, query_pos, key_pos], kwargs)
    out_fast, grads_fast = _run(fast, [query, key, query_pos, key_pos], kwargs)
    torch.testing.assert_close(out_fast, out_stock, rtol=1e-10, atol=1e-11)
    for g_fast, g_stock in zip(grads_fast, grads_stock):
        torch.testing.assert_close(g_fast, g_stock, rtol=1e-9, atol=1e-10)


def test_sdpa_brick_in_eval_mode_ignores_attention_dropout_like_stock():
    stock, fast = _attention_pair(batch_first=True, attn_drop=0.1)
    stock.eval()
    fast.eval()
    query = torch.randn(2, 9, 32, dtype=torch.float64)
    torch.testing.assert_close(fast(query), stock(query), rtol=1e-10, atol=1e-11)


def test_sdpa_switch_keeps_parameters_and_state_dict_and_can_be_undone():
    stock, fast = _attention_pair(batch_first=True)
    assert list(fast.state_dict()) == list(stock.state_dict())
    assert disable_sdpa_attention(fast) == 1 and type(fast) is MultiheadAttention


# ---- Hungarian matching -------------------------------------------------------------------------------------------

def _hungarian_assigner():
    from mmdet.models.task_modules.assigners import HungarianAssigner
    return HungarianAssigner(match_costs=[dict(type="FocalLossCost", weight=2.0),
                                          dict(type="BBoxL1Cost", weight=5.0, box_format="xywh"),
                                          dict(type="IoUCost", iou_mode="giou", weight=2.0)])


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
    assigner = _hungarian_assigner()
    stock = assigner.assign(pred_instances=pred, gt_instances=gt, img_meta=meta)
    fast = _assign_with_fewer_host_syncs(assigner, pred_instances=pred, gt_instances=gt, img_meta=meta)
    assert fast.num_gts == stock.num_gts
    assert torch.equal(fast.gt_inds, stock.gt_inds) and fast.gt_inds.dtype == stock.gt_inds.dtype
    assert torch.equal(fast.labels, stock.labels) and fast.labels.dtype == stock.labels.dtype
    if num_gts:
        assert int((stock.gt_inds > 0).sum()) == min(num_gts, num_preds)


def _boxes(count, generator, width=96, height=64, degenerate=0):
    xy = torch.rand(count, 2, generator=generator) * torch.tensor([width, height]) * 0.7
    boxes = torch.cat([xy, xy + 5 + torch.rand(count, 2, generator=generator) * 20], 1)
    boxes[:degenerate, 2:] = boxes[:degenerate, :2]  # zero-area boxes: the eps floor decides their overlaps
    return boxes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", ["iou", "iof", "giou"])
def test_bbox_overlaps_without_sync_is_bitwise_mmdets(mode, dtype):
    from mmdet.structures.bbox import bbox_overlaps

    from deform_plugin.integration.mmdet_fast_paths.matching import bbox_overlaps_without_sync
    generator = torch.Generator().manual_seed(0)
    first, second = _boxes(13, generator, degenerate=2).to(dtype), _boxes(7, generator, degenerate=1).to(dtype)
    aligned = _boxes(13, generator, degenerate=3).to(dtype)
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
    pred = InstanceData(bboxes=_boxes(30, generator, degenerate=2))
    gt = InstanceData(bboxes=_boxes(6, generator))
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


# ---- batched matching and sync-free losses ------------------------------------------------------------------------

def _detr_head(kind):
    from mmdet.registry import MODELS
    from mmdet.utils import register_all_modules
    register_all_modules(init_default_scope=True)
    assigner = dict(type="HungarianAssigner", match_costs=[
        dict(type="FocalLossCost", weight=2.0), dict(type="BBoxL1Cost", weight=5.0, box_format="xywh"),
        dict(type="IoUCost", iou_mode="giou", weight=2.0)])
    common = dict(num_classes=5, embed_dims=32, sync_cls_avg_factor=True,
                  loss_cls=dict(type="FocalLoss", use_sigmoid=True, gamma=2.0, alpha=0.25, loss_weight=2.0),
                  loss_bbox=dict(type="L1Loss", loss_weight=5.0), loss_iou=dict(type="GIoULoss", loss_weight=2.0),
                  train_cfg=dict(assigner=assigner))
    if kind == "dino":
        return MODELS.build(dict(type="DINOHead", **common))
    return MODELS.build(dict(type="DeformableDETRHead", share_pred_layer=False, num_pred_layer=3,
                             as_two_stage=True, **common))


def _loss_inputs(kind, num_gts_per_image, seed=0):
    from mmengine.structures import InstanceData
    generator = torch.Generator().manual_seed(seed)
    layers, batch, queries, height, width = 3, len(num_gts_per_image), 12, 48, 80
    # DINO's denoising part: one group of a positive and a negative query per gt of the fullest image.
    num_denoising = 2 * max(num_gts_per_image) if kind == "dino" else 0
    total = queries + num_denoising
    gts, metas = [], []
    for num_gts in num_gts_per_image:
        xy = torch.rand(num_gts, 2, generator=generator) * torch.tensor([width, height]) * 0.6
        gts.append(InstanceData(bboxes=torch.cat([xy, xy + 4 + torch.rand(num_gts, 2, generator=generator) * 15], 1),
                                labels=torch.randint(0, 5, (num_gts,), generator=generator)))
        metas.append(dict(img_shape=(height, width)))
    cls_scores = torch.randn(layers, batch, total, 5, generator=generator)
    bbox_preds = torch.rand(layers, batch, total, 4, generator=generator) * 0.5 + 0.1
    enc_cls = torch.randn(batch, queries, 5, generator=generator)
    enc_bbox = torch.rand(batch, queries, 4, generator=generator) * 0.5 + 0.1
    args = dict(all_layers_cls_scores=cls_scores, all_layers_bbox_preds=bbox_preds, enc_cls_scores=enc_cls,
                enc_bbox_preds=enc_bbox, batch_gt_instances=gts, batch_img_metas=metas)
    if kind == "dino":
        args["dn_meta"] = dict(num_denoising_queries=num_denoising, num_denoising_groups=1)
    return args


@pytest.mark.parametrize("kind", ["deformable-detr-two-stage", "dino"])
@pytest.mark.parametrize("num_gts", [(3, 5), (0, 4)], ids=["gts3-5", "gts0-4"])
def test_batched_matching_and_sync_free_losses_give_the_stock_losses_bitwise(kind, num_gts, monkeypatch):
    from deform_plugin.integration.mmdet_fast_paths import batched_matching, matching
    stock_head = _detr_head(kind)
    fast_head = copy.deepcopy(stock_head)
    holder = nn.Module()
    holder.bbox_head = fast_head
    changed = apply_fast_paths(holder, batched_matching=True, sync_free_losses=True)
    assert changed == {"hungarian_host_syncs": 1, "batched_matching": 1, "sync_free_losses": 1}
    cost_passes = []
    for module, name in ((matching, "_cost_matrix"), (batched_matching, "_cost_matrix"),
                         (batched_matching, "_batched_cost_matrices")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, __name=name, __original=original, **k:
                            cost_passes.append(__name) or __original(*a, **k))
    inputs = _loss_inputs(kind, num_gts)
    stock = stock_head.loss_by_feat(**inputs)
    fast = fast_head.loss_by_feat(**inputs)
    assert list(fast) == list(stock)
    for name in stock:
        assert torch.equal(fast[name], stock[name]), name
    # One cost pass for every decoder layer (and DINO's encoder) of every image with gts together, batched over the
    # images where several have gts; the two-stage encoder of Deformable-DETR matches binary proposals one pass per
    # image with gts, as before (batched_losses brings them into the step's pass).
    images_with_gts = sum(n > 0 for n in num_gts)
    decoder = ["_batched_cost_matrices" if images_with_gts > 1 else "_cost_matrix"] if images_with_gts else []
    encoder = ["_cost_matrix"] * images_with_gts if kind == "deformable-detr-two-stage" else []
    assert cost_passes == decoder + encoder
    assert fast_head.assigner.solved_ahead == {}  # nothing outlives the step


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_batched_cost_matrices_are_each_images_own_matrix(dtype):
    from mmengine.structures import InstanceData

    from deform_plugin.integration.mmdet_fast_paths.batched_matching import _batchable, _batched_cost_matrices
    from deform_plugin.integration.mmdet_fast_paths.matching import _cost_matrix
    from mmdet.structures.bbox import bbox_cxcywh_to_xyxy
    assigner = _detr_head("dino").assigner
    generator = torch.Generator().manual_seed(3)
    problems = []
    for num_gts, (height, width) in zip((1, 6, 3), ((64, 96), (80, 48), (64, 64))):
        views = [(torch.randn(rows, 5, generator=generator, dtype=dtype),
                  (torch.rand(rows, 4, generator=generator, dtype=dtype) * 0.5 + 0.1)) for rows in (11, 11, 7)]
        gts = InstanceData(bboxes=_boxes(num_gts, generator, width, height, degenerate=1).to(dtype),
                           labels=torch.randint(0, 5, (num_gts,), generator=generator))
        problems.append((gts, dict(img_shape=(height, width)), views))
    assert _batchable(assigner)
    batched = _batched_cost_matrices(assigner, problems)
    assert batched.shape == (3, 29, 6) and batched.dtype == dtype
    for block, (gts, meta, views) in zip(batched, problems):
        height, width = meta["img_shape"]
        factor = torch.tensor([[width, height, width, height]], dtype=dtype)
        preds = InstanceData(scores=torch.cat([s for s, _ in views]),
                             bboxes=bbox_cxcywh_to_xyxy(torch.cat([b for _, b in views])) * factor)
        own = _cost_matrix(assigner, preds, gts, meta)
        if dtype == torch.float64:
            assert torch.equal(block[:, :len(gts)], own)
        else:  # the CPU's vectorised float32 log/pow may round one element apart in another layout (one ulp)
            torch.testing.assert_close(block[:, :len(gts)], own, rtol=1e-6, atol=1e-6)
    from mmdet.models.task_modules.assigners.match_cost import ClassificationCost, FocalLossCost
    assigner.match_costs.append(ClassificationCost(weight=1.0))  # no batched form: each image on its own
    assert not _batchable(assigner)
    assigner.match_costs[-1] = FocalLossCost(binary_input=True)
    assert not _batchable(assigner)


def test_fast_paths_refuse_another_mmdet_version(monkeypatch):
    import mmdet
    monkeypatch.setattr(mmdet, "__version__", "3.2.0")
    holder = nn.Module()
    holder.bbox_head = _detr_head("dino")
    with pytest.raises(RuntimeError, match=r"mirrors private methods of mmdet 3.3.0, but mmdet 3.2.0 is installed"):
        apply_fast_paths(holder, batched_matching=True)
    assert apply_fast_paths(holder, sdpa_attention=True) == {"sdpa_attention": 0}


# ---- sync-free forward --------------------------------------------------------------------------------------------


# Both branches of the stock code (padding masks or none), each on one of the two families it serves.
@pytest.mark.parametrize("config, padded", [
    ("configs/deformable_detr/deformable-detr-refine-twostage_r50_16xb2-50e_coco_deform-plugin.py", False),
    ("configs/dino/dino-4scale_r50_8xb2-12e_coco_deform-plugin.py", True),
    ("configs/mask2former/mask2former_r50_8xb2-lsj-50e_coco_deform-plugin.py", True)],
    ids=["deformable-detr-two-stage-same-size", "dino-padded", "mask2former"])
def test_sync_free_forward_gives_the_stock_outputs_bitwise_and_reads_no_table(config, padded):

    from mmengine.config import Config

    from deform_plugin.ops.msda.level_tables import level_table_host_reads
    root = Path(__file__).resolve().parents[2]
    torch.manual_seed(0)
    stock = stock_worker.build_msda_owner(Config.fromfile(str(root / config)))
    stock.init_weights()
    stock = stock.double().eval()
    fast = copy.deepcopy(stock)
    assert apply_fast_paths(fast, sync_free_forward=True) == {"sync_free_forward": 1}  # the detector or decoder
    # Their configs convert BGR to RGB: the data preprocessor flips on the device (see the preprocessor's test).
    assert fast.data_preprocessor._deform_plugin_flips_channels
    assert not getattr(stock.data_preprocessor, "_deform_plugin_flips_channels", False)
    # DINO selects 900 proposals: the input must give at least that many keys.
    inputs, samples = stock_worker.detection_inputs(batch=2 if padded else 1, height=224, width=256)
    with torch.no_grad():
        expected = stock(inputs, samples, mode="tensor")
        reads = level_table_host_reads()
        got = fast(inputs, samples, mode="tensor")
        assert level_table_host_reads() == reads  # the tables are made on the host: nothing is read back
        got_again = fast(inputs, samples, mode="tensor")
    for ours, theirs, again in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(expected),
                                   torch.utils._pytree.tree_leaves(got_again)):
        assert torch.equal(ours, theirs) and torch.equal(again, theirs)


def test_mask_boxes_are_mmdets_mask2bbox():
    from mmdet.structures.mask import mask2bbox

    from deform_plugin.integration.mmdet_fast_paths.sync_free_forward import mask_boxes
    generator = torch.Generator().manual_seed(0)
    masks = torch.rand(12, 17, 23, generator=generator) > 0.97
    masks[0] = False  # empty
    masks[1] = True  # full
    masks[2] = False
    masks[2, 16, 22] = True  # one corner pixel
    masks[3] = False
    masks[3, 0, 0] = True
    masks[4] = False
    masks[4, 5, 3:9] = True  # one row
    masks[5] = False
    masks[5, 2:11, 7] = True  # one column
    ours = mask_boxes(masks)
    assert ours.dtype == torch.float32 and torch.equal(ours, mask2bbox(masks))
    assert torch.equal(mask_boxes(masks[:0]), mask2bbox(masks[:0]))


@pytest.mark.parametrize("num_stuff_classes", [0, 5])
def test_sync_free_instance_postprocess_is_stock(num_stuff_classes):
    from mmdet.models.seg_heads.panoptic_fusion_heads import MaskFormerFusionHead

    from deform_plugin.integration.mmdet_fast_paths.sync_free_forward import enable_sync_free_forward
    head = MaskFormerFusionHead(num_things_classes=8, num_stuff_classes=num_stuff_classes,
                                test_cfg=dict(max_per_image=30))
    fast = copy.deepcopy(head)
    model = torch.nn.Sequential(fast)
    enable_sync_free_forward(model)
    assert "instance_postprocess" in vars(fast)
    generator = torch.Generator().manual_seed(1)
    mask_cls = torch.randn(12, 8 + num_stuff_classes + 1, generator=generator, dtype=torch.float64)
    mask_pred = torch.randn(12, 19, 21, generator=generator, dtype=torch.float64) - 1.5
    mask_pred[3] = -1.0  # a query with an empty mask
    expected = head.instance_postprocess(mask_cls, mask_pred)
    got = fast.instance_postprocess(mask_cls, mask_pred)
    assert set(got.keys()) == set(expected.keys())
    for key in expected.keys():
        assert torch.equal(got[key], expected[key]), key
    assert len(expected) < 30 if num_stuff_classes else len(expected) == 30


# ---- batched losses -----------------------------------------------------------------------------------------------

def _losses_and_gradients(head, inputs):
    inputs = dict(inputs)
    leaves = {}
    for name in ("all_layers_cls_scores", "all_layers_bbox_preds", "enc_cls_scores", "enc_bbox_preds"):
        leaves[name] = inputs[name] = inputs[name].detach().clone().requires_grad_()
    losses = head.loss_by_feat(**inputs)
    sum(value.sum() for value in losses.values()).backward()
    return losses, {name: leaf.grad for name, leaf in leaves.items()}


@pytest.mark.parametrize("kind", ["deformable-detr-two-stage", "dino"])
@pytest.mark.parametrize("num_gts", [(3, 5), (0, 4), (0, 0)], ids=["gts3-5", "gts0-4", "gts0-0"])
def test_batched_losses_give_the_stock_losses_and_gradients(kind, num_gts, monkeypatch):
    from deform_plugin.integration.mmdet_fast_paths import batched_losses, batched_matching
    stock_head = _detr_head(kind)
    fast_head = copy.deepcopy(stock_head)
    holder = nn.Module()
    holder.bbox_head = fast_head
    changed = apply_fast_paths(holder, sync_free_losses=True, batched_losses=True)
    assert changed["batched_losses"] == 1 and changed["batched_matching"] == 1
    passes = []
    original = batched_losses.layer_losses
    monkeypatch.setattr(batched_losses, "layer_losses", lambda *a, **k: passes.append(a[1].shape[0]) or original(
        *a, **k))
    copies = []
    costs_to_host = batched_matching.costs_to_host
    monkeypatch.setattr(batched_matching, "costs_to_host",
                        lambda costs: copies.append(len(costs)) or costs_to_host(costs))
    per_layer_targets = []
    targets_single = fast_head._get_targets_single
    fast_head._get_targets_single = lambda *a, **k: per_layer_targets.append(1) or targets_single(*a, **k)
    per_layer_denoising = []
    if kind == "dino":
        dn_single = fast_head._loss_dn_single
        fast_head._loss_dn_single = lambda *a, **k: per_layer_denoising.append(1) or dn_single(*a, **k)
    inputs = _loss_inputs(kind, num_gts)
    stock, stock_grads = _losses_and_gradients(stock_head, inputs)
    fast, fast_grads = _losses_and_gradients(fast_head, inputs)
    assert list(fast) == list(stock)
    for name in stock:
        assert fast[name].shape == stock[name].shape, name
        # float32: the same elements, summed per layer over a (layers, ...) view instead of one layer at a time.
        torch.testing.assert_close(fast[name], stock[name], rtol=1e-6, atol=1e-7, msg=name)
    for name in stock_grads:
        torch.testing.assert_close(fast_grads[name], stock_grads[name], rtol=1e-6, atol=1e-8, msg=name)
    # The decoder layers in one pass, the encoder's proposals in another (Deformable-DETR's against class-0 gts).
    assert passes == [3, 1]
    # Their cost matrices (the decoder layers' of every image with gts and, for two-stage Deformable-DETR, the
    # proposals': one block each) reach the host in one copy.
    images_with_gts = sum(n > 0 for n in num_gts)
    assert copies == ([2 if kind == "deformable-detr-two-stage" else 1] if images_with_gts else [])
    assert per_layer_targets == []  # no layer fell back to the per-layer path
    # DINO's denoising losses in one pass too; without any gt there are no denoising queries, and stock runs.
    assert len(per_layer_denoising) == (3 if kind == "dino" and max(num_gts) == 0 else 0)
    assert fast_head.losses_ahead == {}  # nothing outlives the step


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_batched_focal_loss_elements_are_mmdets_focal_loss(dtype):
    # On the CPU mmdet's FocalLoss runs its own formula (binary cross-entropy with logits times the focal weight);
    # ours is mmcv's CUDA kernel's (log of the clamped sigmoid): the same function, equal to rounding. In float32
    # the kernel's log(1 - sigmoid(x)) loses digits for large logits (stock's CUDA values do too): float64 checks
    # the formula over a wide range, float32 at the logits of a training step.
    from mmdet.models.losses import FocalLoss

    from deform_plugin.integration.mmdet_fast_paths.batched_losses import focal_loss_elements
    loss_cls = FocalLoss(use_sigmoid=True, gamma=2.0, alpha=0.25, loss_weight=2.0)
    generator = torch.Generator().manual_seed(0)
    scale = 4.0 if dtype == torch.float64 else 1.0
    scores = (torch.randn(40, 7, generator=generator, dtype=dtype) * scale).requires_grad_()
    labels = torch.randint(0, 8, (40,), generator=generator)  # 7: background
    weights = torch.rand(40, generator=generator, dtype=dtype)
    upstream = torch.randn(40, 7, generator=generator, dtype=dtype)
    ours = focal_loss_elements(loss_cls, scores, labels, weights)
    theirs = loss_cls(scores, labels, weights, reduction_override="none")
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(ours, theirs, **tolerance)
    ours_grad, = torch.autograd.grad((ours * upstream).sum(), scores)
    theirs_grad, = torch.autograd.grad((theirs * upstream).sum(), scores)
    torch.testing.assert_close(ours_grad, theirs_grad, **tolerance)


def test_batched_focal_loss_elements_read_nothing_on_the_host():
    # Meta tensors hold no values: any host read of the labels or scores (mmcv's CUDA launcher reads target.max())
    # raises here; the CUDA test below counts real syncs.
    from mmdet.models.losses import FocalLoss

    from deform_plugin.integration.mmdet_fast_paths.batched_losses import focal_loss_elements
    loss_cls = FocalLoss(use_sigmoid=True, gamma=2.0, alpha=0.25, loss_weight=2.0)
    scores = torch.empty(40, 7, device="meta", dtype=torch.bfloat16, requires_grad=True)
    out = focal_loss_elements(loss_cls, scores, torch.empty(40, dtype=torch.long, device="meta"),
                              torch.empty(40, device="meta"))
    assert out.shape == (40, 7) and out.dtype == torch.float32  # bf16 scores in float32, as mmcv takes them
    grad, = torch.autograd.grad(out.sum(), scores)
    assert grad.shape == (40, 7) and grad.dtype == torch.bfloat16


def _cuda_syncs_of(work) -> int:
    """How many host syncs ``work()`` makes on CUDA (after a warm-up call), counted by the sync debug mode."""
    import warnings
    work()  # warm-up
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            work()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


def _stock_and_fast_losses_under(spy_class, kind):
    """``spy.calls`` of stock's and of the batched head's losses and backward, each run under a fresh ``spy_class()``
    mode, on the same inputs."""
    heads = _stock_and_batched_heads(kind)
    inputs = _loss_inputs(kind, (3, 5))
    calls = []
    for head in heads:
        with spy_class() as spy:
            _losses_and_gradients(head, inputs)
        calls.append(spy.calls)
    return calls


def _stock_and_batched_heads(kind, device="cpu"):
    """A DETR head and its copy with the sync-free, batched losses (and the matching they build on)."""
    stock_head = _detr_head(kind).to(device)
    fast_head = copy.deepcopy(stock_head)
    holder = nn.Module()
    holder.bbox_head = fast_head
    apply_fast_paths(holder, sync_free_losses=True, batched_losses=True)
    return stock_head, fast_head


@pytest.mark.parametrize("kind", ["deformable-detr-two-stage", "dino"])
def test_fast_detr_losses_assign_no_python_scalar_by_index(kind):
    # `x[index] = 1.0` on a CUDA tensor copies the scalar to the device with a blocking copy in torch <= 2.11 (the
    # GPU hosts' torch): one host sync per call, which the CUDA count below found per image in DINO's denoising
    # targets. On the CPU the pattern is visible as an index_put_ whose value is a 0-dim tensor.
    from torch.utils._python_dispatch import TorchDispatchMode

    class ScalarIndexPuts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._schema.name in ("aten::index_put_", "aten::index_put", "aten::_index_put_impl_"):
                self.calls += isinstance(args[2], torch.Tensor) and args[2].dim() == 0
            return func(*args, **(kwargs or {}))

    counts = _stock_and_fast_losses_under(ScalarIndexPuts, kind)
    assert counts[0] > 0 and counts[1] == 0, counts  # stock's targets set their box weights so, per image


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs are a CUDA matter")
@pytest.mark.parametrize("kind", ["deformable-detr-two-stage", "dino"])
def test_fast_detr_losses_wait_for_the_gpu_once_on_cuda(kind):
    stock_head, fast_head = _stock_and_batched_heads(kind, device="cuda")
    inputs = _loss_inputs(kind, (3, 5))
    inputs = {name: value.cuda() if isinstance(value, torch.Tensor) else value for name, value in inputs.items()}
    for gt in inputs["batch_gt_instances"]:
        gt.bboxes, gt.labels = gt.bboxes.cuda(), gt.labels.cuda()
    syncs = [_cuda_syncs_of(lambda: _losses_and_gradients(head, inputs)) for head in (stock_head, fast_head)]
    # Stock: per layer and image the cost copy, the nonzero() calls, mmcv's focal loss reading target.max(); ours:
    # the one copy of every cost matrix (the focal loss without mmcv's read).
    assert syncs[0] >= 3 * 2 * 3 and syncs[1] == 1, syncs


@pytest.mark.parametrize("kind", ["deformable-detr-two-stage", "dino"])
def test_fast_detr_losses_wait_for_the_gpu_once(kind):
    """The calls of a head's loss and backward that would block the host on a GPU (recorded on the CPU): stock's
    per-layer matching and targets make dozens; the fast paths leave the one copy of every cost matrix."""
    from host_transfers import HostTransferSpy
    stock, fast = _stock_and_fast_losses_under(HostTransferSpy, kind)
    assert len(stock) >= 3 * 2 * 3, stock  # per layer and image at least the cost copy and two nonzero() calls
    assert fast == [("cpu", "costs_to_host")]


def test_batched_losses_leave_heads_with_other_losses_alone():
    from mmdet.registry import MODELS
    head = _detr_head("dino")
    head.loss_iou = MODELS.build(dict(type="IoULoss", loss_weight=2.0))
    holder = nn.Module()
    holder.bbox_head = head
    assert apply_fast_paths(holder, batched_losses=True)["batched_losses"] == 0


# ---- Mask2Former's matching in one pass ------------------------------------------------------------------------------

def _mask2former_head():
    from mmengine.config import Config
    from mmdet.registry import MODELS
    from mmdet.utils import register_all_modules
    register_all_modules(init_default_scope=True)
    cfg = Config.fromfile("configs/mask2former/mask2former_r50_8xb2-lsj-50e_coco_deform-plugin.py")
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

    syncs = [_cuda_syncs_of(lambda: loss_and_backward(head)) for head in (stock_head, fast_head)]
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


_DETR_DDP_SWITCHES = {"sync-free-losses": dict(sync_free_losses=True),
                      "batched-losses": dict(sync_free_losses=True, batched_losses=True)}


def _detr_ddp_worker(rank, out_dir, kind, switches):
    from host_transfers import HostTransferSpy
    stock_head = _detr_head(kind)
    fast_head = copy.deepcopy(stock_head)
    holder = nn.Module()
    holder.bbox_head = fast_head
    apply_fast_paths(holder, **_DETR_DDP_SWITCHES[switches])
    # Each rank its own gts: the normalisers are the means of the ranks' counts.
    inputs = _loss_inputs(kind, ((3, 5), (0, 4))[rank], seed=rank)
    stock = _losses_and_gradients(stock_head, inputs)
    with HostTransferSpy() as spy:
        fast = _losses_and_gradients(fast_head, inputs)
    torch.save(dict(stock=stock, fast=fast, transfers=spy.calls), out_dir / f"rank{rank}.pt")


@pytest.mark.parametrize("switches", list(_DETR_DDP_SWITCHES))
@pytest.mark.parametrize("kind", ["deformable-detr-two-stage", "dino"])
def test_detr_fast_losses_average_the_normalisers_over_ranks_as_stock_without_blocking(kind, switches, tmp_path):
    run_gloo_ranks(_detr_ddp_worker, tmp_path, kind, switches)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        (stock, stock_grads), (fast, fast_grads) = result["stock"], result["fast"]
        assert list(fast) == list(stock)
        for name in stock:
            assert fast[name].shape == stock[name].shape, (rank, name)
        if switches == "sync-free-losses":
            # Per layer, stock's arithmetic on the same normalisers: bitwise.
            for name in stock:
                assert torch.equal(fast[name], stock[name]), (rank, name)
            for name in stock_grads:
                assert torch.equal(fast_grads[name], stock_grads[name]), (rank, name)
            # The stock per-layer targets still block; the normalisers no longer do (new_tensor would).
            assert not [call for call in result["transfers"] if call[1] == "detr_loss_by_feat_single_sync_free"]
        else:
            # Every layer at once: sums over a (layers, ...) view, each loss weight applied before the division
            # (stock: after), a float32 rounding apart where the mean count (6 here) is not a power of two.
            for name in stock:
                torch.testing.assert_close(fast[name], stock[name], rtol=1e-5, atol=1e-7)
            for name in stock_grads:
                torch.testing.assert_close(fast_grads[name], stock_grads[name], rtol=1e-5, atol=1e-8)
            assert result["transfers"] == [("cpu", "costs_to_host")], (rank, result["transfers"])


def _bgr_preprocessor():
    from mmdet.models.data_preprocessors import DetDataPreprocessor
    return DetDataPreprocessor(mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375], bgr_to_rgb=True,
                               pad_size_divisor=32)


def _image_batch(stacked: bool):
    from mmdet.structures import DetDataSample
    generator = torch.Generator().manual_seed(0)
    sizes = [(3, 40, 52), (3, 40, 52)] if stacked else [(3, 37, 50), (3, 45, 41)]
    images = [torch.randint(0, 256, size, generator=generator, dtype=torch.uint8) for size in sizes]
    samples = [DetDataSample(metainfo=dict(img_shape=size[1:], ori_shape=size[1:])) for size in sizes]
    return dict(inputs=torch.stack(images) if stacked else images, data_samples=samples)


@pytest.mark.parametrize("stacked", [False, True], ids=["image-list", "stacked-batch"])
def test_sync_free_forward_flips_the_preprocessors_channels_as_stock_without_a_host_copy(stacked):
    """mmengine's BGR-to-RGB conversion indexes each image with a Python list (a blocking copy of the index on a
    GPU); the fast path flips on the device, and the preprocessed batch is bitwise stock's."""
    from host_transfers import HostTransferSpy

    from deform_plugin.integration.mmdet_fast_paths.sync_free_forward import flip_channels_without_sync
    stock, fast = _bgr_preprocessor(), _bgr_preprocessor()
    assert flip_channels_without_sync(fast) and not flip_channels_without_sync(fast)  # once
    assert not flip_channels_without_sync(_bgr_preprocessor().__class__(bgr_to_rgb=False))
    recorded, outputs = [], []
    for preprocessor in (stock, fast):
        for training in (True, False):
            with HostTransferSpy() as spy:
                outputs.append(preprocessor(_image_batch(stacked), training))
            recorded.append(spy.calls)
    assert all(("list_index", "forward") in calls for calls in recorded[:2]), recorded  # the spy sees stock's
    # The rest (mmengine's stack_batch reading the images' sizes from a tensor it builds on the host) stays.
    assert recorded[2:] == [[call for call in calls if call[0] != "list_index"] for calls in recorded[:2]], recorded
    for ours, theirs in zip(outputs[2:], outputs[:2]):
        assert torch.equal(ours["inputs"], theirs["inputs"])
        assert ([s.metainfo for s in ours["data_samples"]] == [s.metainfo for s in theirs["data_samples"]])
    assert fast._channel_conversion  # left as it was
