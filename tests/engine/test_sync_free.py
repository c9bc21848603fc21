"""The deferred scalars copy once per flush; bf16 AMP runs without a loss scaler, fp16 keeps it."""
import copy

import pytest
import torch
from mmengine.optim import OptimWrapper
from tiny_models import TwoLossModel

import deform_plugin  # noqa: F401  (registers the engine pieces)
from deform_plugin.engine import DEFERRED_SCALARS, SyncFreeAmpOptimWrapper


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
    model = TwoLossModel()
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
    wrapper = amp_wrapper_on_cpu("float16", TwoLossModel())
    assert isinstance(wrapper.loss_scaler, torch.amp.GradScaler)
