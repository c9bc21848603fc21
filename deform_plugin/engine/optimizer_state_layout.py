"""Optimizer and LR-scheduler state dicts moved between param-group layouts by parameter name.

Why: torch's ``Optimizer.state_dict`` numbers every tensor by its position across the param groups, and
``load_state_dict`` pairs saved and current tensors by that position. mmengine's ``DefaultOptimWrapperConstructor``
makes one group per tensor (with a ``paramwise_cfg``), :class:`MergedParamGroupsOptimWrapperConstructor` a few
merged ones: the same tensors at other positions, so neither state loads into the other. mmengine's LR schedulers
keep lists with one entry per group (``base_values``, ``_last_value``) that have the same problem, and mmengine's
``OptimWrapper`` adds one more entry for the optimizer's defaults when it has several groups (its
``base_param_settings``, whose ``lr`` mmengine logs as ``base_lr``).

How: a state saved with the parameter name of every position (torch's own optional ``param_names`` key of each
saved group, which :func:`record_parameter_names` fills) is re-indexed for the current optimizer's groups by name.
A state saved without names (stock mmengine) gets those of a layout that could have saved it: the caller offers
candidates, and the first one in which :func:`layout_problem` finds nothing wrong (group sizes, state shapes,
hyper-parameters) is taken.

Why the result is exact: the state tensors (Adam's moments and step, SGD's momentum, ...) are handed over unchanged;
each parameter keeps the hyper-parameters of its saved group (``lr``, ``initial_lr`` and whatever else the LR
schedulers left there), as torch's positional load would give it. Only the keys that choose an implementation
(``foreach``, ``fused``, ...) stay the current optimizer's, and ``step`` is placed where that implementation keeps it.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Any, Dict, List, Optional, Sequence

import torch

# Keys of a param group that pick how the update runs, not what it computes: they stay the current optimizer's, so
# that a stock state (foreach=None, fused=None) does not switch off the merged layout's fused kernels.
IMPLEMENTATION_KEYS = frozenset({"foreach", "fused", "capturable", "differentiable"})
# Entries of mmengine's ParamScheduler state dicts that hold one value per param group.
PER_GROUP_SCHEDULER_KEYS = ("base_values", "_last_value", "min_values")
_NOT_HYPER_PARAMETERS = IMPLEMENTATION_KEYS | {"params", "param_names"}
_NAMES_SHOWN = 5


class OptimizerLayoutMismatch(ValueError):
    """A saved optimizer state that does not fit the current model's parameters."""


def parameter_names_by_group(param_groups: Sequence[dict], names_by_tensor: Dict[int, str]) -> List[List[str]]:
    """The name of every tensor of ``param_groups``, group by group (``names_by_tensor`` maps ``id(tensor)``)."""
    names = []
    for index, group in enumerate(param_groups):
        group_names = []
        for tensor in group["params"]:
            if id(tensor) not in names_by_tensor:
                raise OptimizerLayoutMismatch(
                    f"param group {index} holds a tensor of shape {tuple(tensor.shape)} that is not a parameter of "
                    "the model, so its optimizer state cannot be matched by name")
            group_names.append(names_by_tensor[id(tensor)])
        names.append(group_names)
    return names


def record_parameter_names(saved: dict, names: List[List[str]]) -> None:
    """Write ``names`` (one list per group, from :func:`parameter_names_by_group`) into the saved groups."""
    groups = saved["param_groups"]
    sizes = [len(group["params"]) for group in groups]
    if sizes != [len(group_names) for group_names in names]:
        raise OptimizerLayoutMismatch(f"the state has groups of sizes {sizes}, the names groups of sizes "
                                      f"{[len(group_names) for group_names in names]}")
    for group, group_names in zip(groups, names):
        group["param_names"] = list(group_names)


def recorded_parameter_names(saved: dict) -> Optional[List[List[str]]]:
    """The parameter names recorded in every saved group, or None where a group has none (a stock save)."""
    groups = saved["param_groups"]
    if not groups or not all("param_names" in group for group in groups):
        return None
    return [list(group["param_names"]) for group in groups]


