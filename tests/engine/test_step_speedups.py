"""The step-level speedups are exact and off unless a config selects them.

- the merged-param-group optimizer gives every tensor the stock hyper-parameters and the stock updates;
- the SDPA attention brick gives the stock outputs and gradients (float64);
- the fewer-syncs Hungarian assign gives bitwise the stock assignment;
- nothing changes unless asked.
"""
import copy

import pytest
import torch
from torch import nn

import deform_plugin  # noqa: F401  (mmcv stand-in where mmcv-lite is installed)
from deform_plugin.engine import (FastPathsHook, MergedParamGroupsOptimWrapperConstructor,
                                  fast_path_switches_from_config, merge_param_groups)
from deform_plugin.integration.mmdet_fast_paths import (apply_fast_paths, disable_sdpa_attention, enable_sdpa_attention,
                                                  sdpa_multihead_attention_class)
from mmcv.cnn.bricks.transformer import MultiheadAttention
from mmengine.optim import DefaultOptimWrapperConstructor

# The DETR family's paramwise_cfg, plus the norm/bias decay rules of other mmdet configs, so that every rule of
# mmengine's constructor (custom key, norm decay, bias decay and lr) produces a distinct group.
DETR_LIKE_PARAMWISE_CFG = dict(
    custom_keys={"backbone": dict(lr_mult=0.1), "sampling_offsets": dict(lr_mult=0.1),
                 "query_embed": dict(lr_mult=1.0, decay_mult=0.0)},
    norm_decay_mult=0.0, bias_decay_mult=0.5, bias_lr_mult=2.0)
# A weight decay large enough that a wrong decay_mult changes the update by percents, not by 1e-4.
OPTIM_WRAPPER_CFG = dict(type="OptimWrapper", optimizer=dict(type="AdamW", lr=2e-4, weight_decay=0.05),
                         clip_grad=dict(max_norm=0.1, norm_type=2))


class SmallDetector(nn.Module):
    """Every trainable tensor has a gradient well away from zero.

    Adam divides each gradient by its own running magnitude: a tensor whose true gradient is zero (a conv bias
    right before a BatchNorm) gets full-size updates from rounding noise, which no tolerance can compare. So the
    conv before the BatchNorm has no bias, as in ResNets.
    """

    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.Conv2d(8, 8, 3, padding=1))
        self.backbone[1].weight.requires_grad_(False)  # a frozen tensor, as frozen stages have
        self.neck = nn.Sequential(nn.Conv2d(8, 16, 1), nn.GroupNorm(4, 16))
        self.sampling_offsets = nn.Linear(16, 8)
        self.query_embed = nn.Embedding(5, 16)
        self.head = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4))

    def forward(self, x):
        feat = self.neck(self.backbone(x)).mean((2, 3))
        return (self.head(feat + self.query_embed.weight.sum(0)) ** 2).sum() + self.sampling_offsets(feat).sum()


