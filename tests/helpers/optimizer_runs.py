"""Small optimizer runs in both param-group layouts, for the tests of moving optimizer state between them."""
import copy

import torch
from mmengine.optim import CosineAnnealingLR, DefaultOptimWrapperConstructor, LinearLR
from tiny_models import SmallDetector
from torch import nn

from deform_plugin.engine import MergedParamGroupsOptimWrapperConstructor
from deform_plugin.engine.optimizer_state_layout import (
    IMPLEMENTATION_KEYS,
    parameter_names_by_group,
    record_parameter_names,
    translate_optimizer_state,
    translate_scheduler_state,
)

PARAMWISE_CFG = dict(
    custom_keys={"backbone": dict(lr_mult=0.1), "sampling_offsets": dict(lr_mult=0.1),
                 "query_embed": dict(lr_mult=1.0, decay_mult=0.0)},
    norm_decay_mult=0.0, bias_decay_mult=0.5, bias_lr_mult=2.0)
# No gradient clipping: its norm sums the tensors in group order, the one thing that differs between the layouts
# (tests/engine/test_optim_constructor.py covers it); without it the two layouts' updates are bitwise equal.
OPTIM_WRAPPER_CFG = dict(type="OptimWrapper", optimizer=dict(type="AdamW", lr=2e-4, weight_decay=0.05))
LAYOUTS = {"per-tensor": DefaultOptimWrapperConstructor, "merged": MergedParamGroupsOptimWrapperConstructor}


class Run:
    """A model, its optimizer wrapper in one layout and two chained mmengine LR schedulers, stepped on a CPU."""

    def __init__(self, layout, model, paramwise_cfg=PARAMWISE_CFG):
        self.model = model
        self.wrapper = LAYOUTS[layout](copy.deepcopy(OPTIM_WRAPPER_CFG), copy.deepcopy(paramwise_cfg))(model)
        # Both use a per-group list: LinearLR its _last_value, CosineAnnealingLR its base_values too.
        self.schedulers = [LinearLR(self.wrapper, start_factor=0.1, by_epoch=False, begin=0, end=4),
                           CosineAnnealingLR(self.wrapper, T_max=12, by_epoch=False, begin=0, end=12)]

    @property
    def optimizer(self):
        return self.wrapper.optimizer

    def names(self):
        return parameter_names_by_group(self.optimizer.param_groups,
                                        {id(p): n for n, p in self.model.named_parameters()})

    def step(self, generator, steps):
        for _ in range(steps):
            x = torch.randn(2, 3, 12, 12, generator=generator, dtype=torch.float64)
            self.wrapper.update_params(self.model(x))
            for scheduler in self.schedulers:
                scheduler.step()

    def saved(self, with_names=True):
        """The optimizer's and schedulers' states as a checkpoint holds them: copies (a state dict refers to the
        optimizer's own tensors, which its next steps change in place)."""
        optimizer_state = copy.deepcopy(self.wrapper.state_dict())
        if with_names:
            record_parameter_names(optimizer_state, self.names())
        return optimizer_state, copy.deepcopy([scheduler.state_dict() for scheduler in self.schedulers])

    def resume(self, optimizer_state, scheduler_states, saved_names):
        base_settings = self.wrapper.base_param_settings
        translated = translate_optimizer_state(optimizer_state, saved_names, self.optimizer.param_groups,
                                               self.names(), base_settings)
        self.wrapper.load_state_dict(translated)
        for scheduler, state in zip(self.schedulers, scheduler_states):
            scheduler.load_state_dict(translate_scheduler_state(state, saved_names, self.names(),
                                                                base_settings is not None))

    def state_by_name(self):
        names = {id(p): n for n, p in self.model.named_parameters()}
        return {names[id(p)]: state for p, state in self.optimizer.state.items()}

    def hyper_parameters_by_name(self):
        names = {id(p): n for n, p in self.model.named_parameters()}
        return {names[id(p)]: {k: v for k, v in group.items() if k not in IMPLEMENTATION_KEYS | {"params"}}
                for group in self.optimizer.param_groups for p in group["params"]}


def small_detector(head_outputs=4):
    torch.manual_seed(0)
    model = SmallDetector()
    model.head[2] = nn.Linear(16, head_outputs)
    return model.to(torch.float64)


def trained(layout, steps=3):
    run = Run(layout, small_detector())
    run.step(torch.Generator().manual_seed(1), steps)
    return run


def assert_same_state(state, expected):
    assert state.keys() == expected.keys()
    for name, parameter_state in expected.items():
        assert state[name].keys() == parameter_state.keys(), name
        for key, value in parameter_state.items():
            assert state[name][key].dtype == value.dtype, (name, key)
            torch.testing.assert_close(state[name][key], value, rtol=0, atol=0, msg=f"{name} {key}")