def layout_problem(saved: dict, names: List[List[str]], current_groups: Sequence[dict],
                   current_names: List[List[str]], compare_hyper_parameters: bool = True) -> Optional[str]:
    """Why ``saved`` cannot have been saved by an optimizer whose groups held the parameters ``names``, or None.

    Checks the number and sizes of the groups and the shape of every per-element state tensor against the current
    parameters; with ``compare_hyper_parameters``, also that each saved group's hyper-parameters are those that the
    current optimizer gives each of its parameters (as set before any LR schedule: ``initial_lr`` where a scheduler
    recorded it, else ``lr``; likewise for every other key).

    Args:
        saved: an optimizer state dict (``state``, ``param_groups``) without recorded names.
        names: a candidate layout, one list of parameter names per group.
        current_groups / current_names: the current optimizer's param groups and their names.
        compare_hyper_parameters: off for the current optimizer's own layout, which torch's positional load would
            accept with any hyper-parameters.
    """
    groups = saved["param_groups"]
    if len(groups) != len(names):
        return f"{len(names)} param groups, the checkpoint has {len(groups)}"
    parameters = _tensors_by_name(current_groups, current_names)
    group_of = _group_index_by_name(current_names)
    for index, (group, group_names) in enumerate(zip(groups, names)):
        if len(group["params"]) != len(group_names):
            return (f"param group {index} holds {len(group_names)} parameters ({_quote(group_names)}), the "
                    f"checkpoint's {len(group['params'])}")
        for position, name in zip(group["params"], group_names):
            if name not in parameters:
                return f"param group {index} holds {name!r}, which the current optimizer does not"
            problem = _state_shape_problem(saved["state"].get(position, {}), name, parameters[name])
            if problem is not None:
                return problem
            if compare_hyper_parameters:
                difference = _hyper_parameter_difference(group, current_groups[group_of[name]])
                if difference is not None:
                    key, saved_value, current_value = difference
                    return (f"param group {index} has {key}={saved_value!r}, where the current config gives "
                            f"{name!r} {key}={current_value!r}")
    return None


def translate_optimizer_state(saved: dict, saved_names: List[List[str]], current_groups: Sequence[dict],
                              current_names: List[List[str]], current_base_settings: Optional[dict] = None) -> dict:
    """``saved`` re-indexed for the current param groups by parameter name; load it with ``load_state_dict``.

    Args:
        saved: an optimizer (wrapper) state dict; keys besides ``state``, ``param_groups`` and
            ``base_param_settings`` (an AMP wrapper's ``loss_scaler``) are kept.
        saved_names: the parameter name of every saved position, one list per saved group.
        current_groups / current_names: the current optimizer's param groups and their names.
        current_base_settings: the current ``OptimWrapper``'s ``base_param_settings`` (None where it has none, as
            with a single group): the saved one is kept where both have one, dropped where the current wrapper
            has none, and made from the single saved group where only the current one has it.

    Raises:
        OptimizerLayoutMismatch: naming the parameters that one side has and the other lacks, a state tensor whose
            shape is not its parameter's, or two parameters that share a current group but were saved with
            different hyper-parameters.
    """
    _require_same_parameters(saved_names, current_names)
    parameters = _tensors_by_name(current_groups, current_names)
    saved_groups = saved["param_groups"]
    saved_group_of = _group_index_by_name(saved_names)
    saved_position_of = {name: position for group, group_names in zip(saved_groups, saved_names)
                         for position, name in zip(group["params"], group_names)}

    state: Dict[int, Any] = {}
    param_groups = []
    next_position = 0
    for index, (current, group_names) in enumerate(zip(current_groups, current_names)):
        if not group_names:
            raise OptimizerLayoutMismatch(f"current param group {index} holds no parameters: its hyper-parameters "
                                          "cannot be taken from any saved group")
        source = saved_groups[saved_group_of[group_names[0]]]
        for name in group_names[1:]:
            difference = _hyper_parameter_difference(source, saved_groups[saved_group_of[name]], as_saved=True)
            if difference is not None:
                key, first_value, other_value = difference
                raise OptimizerLayoutMismatch(
                    f"current param group {index} holds {group_names[0]!r} and {name!r}, which the checkpoint "
                    f"saved with different {key} ({first_value!r} and {other_value!r}): one group cannot carry "
                    "both; the config's paramwise_cfg differs from the run that saved it")
        positions = []
        for name in group_names:
            saved_state = saved["state"].get(saved_position_of[name])
            if saved_state is not None:
                problem = _state_shape_problem(saved_state, name, parameters[name])
                if problem is not None:
                    raise OptimizerLayoutMismatch(problem)
                state[next_position] = _placed_for(saved_state, current)
            positions.append(next_position)
            next_position += 1
        group = {key: value for key, value in current.items() if key != "params"}
        group.update({key: value for key, value in source.items() if key not in _NOT_HYPER_PARAMETERS})
        group["params"] = positions
        param_groups.append(group)

    translated = {key: value for key, value in saved.items()
                  if key not in ("state", "param_groups", "base_param_settings")}
    translated.update(state=state, param_groups=param_groups)
    base_settings = _base_settings(saved, current_base_settings)
    if base_settings is not None:
        translated["base_param_settings"] = base_settings
    return translated


