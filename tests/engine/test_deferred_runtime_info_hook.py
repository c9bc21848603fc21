"""DeferredRuntimeInfoHook gives the logger the stock values, read from the device once per logging interval."""
import torch
from mmengine.optim import OptimWrapper
from tiny_models import TwoLossModel

import deform_plugin  # noqa: F401  (registers the engine pieces)
from deform_plugin.engine import DEFERRED_SCALARS, DeferredRuntimeInfoHook, SyncFreeOptimWrapper


def _train_and_log(wrapper_type, runtime_info_type, iterations=7, interval=3):
    """A Runner-free run of the hooks' contract: the values the message hub holds after each iteration."""
    from mmengine.hooks import LoggerHook, RuntimeInfoHook
    from mmengine.logging import MessageHub

    torch.manual_seed(0)
    model = TwoLossModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapper = wrapper_type(optimizer=optimizer, clip_grad=dict(max_norm=0.5))
    hub = MessageHub.get_instance(f"test_sync_free_{wrapper_type.__name__}_{runtime_info_type}")
    wrapper.message_hub = hub
    hook = DeferredRuntimeInfoHook(interval=interval) if runtime_info_type == "deferred" else RuntimeInfoHook()

    class _Loop:
        max_iters = iterations

    class _Runner:
        message_hub = hub
        hooks = [LoggerHook(interval=interval)]
        train_loop = _Loop()
        max_iters = iterations
        train_dataloader = list(range(100))
        iter = 0

    runner = _Runner()
    # What DeferredRuntimeInfoHook.before_train turns on (the rest of RuntimeInfoHook's needs a full Runner).
    DEFERRED_SCALARS.active = isinstance(hook, DeferredRuntimeInfoHook)
    generator = torch.Generator().manual_seed(1)
    seen = []
    try:
        for index in range(iterations):
            runner.iter = index
            losses = model.losses(torch.randn(5, 4, generator=generator))
            loss = sum(losses.values())
            wrapper.update_params(loss)
            outputs = dict(loss=loss.detach(), **{k: v.detach() for k, v in losses.items()})
            hook.after_train_iter(runner, index, None, outputs)
            seen.append(len(hub.get_scalar("train/loss").data[0]) if "train/loss" in hub.log_scalars else 0)
        if isinstance(hook, DeferredRuntimeInfoHook):
            hook.after_train(runner)
    finally:
        DEFERRED_SCALARS.active = False
    history = {key: hub.get_scalar(key).data[0].tolist() for key in ("train/loss", "train/loss_a", "train/grad_norm")}
    return history, seen


def test_deferred_logging_gives_the_logger_the_stock_values():
    stock, stock_seen = _train_and_log(OptimWrapper, "stock")
    deferred, deferred_seen = _train_and_log(SyncFreeOptimWrapper, "deferred")
    assert deferred == stock and len(stock["train/loss"]) == 7
    # Stock writes every iteration; deferred writes at the logging iterations (3, 6) and the last one (7).
    assert stock_seen == [1, 2, 3, 4, 5, 6, 7]
    assert deferred_seen == [0, 0, 3, 3, 3, 6, 7]
