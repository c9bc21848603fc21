"""``OptimizerStateByNameHook``: a checkpoint's optimizer state resumes under any param-group layout
(``custom_hooks``; ``tools/train.py`` adds it to every run)."""
from __future__ import annotations

import copy
import logging
from typing import Iterator, List, Optional, Tuple

import torch.nn as nn
from mmengine.hooks import Hook
from mmengine.logging import print_log
from mmengine.model import is_model_wrapper
from mmengine.optim import DefaultOptimWrapperConstructor, OptimWrapper
from mmengine.registry import HOOKS

from .optim_constructor import merge_param_groups
from .optimizer_state_layout import (
    OptimizerLayoutMismatch,
    layout_problem,
    parameter_names_by_group,
    record_parameter_names,
    recorded_parameter_names,
    translate_optimizer_state,
    translate_scheduler_state,
)


@HOOKS.register_module()
class OptimizerStateByNameHook(Hook):
    """Save the optimizer state with the name of every parameter; on resume, load it by name into whatever param
    groups the current config builds.

    So a checkpoint of a plain config (mmengine's one group per tensor) resumes under a ``configs/fast/`` config
    (:class:`~deform_plugin.engine.MergedParamGroupsOptimWrapperConstructor`'s merged groups), and the other way
    round, with every parameter's Adam moments and step, its group's hyper-parameters as the LR schedulers left
    them, and the schedulers' own per-group state (:mod:`deform_plugin.engine.optimizer_state_layout` says why
    that is exact). mmengine restores the iteration count and the message hub as for any resume.

    A checkpoint saved without names (a stock mmdet/mmengine run, or one without this hook) is matched against the
    layouts that could have saved it, for the current model and config: the current optimizer's own, mmengine's
    ``DefaultOptimWrapperConstructor`` with the config's ``paramwise_cfg``, and its merged form. The first whose
    group sizes, state shapes and (for the last two) hyper-parameters fit is used; if none fits, the resume stops
    with an error saying, for each, what does not.

    Add to a config (``tools/train.py`` does this for every config)::

        custom_hooks = [dict(type='OptimizerStateByNameHook')]

    Saved names go into torch's own optional ``param_names`` key of each saved param group, so the checkpoint still
    resumes positionally under the constructor that saved it without this hook (stock mmdet included).
    ``load_from`` (fine-tuning, testing) is left alone: it loads no optimizer state. Runs with several optimizers
    (``OptimWrapperDict``) are left to mmengine's positional load.
    """

    def before_save_checkpoint(self, runner, checkpoint: dict) -> None:
        saved = checkpoint.get("optimizer")
        if not _single_optimizer_state(saved) or not isinstance(runner.optim_wrapper, OptimWrapper):
            return
        try:
            names = _current_names(runner)
        except OptimizerLayoutMismatch as error:
            print_log(f"OptimizerStateByNameHook: the optimizer state is saved without parameter names: {error}",
                      logger="current", level=logging.WARNING)
            return
        record_parameter_names(saved, names)

    def after_load_checkpoint(self, runner, checkpoint: dict) -> None:
        # Runner.resume loads the checkpoint, calls this, then loads checkpoint['optimizer'] and
        # checkpoint['param_schedulers'] into the built optimizer and schedulers: rewriting them here is enough.
        # mmengine's load_from also comes through here, and must stay untouched (another model is allowed there);
        # the Runner keeps which of the two it does in a private attribute, stable across mmengine 0.x.
        if not getattr(runner, "_resume", False):
            return
        saved = checkpoint.get("optimizer")
        if not _single_optimizer_state(saved):
            return
        if isinstance(runner.optim_wrapper, dict):
            # Runner.resume would build it next; built here, it is the same object it then loads into.
            runner.optim_wrapper = runner.build_optim_wrapper(runner.optim_wrapper)
        if not isinstance(runner.optim_wrapper, OptimWrapper):
            return
        current_groups = runner.optim_wrapper.optimizer.param_groups
        current_names = _current_names(runner)
        saved_names = recorded_parameter_names(saved)
        if saved_names is None:
            saved_names = _reconstructed_names(runner, saved, current_groups, current_names)
        base_settings = getattr(runner.optim_wrapper, "base_param_settings", None)
        checkpoint["optimizer"] = translate_optimizer_state(saved, saved_names, current_groups, current_names,
                                                            base_settings)

        def for_current_groups(scheduler_state: dict) -> dict:
            return translate_scheduler_state(scheduler_state, saved_names, current_names, base_settings is not None)

        schedulers = checkpoint.get("param_schedulers")
        if isinstance(schedulers, dict):
            checkpoint["param_schedulers"] = {key: [for_current_groups(state) for state in states]
                                              for key, states in schedulers.items()}
        elif isinstance(schedulers, list):
            checkpoint["param_schedulers"] = [for_current_groups(state) for state in schedulers]
        print_log(f"OptimizerStateByNameHook: optimizer state of {sum(map(len, saved_names))} parameters in "
                  f"{len(saved_names)} saved param groups loaded by name into {len(current_names)} groups",
                  logger="current")