def _base_settings(saved: dict, current_base_settings: Optional[dict]) -> Optional[dict]:
    """The ``base_param_settings`` for the current wrapper (a pseudo-group of the optimizer's defaults that the LR
    schedulers step along with the groups), or None to leave the wrapper's own."""
    if current_base_settings is None:
        return None
    if saved.get("base_param_settings") is not None:
        return saved["base_param_settings"]
    if len(saved["param_groups"]) == 1:
        # A single saved group holds the defaults, as the schedulers left them.
        settings = dict(current_base_settings)
        settings.update({key: value for key, value in saved["param_groups"][0].items()
                         if key not in _NOT_HYPER_PARAMETERS})
        return settings
    return None


def translate_scheduler_state(scheduler_state: dict, saved_names: List[List[str]], current_names: List[List[str]],
                              current_has_base_settings: bool) -> dict:
    """An mmengine ParamScheduler state dict with its per-group lists rearranged for the current groups.

    Each current group takes the value of the saved group of its first parameter (all of a group's parameters were
    saved with the same hyper-parameters, which :func:`translate_optimizer_state` checks). A list one longer than
    the saved groups ends with the entry of the saving wrapper's ``base_param_settings``; the result ends with one
    where ``current_has_base_settings`` (the current ``OptimWrapper`` has several groups), taken from the single
    saved group where the saving wrapper had none.
    """
    saved_group_of = _group_index_by_name(saved_names)
    translated = dict(scheduler_state)
    for key in PER_GROUP_SCHEDULER_KEYS:
        values = scheduler_state.get(key)
        if not isinstance(values, (list, tuple)) or len(values) not in (len(saved_names), len(saved_names) + 1):
            continue
        rearranged = [values[saved_group_of[group_names[0]]] for group_names in current_names]
        if current_has_base_settings:
            if len(values) == len(saved_names) + 1:
                rearranged.append(values[-1])
            elif len(saved_names) == 1:
                rearranged.append(values[0])
            else:
                raise OptimizerLayoutMismatch(
                    f"the checkpoint's scheduler state has no {key!r} entry for the optimizer's defaults "
                    f"(base_param_settings), which the current optimizer wrapper has")
        translated[key] = rearranged
    return translated


def _tensors_by_name(groups: Sequence[dict], names: List[List[str]]) -> Dict[str, torch.Tensor]:
    return {name: tensor for group, group_names in zip(groups, names)
            for tensor, name in zip(group["params"], group_names)}


def _group_index_by_name(names: List[List[str]]) -> Dict[str, int]:
    return {name: index for index, group_names in enumerate(names) for name in group_names}


