"""Deferred logging gives the logger the stock values; bf16 AMP runs without a loss scaler, fp16 keeps it."""
import copy

import pytest
import torch
from mmengine.optim import OptimWrapper
from torch import nn

import deform_plugin  # noqa: F401  (registers the engine pieces)
from deform_plugin.engine import DEFERRED_SCALARS, SyncFreeAmpOptimWrapper, SyncFreeOptimWrapper


class _TinyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def losses(self, x):
        out = self.linear(x)
        return dict(loss_a=(out ** 2).mean(), loss_b=out.abs().mean())


def _train_and_log(wrapper_type, runtime_info_type, iterations=7, interval=3):
    """A Runner-free run of the hooks' contract: the values the message hub holds after each iteration."""
    from mmengine.hooks import LoggerHook
    from mmengine.logging import MessageHub

    from mmengine.hooks import RuntimeInfoHook

    from deform_plugin.engine import DeferredRuntimeInfoHook

    torch.manual_seed(0)
    model = _TinyModel()
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


def test_deferred_scalars_copy_once_per_flush(monkeypatch):
    from mmengine.logging import MessageHub
    hub = MessageHub.get_instance("test_deferred_scalars_copy_once")
    copies = []
    original_cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: copies.append(1) or original_cpu(self, *a, **k))
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("a per-value .item() sync"))
    for step in range(4):
        DEFERRED_SCALARS.defer("grad_norm", torch.tensor(float(step)))
        DEFERRED_SCALARS.end_iteration(dict(loss=torch.tensor(step * 2.0, dtype=torch.bfloat16), lr_note=0.5))
    DEFERRED_SCALARS.flush(hub)
    assert len(copies) == 1
    assert hub.get_scalar("train/loss").data[0].tolist() == [0.0, 2.0, 4.0, 6.0]
    assert hub.get_scalar("train/grad_norm").data[0].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert hub.get_scalar("train/lr_note").data[0].tolist() == [0.5] * 4


@pytest.fixture
def amp_wrapper_on_cpu(monkeypatch):
    # mmengine's AmpOptimWrapper refuses to be built without an accelerator; the arithmetic under test is device-free.
    import mmengine.optim.optimizer.amp_optimizer_wrapper as amp_module
    monkeypatch.setattr(amp_module, "is_cuda_available", lambda: True)

    def build(dtype, model):
        return SyncFreeAmpOptimWrapper(optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dtype=dtype,
                                       clip_grad=dict(max_norm=0.5))
    return build


def test_bf16_has_no_loss_scaler_and_gives_the_plain_update(amp_wrapper_on_cpu):
    torch.manual_seed(0)
    model = _TinyModel()
    reference = copy.deepcopy(model)
    wrapper = amp_wrapper_on_cpu("bfloat16", model)
    plain = OptimWrapper(optimizer=torch.optim.SGD(reference.parameters(), lr=0.1), clip_grad=dict(max_norm=0.5))
    assert wrapper.loss_scaler is None
    x = torch.randn(5, 4)
    for m, w in ((model, wrapper), (reference, plain)):
        w.update_params(sum(m.losses(x).values()))
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    state = wrapper.state_dict()
    assert "loss_scaler" not in state
    wrapper.load_state_dict(dict(state, loss_scaler={"scale": 65536.0}))  # an fp16 checkpoint's entry is ignored


def test_fp16_keeps_its_dynamic_loss_scaler(amp_wrapper_on_cpu):
    wrapper = amp_wrapper_on_cpu("float16", _TinyModel())
    assert isinstance(wrapper.loss_scaler, torch.amp.GradScaler)