def _single_optimizer_state(saved) -> bool:
    """Whether ``saved`` is one optimizer's state dict (an ``OptimWrapperDict`` saves one per optimizer)."""
    return isinstance(saved, dict) and "param_groups" in saved and "state" in saved


def _model(runner) -> nn.Module:
    return runner.model.module if is_model_wrapper(runner.model) else runner.model


def _current_names(runner) -> List[List[str]]:
    names_by_tensor = {id(parameter): name for name, parameter in _model(runner).named_parameters()}
    return parameter_names_by_group(runner.optim_wrapper.optimizer.param_groups, names_by_tensor)


def _reconstructed_names(runner, saved: dict, current_groups, current_names) -> List[List[str]]:
    """The parameter names of a state saved without them: those of the first layout that fits it."""
    problems = []
    seen = []
    for description, names, compare_hyper_parameters in _candidate_layouts(runner, current_names):
        if names in seen:
            continue
        seen.append(names)
        problem = layout_problem(saved, names, current_groups, current_names, compare_hyper_parameters)
        if problem is None:
            print_log(f"OptimizerStateByNameHook: the checkpoint records no parameter names; its optimizer state "
                      f"has the layout of {description}", logger="current")
            return names
        problems.append(f"{description}: {problem}")
    raise OptimizerLayoutMismatch(
        "the checkpoint's optimizer state records no parameter names (it was saved without "
        "OptimizerStateByNameHook) and fits no layout that the current model and config could have saved it "
        "with:\n  " + "\n  ".join(problems))


def _candidate_layouts(runner, current_names) -> Iterator[Tuple[str, List[List[str]], bool]]:
    """(description, names per group, whether hyper-parameters must match) for each layout that may have saved a
    checkpoint of the current model, most likely first."""
    yield "the current optimizer's param groups", current_names, False
    per_tensor = _default_constructor_groups(runner)
    if per_tensor is None:
        return
    model = _model(runner)
    names_by_tensor = {id(parameter): name for name, parameter in model.named_parameters()}
    try:
        yield ("mmengine's DefaultOptimWrapperConstructor with the config's paramwise_cfg",
               parameter_names_by_group(per_tensor, names_by_tensor), True)
        yield ("MergedParamGroupsOptimWrapperConstructor with the config's paramwise_cfg",
               parameter_names_by_group(merge_param_groups(per_tensor), names_by_tensor), True)
    except OptimizerLayoutMismatch:
        return


def _default_constructor_groups(runner) -> Optional[List[dict]]:
    """The param groups that mmengine's ``DefaultOptimWrapperConstructor`` builds for the current model from the
    config's ``optim_wrapper`` (None where the config has none to read)."""
    cfg = getattr(runner, "cfg", None)
    optim_wrapper_cfg = cfg.get("optim_wrapper") if cfg is not None else None
    if not optim_wrapper_cfg or "optimizer" not in optim_wrapper_cfg:
        return None
    optim_wrapper_cfg = copy.deepcopy(dict(optim_wrapper_cfg))
    optim_wrapper_cfg.pop("constructor", None)
    paramwise_cfg = optim_wrapper_cfg.pop("paramwise_cfg", None)
    model = _model(runner)
    if not paramwise_cfg:
        return [dict(params=list(model.parameters()))]
    groups: List[dict] = []
    DefaultOptimWrapperConstructor(optim_wrapper_cfg, paramwise_cfg).add_params(groups, model)
    return groups