def _quote(names: Sequence[str]) -> str:
    shown = ", ".join(repr(name) for name in list(names)[:_NAMES_SHOWN])
    return shown + (f" and {len(names) - _NAMES_SHOWN} more" if len(names) > _NAMES_SHOWN else "")


def _require_same_parameters(saved_names: List[List[str]], current_names: List[List[str]]) -> None:
    saved_flat = [name for group_names in saved_names for name in group_names]
    current_flat = [name for group_names in current_names for name in group_names]
    repeated = sorted(name for name, count in Counter(saved_flat).items() if count > 1)
    if repeated:
        raise OptimizerLayoutMismatch(f"the checkpoint's optimizer state names {_quote(repeated)} more than once")
    saved_set, current_set = set(saved_flat), set(current_flat)
    missing = [name for name in current_flat if name not in saved_set]
    extra = [name for name in saved_flat if name not in current_set]
    problems = []
    if missing:
        problems.append(f"the current optimizer has parameters that the checkpoint's optimizer state lacks: "
                        f"{_quote(missing)}")
    if extra:
        problems.append(f"the checkpoint's optimizer state has parameters that the current optimizer lacks: "
                        f"{_quote(extra)}")
    if problems:
        raise OptimizerLayoutMismatch("; ".join(problems) + " (a different model, or other frozen parameters)")


def _state_shape_problem(parameter_state: dict, name: str, parameter: torch.Tensor) -> Optional[str]:
    """A state tensor with more than one element holds one value per element of its parameter (Adam's moments,
    SGD's momentum): its shape must be the parameter's."""
    for key, value in parameter_state.items():
        if isinstance(value, torch.Tensor) and value.numel() > 1 and value.shape != parameter.shape:
            return (f"the checkpoint's {key!r} for {name!r} has shape {tuple(value.shape)}, the parameter has "
                    f"shape {tuple(parameter.shape)}")
    return None


def _placed_for(parameter_state: dict, group: dict) -> dict:
    """The state as the current group's implementation keeps it: torch's load moves ``step`` to the parameter's
    device for fused and capturable groups, and leaves it where it was otherwise; a CUDA ``step`` saved by a fused
    group would make every non-fused update read it back to the host, so it returns to the host."""
    placed = dict(parameter_state)
    step = placed.get("step")
    if isinstance(step, torch.Tensor) and not (group.get("fused") or group.get("capturable")):
        placed["step"] = step.cpu()
    return placed


def _base_value(group: dict, key: str) -> Any:
    """A hyper-parameter as set before any schedule: mmengine's schedulers keep that in ``initial_<key>``."""
    return group.get(f"initial_{key}", group[key])


def _hyper_parameter_difference(group: dict, other: dict, as_saved: bool = False):
    """The first hyper-parameter (key, value in ``group``, value in ``other``) on which the groups differ, or None.

    Compared: the keys both groups have, implementation keys aside. ``as_saved`` compares the values as they are
    (two saved groups, both as the schedules left them); otherwise as set before any schedule.
    """
    for key in sorted(set(group) & set(other) - _NOT_HYPER_PARAMETERS):
        if key.startswith("initial_") and not as_saved:
            continue  # compared through the key it initialises
        value, other_value = (group[key], other[key]) if as_saved else (_base_value(group, key),
                                                                       _base_value(other, key))
        if not _same(value, other_value):
            return key, value, other_value
    return None


def _same(value: Any, other: Any) -> bool:
    if isinstance(value, (list, tuple)) and isinstance(other, (list, tuple)):
        return len(value) == len(other) and all(_same(a, b) for a, b in zip(value, other))
    if isinstance(value, torch.Tensor) or isinstance(other, torch.Tensor):
        return (torch.is_tensor(value) and torch.is_tensor(other)
                and torch.equal(value.detach().cpu(), other.detach().cpu()))
    if isinstance(value, float) and isinstance(other, float):
        # Both sides compute base_lr * lr_mult the same way; the tolerance only absorbs a reordered product.
        return math.isclose(value, other, rel_tol=1e-12, abs_tol=0.0)
    return value == other
