"""OptimizerStateByNameHook names what it saves, and on resume fits named and stock states to the current groups.

The hook's contract with mmengine's Runner, without building one: ``before_save_checkpoint`` gets the checkpoint
dict that the Runner is about to write, ``after_load_checkpoint`` the one it has just read and then loads into the
optimizer wrapper and the schedulers. tests/tools/test_train_resume.py runs the same through tools/train.py.
"""
import copy
from types import SimpleNamespace

import pytest
from mmengine.config import Config
from optimizer_runs import OPTIM_WRAPPER_CFG, PARAMWISE_CFG, Run, assert_same_state, small_detector, trained

import deform_plugin  # noqa: F401  (registers the hook)
from deform_plugin.engine import OptimizerLayoutMismatch, OptimizerStateByNameHook


def _runner(run, resume=True):
    """What the hook reads of a Runner: the model, the built optimizer wrapper, the config, whether it resumes."""
    cfg = Config(dict(optim_wrapper=dict(copy.deepcopy(OPTIM_WRAPPER_CFG), paramwise_cfg=copy.deepcopy(PARAMWISE_CFG))))
    return SimpleNamespace(model=run.model, optim_wrapper=run.wrapper, cfg=cfg, _resume=resume)


def _checkpoint(run, hook=None):
    """The optimizer and scheduler part of a checkpoint, as the Runner writes it (through ``hook`` if given)."""
    optimizer_state, scheduler_states = run.saved(with_names=False)
    checkpoint = dict(optimizer=optimizer_state, param_schedulers=scheduler_states)
    if hook is not None:
        hook.before_save_checkpoint(_runner(run), checkpoint)
    return checkpoint


def _resume(run, checkpoint):
    """What Runner.resume does with the checkpoint after its after_load_checkpoint hooks."""
    run.wrapper.load_state_dict(checkpoint["optimizer"])
    for scheduler, state in zip(run.schedulers, checkpoint["param_schedulers"]):
        scheduler.load_state_dict(state)


def test_saved_groups_name_their_parameters():
    run = trained("merged")
    checkpoint = _checkpoint(run, OptimizerStateByNameHook())
    saved_names = [group["param_names"] for group in checkpoint["optimizer"]["param_groups"]]
    assert saved_names == run.names()
    # Every trainable parameter (both constructors leave frozen ones out of their groups).
    assert sorted(sum(saved_names, [])) == sorted(n for n, p in run.model.named_parameters() if p.requires_grad)
    # The live groups are untouched (the Runner saves a copy of them).
    assert all("param_names" not in group for group in run.optimizer.param_groups)


@pytest.mark.parametrize("saved_layout, resumed_layout, named", [
    ("per-tensor", "merged", False),  # a stock mmdet run's checkpoint under a configs/fast/ config
    ("merged", "per-tensor", False),  # a fast run saved without the hook, under a plain config
    ("merged", "per-tensor", True),
    ("per-tensor", "merged", True),
])
def test_resume_loads_each_parameters_state_under_the_current_layout(saved_layout, resumed_layout, named):
    saved_run = trained(saved_layout)
    checkpoint = _checkpoint(saved_run, OptimizerStateByNameHook() if named else None)
    resumed = Run(resumed_layout, copy.deepcopy(saved_run.model))
    OptimizerStateByNameHook().after_load_checkpoint(_runner(resumed), checkpoint)
    _resume(resumed, checkpoint)
    assert_same_state(resumed.state_by_name(), saved_run.state_by_name())
    assert resumed.hyper_parameters_by_name() == saved_run.hyper_parameters_by_name()
    assert resumed.wrapper.get_lr()["base_lr"] == saved_run.wrapper.get_lr()["base_lr"]


def test_load_from_leaves_the_checkpoint_alone():
    """load_from (fine-tuning, tools/test.py) loads no optimizer state, and may load another model's weights."""
    checkpoint = _checkpoint(trained("per-tensor"))
    before = copy.deepcopy(checkpoint)
    OptimizerStateByNameHook().after_load_checkpoint(_runner(Run("merged", small_detector(head_outputs=6)),
                                                             resume=False), checkpoint)
    assert checkpoint.keys() == before.keys()
    assert checkpoint["optimizer"]["param_groups"] == before["optimizer"]["param_groups"]


def test_a_stock_checkpoint_of_another_model_is_refused_naming_the_parameter():
    checkpoint = _checkpoint(trained("per-tensor"))
    other_model = Run("merged", small_detector(head_outputs=6))
    with pytest.raises(OptimizerLayoutMismatch) as refused:
        OptimizerStateByNameHook().after_load_checkpoint(_runner(other_model), checkpoint)
    message = str(refused.value)
    assert "records no parameter names" in message
    # Each layout tried, with what does not fit it.
    assert "the current optimizer's param groups: 5 param groups, the checkpoint has 17" in message
    assert ("mmengine's DefaultOptimWrapperConstructor with the config's paramwise_cfg: the checkpoint's 'exp_avg' "
            "for 'head.2.weight' has shape (4, 16), the parameter has shape (6, 16)") in message


def test_a_named_checkpoint_of_another_model_is_refused_naming_the_parameter():
    checkpoint = _checkpoint(trained("merged"), OptimizerStateByNameHook())
    other_model = Run("per-tensor", small_detector(head_outputs=6))
    with pytest.raises(OptimizerLayoutMismatch, match=r"'head\.2\.weight' has shape \(4, 16\), the parameter has "
                       r"shape \(6, 16\)"):
        OptimizerStateByNameHook().after_load_checkpoint(_runner(other_model), checkpoint)
