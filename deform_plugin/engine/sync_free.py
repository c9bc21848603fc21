"""Training-step bookkeeping without device-to-host syncs: deferred scalars and optimizer wrappers.

mmengine turns every logged loss (``RuntimeInfoHook``) and the clipped gradient norm (``OptimWrapper._clip_grad``)
into a Python float each iteration: one device-to-host copy each, and each copy waits for all queued GPU work. In a
step whose host runs ahead of the GPU, every such wait costs its full length. Here those scalars stay on the device
and are copied to the host together, once per logging interval, and written into the message hub in iteration order,
so the logger reports exactly the values it would have reported.

bf16 AMP needs no loss scaling (bf16 has float32's exponent range), yet mmengine's ``AmpOptimWrapper`` always runs a
``GradScaler``, whose inf check syncs the host every step. :class:`SyncFreeAmpOptimWrapper` drops the scaler for
bf16 and keeps it for fp16.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
from mmengine.optim import AmpOptimWrapper, OptimWrapper
from mmengine.registry import OPTIM_WRAPPERS


class DeferredScalars:
    """Per-iteration scalars kept on the device until :meth:`flush` copies them all in one transfer."""

    def __init__(self):
        self.active = False  # set while a DeferredRuntimeInfoHook drives a run
        self._pending: Dict[str, torch.Tensor] = {}
        self._iterations: List[Dict[str, object]] = []

    def defer(self, name: str, value: torch.Tensor) -> None:
        """Keep ``value`` for the current iteration (read by the next :meth:`end_iteration`)."""
        self._pending[name] = value.detach()

    def end_iteration(self, outputs: Optional[dict]) -> None:
        record = dict(self._pending)
        self._pending.clear()
        for key, value in (outputs or {}).items():
            record[key] = value.detach() if isinstance(value, torch.Tensor) else value
        self._iterations.append(record)

    def discard(self) -> None:
        """Drop every kept value unread (a benchmark that runs steps outside a Runner)."""
        self._pending.clear()
        self._iterations.clear()

    def flush(self, message_hub) -> None:
        """Copy every kept tensor to the host in one transfer; update the hub's scalars in iteration order."""
        if not self._iterations:
            return
        tensors = [value for record in self._iterations for value in record.values()
                   if isinstance(value, torch.Tensor)]
        host_values = iter(_to_host_together(tensors))
        for record in self._iterations:
            for key, value in record.items():
                message_hub.update_scalar(f"train/{key}", next(host_values) if isinstance(value, torch.Tensor)
                                          else value)
        self._iterations.clear()


def _to_host_together(tensors: List[torch.Tensor]) -> List[float]:
    """The tensors' values as Python floats, with one device-to-host copy per device."""
    by_device: Dict[torch.device, List[int]] = {}
    for index, tensor in enumerate(tensors):
        by_device.setdefault(tensor.device, []).append(index)
    values = [0.0] * len(tensors)
    for indices in by_device.values():
        # float64 holds every float16/bfloat16/float32 value exactly: the floats equal what .item() would give.
        host = torch.stack([tensors[i].reshape(()).to(torch.float64) for i in indices]).cpu().tolist()
        for index, value in zip(indices, host):
            values[index] = value
    return values


DEFERRED_SCALARS = DeferredScalars()


class _DeferredGradNorm:
    """``_clip_grad`` that keeps the clipped gradient norm on the device while deferred logging is active."""

    def _clip_grad(self) -> None:
        params = [p for group in self.optimizer.param_groups for p in group["params"]
                  if p.requires_grad and p.grad is not None]
        if not params:
            return
        grad_norm = self.clip_func(params, **self.clip_grad_kwargs)
        if grad_norm is None:  # clip_grad_value_ returns nothing
            return
        if DEFERRED_SCALARS.active:
            DEFERRED_SCALARS.defer(self.grad_name, grad_norm)
        else:
            self.message_hub.update_scalar(f"train/{self.grad_name}", float(grad_norm))


@OPTIM_WRAPPERS.register_module()
class SyncFreeOptimWrapper(_DeferredGradNorm, OptimWrapper):
    """mmengine's ``OptimWrapper`` whose gradient-norm log waits for the next logging interval instead of syncing.

    Same updates as ``OptimWrapper``. Use it with ``DeferredRuntimeInfoHook`` (``configs/fast/`` selects both);
    without that hook it logs the norm at once, as ``OptimWrapper`` does.
    """


@OPTIM_WRAPPERS.register_module()
class SyncFreeAmpOptimWrapper(_DeferredGradNorm, AmpOptimWrapper):
    """mmengine's ``AmpOptimWrapper`` without loss scaling for bf16, and with the deferred gradient-norm log.

    For ``dtype='bfloat16'`` no ``GradScaler`` exists: backward and step are ``OptimWrapper``'s, under bf16
    autocast; the state dict holds the optimizer only (a ``loss_scaler`` entry of an older checkpoint is ignored).
    For ``dtype='float16'`` the dynamic loss scaler stays, as in ``AmpOptimWrapper``.
    """

    def __init__(self, loss_scale="dynamic", dtype=None, use_fsdp: bool = False, **kwargs):
        super().__init__(loss_scale=loss_scale, dtype=dtype, use_fsdp=use_fsdp, **kwargs)
        if self.cast_dtype == torch.bfloat16:
            self.loss_scaler = None

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        if self.loss_scaler is not None:
            return super().backward(loss, **kwargs)
        loss.backward(**kwargs)
        self._inner_count += 1

    def step(self, **kwargs) -> None:
        if self.loss_scaler is not None:
            return super().step(**kwargs)
        if self.clip_grad_kwargs:
            self._clip_grad()
        self.optimizer.step(**kwargs)

    def state_dict(self) -> dict:
        if self.loss_scaler is not None:
            return super().state_dict()
        return OptimWrapper.state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        if self.loss_scaler is not None:
            return super().load_state_dict(state_dict)
        state_dict = dict(state_dict)
        state_dict.pop("loss_scaler", None)
        OptimWrapper.load_state_dict(self, state_dict)
