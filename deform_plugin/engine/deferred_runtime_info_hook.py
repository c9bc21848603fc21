"""``DeferredRuntimeInfoHook``: the losses reach the message hub once per logging interval, without per-iteration
host syncs (``default_hooks.runtime_info``)."""
from __future__ import annotations

from typing import Optional

from mmengine.hooks import LoggerHook, RuntimeInfoHook
from mmengine.registry import HOOKS

from .sync_free import DEFERRED_SCALARS


@HOOKS.register_module()
class DeferredRuntimeInfoHook(RuntimeInfoHook):
    """mmengine's ``RuntimeInfoHook`` that hands the losses to the message hub once per logging interval.

    The stock hook calls ``.item()`` on every loss every iteration. This one keeps them (and the gradient norm of a
    ``SyncFree*OptimWrapper``) on the device and copies them in one transfer right before the ``LoggerHook`` of the
    same run reads them: at its interval, at the end of an epoch and at the end of training. The logged values are
    the same; between logging iterations the hub's ``train/*`` scalars lag behind. Select it in a config with::

        default_hooks = dict(runtime_info=dict(type='DeferredRuntimeInfoHook'))

    Args:
        interval (int, optional): Flush every this many iterations; None takes the run's ``LoggerHook`` interval.
    """

    def __init__(self, interval: Optional[int] = None):
        super().__init__()
        self.interval = interval

    def before_train(self, runner) -> None:
        super().before_train(runner)
        if self.interval is None:
            loggers = [hook for hook in runner.hooks if isinstance(hook, LoggerHook)]
            self.interval = loggers[0].interval if loggers else 1
        DEFERRED_SCALARS.active = True

    def after_train_iter(self, runner, batch_idx: int, data_batch=None, outputs: Optional[dict] = None) -> None:
        DEFERRED_SCALARS.end_iteration(outputs)
        if (self.every_n_train_iters(runner, self.interval) or self.end_of_epoch(runner.train_dataloader, batch_idx)
                or self.is_last_train_iter(runner)):
            DEFERRED_SCALARS.flush(runner.message_hub)

    def after_train(self, runner) -> None:
        DEFERRED_SCALARS.flush(runner.message_hub)
        DEFERRED_SCALARS.active = False
