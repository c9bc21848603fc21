"""Grounding-DINO under its fast config's switches: the stock losses and gradients, every layer's text-conditioned
loss in one pass, and sync_free_losses, which has no exact form, refused by name."""
import copy

import pytest
import torch

pytest.importorskip("transformers")

import deform_plugin  # noqa: E402,F401  (mmcv stand-in where mmcv-lite is installed)
from deform_plugin.integration.mmdet_fast_paths import apply_fast_paths  # noqa: E402

small_grounding_dino = pytest.importorskip("small_grounding_dino")


def _fast_config_switches():
    """The fast config's switches but cuda_graphs: its region draws the denoising noise before the random layers run
    (test_graphed_grounding.py compares it without them)."""
    from mmengine.config import Config

    from deform_plugin.engine import fast_path_switches_from_config
    cfg = Config.fromfile(str(small_grounding_dino.REPO_ROOT / small_grounding_dino.FAST_CONFIG),
                          import_custom_modules=False)
    return {name: on for name, on in fast_path_switches_from_config(cfg).items() if on and name != "cuda_graphs"}


def _losses_and_gradients(model, batch):
    model.zero_grad()
    data = model.data_preprocessor(copy.deepcopy(batch), True)
    torch.manual_seed(1)  # the denoising queries' noise
    losses = model.loss(data["inputs"], data["data_samples"])
    sum(losses.values()).sum().backward()
    return losses, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def stock_and_fast():
    from mmdet.models.dense_heads import GroundingDINOHead
    stock = small_grounding_dino.small_grounding_dino()
    fast = small_grounding_dino.small_grounding_dino()
    changed = apply_fast_paths(fast, **_fast_config_switches())
    assert changed["batched_losses"] == 1 and changed["batched_matching"] == 1 and changed["sdpa_attention"] > 0
    per_layer_calls = []
    for name in ("_get_targets_single", "_loss_dn_single"):
        method = getattr(fast.bbox_head, name, None) or getattr(GroundingDINOHead, name).__get__(fast.bbox_head)
        setattr(fast.bbox_head, name, lambda *a, _method=method, **k: per_layer_calls.append(1) or _method(*a, **k))
    return stock, fast, per_layer_calls


def test_fast_config_gives_the_stock_losses_and_gradients(stock_and_fast):
    stock_model, fast_model, per_layer_calls = stock_and_fast
    # An image without gts, and two whose gt tables are padded to the most of any (5) by different amounts.
    batch = small_grounding_dino.grounding_batch(stock_model, (0, 2, 5))
    stock, stock_grads = _losses_and_gradients(stock_model, batch)
    per_layer_calls.clear()
    fast, fast_grads = _losses_and_gradients(fast_model, batch)
    assert list(fast) == list(stock)
    for name in stock:
        assert fast[name].shape == stock[name].shape, name
        # float32: the same elements, summed over all layers' (and all tokens') view instead of one layer at a time.
        torch.testing.assert_close(fast[name], stock[name], rtol=2e-6, atol=1e-6, msg=name)
    assert set(fast_grads) == set(stock_grads)
    scale = max(grad.abs().max() for grad in stock_grads.values())
    for name, grad in stock_grads.items():
        # Relative to the largest gradient: a tensor whose true gradient is zero (BERT's key biases) holds noise.
        torch.testing.assert_close(fast_grads[name], grad, rtol=1e-4, atol=1e-5 * scale, msg=name)
    assert per_layer_calls == []  # every layer's targets and losses came from the one pass
    assert fast_model.bbox_head.losses_ahead == {}  # nothing outlives the step


def test_matching_with_host_syncs_alone_keeps_the_per_layer_losses(stock_and_fast):
    # Without batched_losses the head's own per-layer loss runs, on the targets of the host assignment.
    stock_model = stock_and_fast[0]
    model = copy.deepcopy(stock_model)
    apply_fast_paths(model, batched_matching=True)
    assert "_get_targets_single" in vars(model.bbox_head) and "prepare_layer_losses" not in vars(model.bbox_head)
    batch = small_grounding_dino.grounding_batch(stock_model, (3, 1), seed=5)
    stock, _ = _losses_and_gradients(stock_model, batch)
    fast, _ = _losses_and_gradients(model, batch)
    for name in stock:
        torch.testing.assert_close(fast[name], stock[name], rtol=1e-6, atol=1e-6, msg=name)


def test_sync_free_losses_is_refused_by_name(stock_and_fast):
    from deform_plugin.engine import FastPathsHook

    class Runner:
        model = copy.deepcopy(stock_and_fast[0])
        hooks = ()

    hook = FastPathsHook(precompile_triton=False, sdpa_attention=True, sync_free_losses=True)
    with pytest.raises(ValueError, match="fast path sync_free_losses has no exact form for GroundingDINO: "
                                         ".*masked_select.*turn it off"):
        hook.before_run(Runner)
    assert "loss_by_feat" not in vars(Runner.model.bbox_head)  # refused before anything changed


def test_detr_batched_losses_leave_a_text_conditioned_head_alone(stock_and_fast):
    from deform_plugin.integration.mmdet_fast_paths.batched_losses import batchable_head, enable_batched_losses
    from deform_plugin.integration.mmdet_fast_paths.grounding_dino_losses import stock_grounding_head
    head = copy.deepcopy(stock_and_fast[0].bbox_head)
    assert not batchable_head(head) and not enable_batched_losses(head)
    assert stock_grounding_head(head)
