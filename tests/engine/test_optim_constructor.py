"""The merged-param-group optimizer gives every tensor the stock hyper-parameters and the stock updates."""
import copy

import torch
from mmengine.optim import DefaultOptimWrapperConstructor
from tiny_models import SmallDetector
from torch import nn

import deform_plugin  # noqa: F401  (mmcv stand-in where mmcv-lite is installed)
from deform_plugin.engine import MergedParamGroupsOptimWrapperConstructor, merge_param_groups

DETR_LIKE_PARAMWISE_CFG = dict(
    custom_keys={"backbone": dict(lr_mult=0.1), "sampling_offsets": dict(lr_mult=0.1),
                 "query_embed": dict(lr_mult=1.0, decay_mult=0.0)},
    norm_decay_mult=0.0, bias_decay_mult=0.5, bias_lr_mult=2.0)
# A weight decay large enough that a wrong decay_mult changes the update by percents, not by 1e-4.
OPTIM_WRAPPER_CFG = dict(type="OptimWrapper", optimizer=dict(type="AdamW", lr=2e-4, weight_decay=0.05),
                         clip_grad=dict(max_norm=0.1, norm_type=2))


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