def _build(constructor_cls, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    model = SmallDetector().to(dtype)
    wrapper = constructor_cls(copy.deepcopy(OPTIM_WRAPPER_CFG), copy.deepcopy(DETR_LIKE_PARAMWISE_CFG))(model)
    return model, wrapper


def _hyper_parameters_by_tensor(optimizer):
    return {id(p): (g["lr"], g["weight_decay"], g["betas"], g["eps"]) for g in optimizer.param_groups
            for p in g["params"]}


def test_merged_groups_give_each_tensor_the_stock_hyper_parameters():
    stock_model, stock = _build(DefaultOptimWrapperConstructor)
    merged_model, merged = _build(MergedParamGroupsOptimWrapperConstructor)
    stock_hp = _hyper_parameters_by_tensor(stock.optimizer)
    merged_hp = _hyper_parameters_by_tensor(merged.optimizer)
    names = dict(stock_model.named_parameters())
    merged_names = dict(merged_model.named_parameters())
    assert {n for n, p in names.items() if id(p) in stock_hp} == {n for n, p in merged_names.items()
                                                                  if id(p) in merged_hp}
    for name, param in names.items():
        if id(param) in stock_hp:
            assert merged_hp[id(merged_names[name])] == stock_hp[id(param)], name
    assert len(stock.optimizer.param_groups) == len(stock_hp)  # stock: one group per tensor
    # Groups merge when every key but 'params' agrees (informational keys such as lr_mult included).
    distinct = {tuple(sorted((k, str(v)) for k, v in g.items() if k != "params"))
                for g in stock.optimizer.param_groups}
    assert len(merged.optimizer.param_groups) == len(distinct) < len(stock.optimizer.param_groups)
    # The first group (whose lr mmengine logs) is still the first parameter's group.
    assert merged.optimizer.param_groups[0]["lr"] == stock.optimizer.param_groups[0]["lr"]


def test_merged_groups_on_cpu_use_foreach_kernels():
    _, merged = _build(MergedParamGroupsOptimWrapperConstructor)
    assert merged.optimizer.defaults["foreach"] is True
    assert not merged.optimizer.defaults.get("fused")


def test_merged_groups_give_the_stock_parameter_updates():
    # float64, so that the only difference between the two runs (the order in which the clip sums the grad norm)
    # stays at 1e-16 and cannot be amplified into a visible difference over a few Adam steps.
    stock_model, stock = _build(DefaultOptimWrapperConstructor, dtype=torch.float64)
    merged_model, merged = _build(MergedParamGroupsOptimWrapperConstructor, dtype=torch.float64)
    initial = {name: p.detach().clone() for name, p in stock_model.named_parameters()}
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(2, 3, 12, 12, generator=generator, dtype=torch.float64)
        for model, wrapper in ((stock_model, stock), (merged_model, merged)):
            wrapper.update_params(model(x))
    for (name, p_stock), (_, p_merged) in zip(stock_model.named_parameters(), merged_model.named_parameters()):
        if not p_stock.requires_grad:
            torch.testing.assert_close(p_merged, initial[name], rtol=0, atol=0, msg=name)
            continue
        # Each tensor's total update, compared relative to its own size: well-conditioned whatever its scale.
        stock_update, merged_update = p_stock - initial[name], p_merged - initial[name]
        assert stock_update.norm() > 0, name
        error = (merged_update - stock_update).norm() / stock_update.norm()
        assert error < 1e-9, f"{name}: relative update error {error:.2e}"


def test_merge_keeps_order_and_distinguishes_every_key():
    a, b, c, d = (nn.Parameter(torch.zeros(1)) for _ in range(4))
    groups = [dict(params=[a], lr=1.0), dict(params=[b]), dict(params=[c], lr=1.0),
              dict(params=[d], lr=1.0, lr_mult=0.1)]
    merged = merge_param_groups(groups)
    assert [[id(p) for p in g["params"]] for g in merged] == [[id(a), id(c)], [id(b)], [id(d)]]


# ---- SDPA attention brick -----------------------------------------------------------------------------------------

def _attention_pair(batch_first, attn_drop=0.0):
    torch.manual_seed(0)
    stock = MultiheadAttention(embed_dims=32, num_heads=4, attn_drop=attn_drop, batch_first=batch_first).double()
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

    from deform_plugin.integration.mmdet_fast_paths import _assign_with_fewer_host_syncs
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


# ---- Off unless asked ---------------------------------------------------------------------------------------------

class _ModelWithBricks(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = MultiheadAttention(embed_dims=16, num_heads=2, batch_first=True)
        self.bbox_head = nn.Module()
        self.bbox_head.assigner = _hungarian_assigner()


class _FakeRunner:
    def __init__(self, model):
        self.model = model


def test_fast_paths_are_off_unless_the_config_asks():
    from mmengine.config import Config
    plain = Config(dict(optim_wrapper=dict(type="OptimWrapper", optimizer=dict(type="AdamW", lr=1e-4))))
    assert fast_path_switches_from_config(plain) == {}
    assert "constructor" not in plain.optim_wrapper
    model = _ModelWithBricks()
    FastPathsHook().before_run(_FakeRunner(model))
    assert type(model.self_attn) is MultiheadAttention
    assert "assign" not in vars(model.bbox_head.assigner)
    assert apply_fast_paths(model) == {}
    assert type(model.self_attn) is MultiheadAttention


def test_fast_paths_hook_switches_only_what_it_is_given():
    model = _ModelWithBricks()
    FastPathsHook(sdpa_attention=True).before_run(_FakeRunner(model))
    assert type(model.self_attn) is sdpa_multihead_attention_class()
    assert "assign" not in vars(model.bbox_head.assigner)
    FastPathsHook(hungarian_host_syncs=True).before_run(_FakeRunner(model))
    assert "assign" in vars(model.bbox_head.assigner)


def test_fast_config_selects_everything():
    import os

    from mmengine.config import Config
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = Config.fromfile(os.path.join(root, "configs/fast/dino-4scale_r50_8xb2-12e_coco_deform-plugin-fast.py"),
                          import_custom_modules=False)
    assert cfg.optim_wrapper.constructor == "MergedParamGroupsOptimWrapperConstructor"
    assert fast_path_switches_from_config(cfg) == dict(sdpa_attention=True, hungarian_host_syncs=True)
    assert cfg.optim_wrapper.paramwise_cfg == dict(custom_keys={"backbone": dict(lr_mult=0.1)})


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
