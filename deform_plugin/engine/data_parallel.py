"""Gradients in one flat buffer per dtype, and data parallelism that all-reduces that buffer once per step.

A graphed training step (``FastPathsHook(cuda_graphs=True)``) computes every parameter's gradient inside a
replayed CUDA graph. Handing them back through autograd costs host time per parameter, every step: autograd's
accumulator for each one and, under ``DistributedDataParallel``, the reducer's hook and a scaled copy into its
bucket for each one (~350 of each for a DETR step, on a host that is the step's bottleneck).

:class:`ParameterGradientSlots` gives each trainable parameter a slot, a view of one flat buffer per dtype and
device; a graphed region writes its parameters' gradients into their slots and makes the slots their ``.grad``
(:class:`deform_plugin.integration.mmdet_fast_paths.graphed_region.GraphedRegion`), with no autograd accumulation.

:class:`FlatGradientsDataParallel` is the model wrapper for such runs (``model_wrapper_cfg``): after the backward it
moves every gradient not already in its slot (an eager step's) into it and all-reduces each flat buffer once, so
that every rank holds the mean of the ranks' gradients, as ``DistributedDataParallel`` gives them (each gradient
scaled by 1 / world size, then summed). It broadcasts rank 0's parameters and buffers when it is built, as
``DistributedDataParallel`` does, and, like it with ``broadcast_buffers=False``, not again. Asked to
(``time_steps=True`` or :meth:`FlatGradientsDataParallel.enable_step_times`), it times each step's compute and
all-reduce on every rank, without host syncs (:class:`~deform_plugin.engine.step_times.StepTimes`).
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

import torch
from mmengine.registry import MODEL_WRAPPERS
from torch import nn

from .step_times import StepTimes


class ParameterGradientSlots:
    """A gradient slot for each trainable, contiguous parameter: views of one zeroed flat buffer per (dtype,
    device), in the parameters' order (the same on every rank of a run)."""

    def __init__(self, parameters: Iterable[nn.Parameter]):
        unique: Dict[int, nn.Parameter] = {}
        for parameter in parameters:
            if parameter.requires_grad:
                unique.setdefault(id(parameter), parameter)
        self.parameters: List[nn.Parameter] = list(unique.values())
        # Parameters whose layout a flat view cannot take (an optimizer expects .grad in the parameter's strides).
        self.unslotted: List[nn.Parameter] = [p for p in self.parameters if not p.is_contiguous()]
        groups: Dict[Tuple[torch.dtype, torch.device], List[nn.Parameter]] = {}
        for parameter in self.parameters:
            if parameter.is_contiguous():
                groups.setdefault((parameter.dtype, parameter.device), []).append(parameter)
        self.flats: List[torch.Tensor] = []
        self._slots: Dict[int, torch.Tensor] = {}
        for (dtype, device), members in groups.items():
            flat = torch.zeros(sum(p.numel() for p in members), dtype=dtype, device=device)
            self.flats.append(flat)
            offset = 0
            for parameter in members:
                self._slots[id(parameter)] = flat[offset:offset + parameter.numel()].view_as(parameter)
                offset += parameter.numel()
        self.slotted: List[Tuple[nn.Parameter, torch.Tensor]] = [
            (p, self._slots[id(p)]) for p in self.parameters if id(p) in self._slots]

    def slot(self, parameter: nn.Parameter) -> Optional[torch.Tensor]:
        """``parameter``'s slot, or None where it has none (not trainable when the slots were made, or not
        contiguous)."""
        return self._slots.get(id(parameter))

    def gather(self) -> None:
        """Bring every trainable parameter's gradient into its slot: a gradient held elsewhere (from an eager
        backward) is copied in, a missing one (a parameter this step did not use) becomes zeros there; then each
        slotted parameter's ``.grad`` is its slot."""
        targets, sources, missing, reassigned = [], [], [], []
        for parameter, slot in self.slotted:
            if not parameter.requires_grad:
                continue
            grad = parameter.grad
            if grad is slot:  # a graphed region's replay put it there
                continue
            if grad is None:
                missing.append(slot)
            elif grad.data_ptr() != slot.data_ptr():
                targets.append(slot)
                sources.append(grad)
            reassigned.append((parameter, slot))
        if targets:
            torch._foreach_copy_(targets, sources)
        if missing:
            torch._foreach_zero_(missing)
        for parameter, slot in reassigned:
            parameter.grad = slot


