"""Optimizer and scheduler states move between one-group-per-tensor and merged layouts by name, unchanged."""
import copy

import pytest
import torch
from optimizer_runs import PARAMWISE_CFG, Run, assert_same_state, small_detector, trained

import deform_plugin  # noqa: F401  (mmcv stand-in where mmcv-lite is installed)
from deform_plugin.engine.optimizer_state_layout import (
    OptimizerLayoutMismatch,
    layout_problem,
    recorded_parameter_names,
    translate_optimizer_state,
)


@pytest.mark.parametrize("saved_layout, resumed_layout",
                         [("per-tensor", "merged"), ("merged", "per-tensor"), ("merged", "merged")])
def test_state_and_hyper_parameters_arrive_unchanged_by_name(saved_layout, resumed_layout):
    saved_run = trained(saved_layout)
    optimizer_state, scheduler_states = saved_run.saved()
    resumed = Run(resumed_layout, copy.deepcopy(saved_run.model))
    resumed.resume(optimizer_state, scheduler_states, recorded_parameter_names(optimizer_state))

    assert_same_state(resumed.state_by_name(), saved_run.state_by_name())
    # lr as the schedulers left it after 3 steps, initial_lr, weight_decay, lr_mult ...: each parameter's own.
    assert resumed.hyper_parameters_by_name() == saved_run.hyper_parameters_by_name()
    # The implementation stays the resumed layout's: the merged groups keep their foreach kernels.
    expected_foreach = True if resumed_layout == "merged" else None
    assert {group["foreach"] for group in resumed.optimizer.param_groups} == {expected_foreach}
    # One entry per group, and the last for the wrapper's base_param_settings (the logged base_lr).
    for scheduler in resumed.schedulers:
        assert len(scheduler.base_values) == len(scheduler.get_last_value()) == len(resumed.wrapper.param_groups)
        assert len(resumed.wrapper.param_groups) == len(resumed.optimizer.param_groups) + 1
    assert resumed.wrapper.get_lr()["base_lr"] == saved_run.wrapper.get_lr()["base_lr"]


@pytest.mark.parametrize("saved_layout, resumed_layout", [("per-tensor", "merged"), ("merged", "per-tensor")])
def test_steps_after_resume_equal_those_of_the_run_that_never_switched(saved_layout, resumed_layout):
    never_switched = trained(saved_layout)
    optimizer_state, scheduler_states = never_switched.saved()
    resumed = Run(resumed_layout, copy.deepcopy(never_switched.model))
    resumed.resume(optimizer_state, scheduler_states, recorded_parameter_names(optimizer_state))

    # Past the LinearLR warm-up, into the cosine decay, whose closed form reads the per-group base_values.
    for run in (never_switched, resumed):
        run.step(torch.Generator().manual_seed(2), 4)
    for (name, expected), (_, parameter) in zip(never_switched.model.named_parameters(),
                                                resumed.model.named_parameters()):
        torch.testing.assert_close(parameter, expected, rtol=0, atol=0, msg=name)
    assert_same_state(resumed.state_by_name(), never_switched.state_by_name())
    assert resumed.hyper_parameters_by_name() == never_switched.hyper_parameters_by_name()


def test_translating_there_and_back_gives_the_saved_state_dict():
    per_tensor = trained("per-tensor")
    optimizer_state, _ = per_tensor.saved()
    saved_names = recorded_parameter_names(optimizer_state)
    merged = Run("merged", copy.deepcopy(per_tensor.model))
    there = translate_optimizer_state(optimizer_state, saved_names, merged.optimizer.param_groups, merged.names())
    assert len(there["param_groups"]) < len(optimizer_state["param_groups"])
    back = translate_optimizer_state(there, merged.names(), per_tensor.optimizer.param_groups, per_tensor.names())
    assert back["state"].keys() == optimizer_state["state"].keys()
    for position, parameter_state in optimizer_state["state"].items():
        for key, value in parameter_state.items():
            assert back["state"][position][key] is value  # handed over, not copied or recomputed
    for group, expected in zip(back["param_groups"], optimizer_state["param_groups"]):
        assert group == {k: v for k, v in expected.items() if k != "param_names"}


def test_a_stock_state_without_names_fits_only_the_layout_that_saved_it():
    stock = trained("per-tensor")
    optimizer_state, _ = stock.saved(with_names=False)
    assert recorded_parameter_names(optimizer_state) is None
    merged = Run("merged", copy.deepcopy(stock.model))
    current = merged.optimizer.param_groups, merged.names()
    assert layout_problem(optimizer_state, stock.names(), *current) is None
    assert layout_problem(optimizer_state, merged.names(), *current) == (
        f"{len(merged.names())} param groups, the checkpoint has {len(stock.names())}")
    # Two tensors of the same shape, each in the other's group: caught by the hyper-parameters.
    reordered = stock.names()
    first, second = reordered.index(["head.0.bias"]), reordered.index(["head.1.weight"])
    reordered[first], reordered[second] = reordered[second], reordered[first]
    assert "the current config gives" in layout_problem(optimizer_state, reordered, *current)


def test_a_stock_state_is_refused_where_the_config_gives_other_hyper_parameters():
    stock = trained("per-tensor")
    optimizer_state, _ = stock.saved(with_names=False)
    other_config = dict(PARAMWISE_CFG, bias_decay_mult=0.25)
    current = Run("merged", copy.deepcopy(stock.model), paramwise_cfg=other_config)
    problem = layout_problem(optimizer_state, stock.names(), current.optimizer.param_groups, current.names())
    assert "weight_decay" in problem and ".bias'" in problem, problem


def test_another_model_is_refused_naming_the_parameters():
    optimizer_state, _ = trained("per-tensor").saved()
    saved_names = recorded_parameter_names(optimizer_state)

    reshaped = Run("merged", small_detector(head_outputs=6))
    with pytest.raises(OptimizerLayoutMismatch, match=r"'exp_avg' for 'head\.2\.weight' has shape \(4, 16\), the "
                       r"parameter has shape \(6, 16\)"):
        translate_optimizer_state(optimizer_state, saved_names, reshaped.optimizer.param_groups, reshaped.names())

    smaller = small_detector()
    del smaller.sampling_offsets
    without_offsets = Run("merged", smaller)
    with pytest.raises(OptimizerLayoutMismatch, match=r"the current optimizer lacks: 'sampling_offsets\.weight', "
                       r"'sampling_offsets\.bias'"):
        translate_optimizer_state(optimizer_state, saved_names, without_offsets.optimizer.param_groups,
                                  without_offsets.names())


def test_a_merged_group_cannot_take_parameters_saved_with_different_hyper_parameters():
    optimizer_state, _ = trained("per-tensor").saved()
    # Without its custom key, sampling_offsets joins the default group it was not saved with (lr_mult 0.1 before).
    other_config = dict(PARAMWISE_CFG, custom_keys={k: v for k, v in PARAMWISE_CFG["custom_keys"].items()
                                                    if k != "sampling_offsets"})
    current = Run("merged", small_detector(), paramwise_cfg=other_config)
    with pytest.raises(OptimizerLayoutMismatch, match=r"holds '.+' and 'sampling_offsets\.weight', which the "
                       r"checkpoint saved with different"):
        translate_optimizer_state(optimizer_state, recorded_parameter_names(optimizer_state),
                                  current.optimizer.param_groups, current.names())