@MODEL_WRAPPERS.register_module()
class FlatGradientsDataParallel(nn.Module):
    """Data-parallel training with one all-reduce per flat gradient buffer and step, for graphed training steps.

    Use it in place of mmengine's ``MMDistributedDataParallel`` (the ``configs/fast/`` DETR configs do)::

        model_wrapper_cfg = dict(type='FlatGradientsDataParallel')

    ``train_step`` is ``MMDistributedDataParallel``'s (data preprocessor, forward, losses, the optim wrapper's
    backward, step and zero_grad, with gradient accumulation), with the gradients averaged over the ranks between
    backward and step. Differences from ``DistributedDataParallel``: no reduction overlaps the backward (a graphed
    backward hands over its gradients at its end anyway); a parameter that got no gradient on a rank contributes
    zeros there, and after the step every trainable parameter holds a gradient (zeros where no rank used it), where
    ``DistributedDataParallel`` without ``find_unused_parameters`` would raise; buffers are not broadcast after the
    first step (as with ``broadcast_buffers=False``, the fast configs' setting).

    Args:
        module: the model (already on its device).
        process_group: the group to average over; the default group where None.
        broadcast_buffers: must be False (buffers are broadcast once, when the wrapper is built); for buffers that
            change in training and must agree across ranks every step, use ``MMDistributedDataParallel``.
        find_unused_parameters: accepted for configs written for ``MMDistributedDataParallel``; either way a
            parameter without a gradient contributes zeros (nothing to find).
        time_steps: keep each step's compute, all-reduce and step milliseconds in :attr:`step_times` (off by
            default: a step's cost is four CUDA event records and one event query, no sync, but the figures grow
            by one record per step for the whole run; the training benchmark turns it on).
    """

    def __init__(self, module: nn.Module, process_group=None, broadcast_buffers: bool = False,
                 find_unused_parameters: bool = False, time_steps: bool = False):
        super().__init__()
        import torch.distributed as dist
        if broadcast_buffers:
            raise ValueError(f"FlatGradientsDataParallel(broadcast_buffers={broadcast_buffers!r}): buffers are "
                             "broadcast once, when the wrapper is built, not every step; use "
                             "MMDistributedDataParallel for that")
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("FlatGradientsDataParallel needs an initialised torch.distributed process group "
                             "(launch with tools/dist_train.sh or torchrun)")
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        source = dist.get_global_rank(process_group, 0) if process_group is not None else 0
        with torch.no_grad():
            for tensor in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(tensor.data, src=source, group=process_group)
        self.gradient_slots = ParameterGradientSlots(module.parameters())
        self.step_times: Optional[StepTimes] = None
        if time_steps:
            self.enable_step_times()

    def enable_step_times(self) -> StepTimes:
        """Time every step from now on (see ``time_steps``); the :class:`StepTimes` that keeps the figures."""
        if self.step_times is None:
            parameter = next(iter(self.gradient_slots.parameters), None)
            self.step_times = StepTimes(parameter.device if parameter is not None else "cpu")
        return self.step_times

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def train_step(self, data, optim_wrapper) -> Dict[str, torch.Tensor]:
        if self.step_times is not None:
            self.step_times.start()
        with optim_wrapper.optim_context(self):
            data = self.module.data_preprocessor(data, training=True)
            losses = self.module._run_forward(data, mode="loss")
        parsed_loss, log_vars = self.module.parse_losses(losses)
        optim_wrapper.backward(optim_wrapper.scale_loss(parsed_loss))
        if optim_wrapper.should_update():
            self.average_gradients()
            optim_wrapper.step()
            optim_wrapper.zero_grad()
        if self.step_times is not None:
            self.step_times.end()
        return log_vars

    def average_gradients(self) -> None:
        """Every trainable parameter's gradient becomes the mean over the ranks (in its slot where it has one)."""
        import torch.distributed as dist
        slots = self.gradient_slots
        slots.gather()
        if self.step_times is not None:
            self.step_times.mark("gradients_ready")
        scale = 1.0 / self.world_size
        for flat in slots.flats:
            flat.mul_(scale)
            dist.all_reduce(flat, group=self.process_group)
        for parameter in slots.unslotted:
            if not parameter.requires_grad:
                continue
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            parameter.grad.mul_(scale)
            dist.all_reduce(parameter.grad, group=self.process_group)
        if self.step_times is not None:
            self.step_times.mark("reduced")

    def val_step(self, data) -> list:
        return self.module.val_step(data)

    def test_step(self, data) -> list:
        return self.module.test_step(data)
