"""Graph-replayed training of Grounding-DINO (BERT inside the region, its masks made on the host) gives the eager
step's losses and gradients, run eagerly and replayed from emulated graphs on the CPU; with activation checkpointing
on, cuda_graphs is refused by name."""
import copy

import pytest
import torch

pytest.importorskip("transformers")

import deform_plugin  # noqa: E402,F401  (mmcv-lite stand-in; registers our module)
from deform_plugin.cuda_graphs import CapturePolicy  # noqa: E402
from deform_plugin.integration.mmdet_fast_paths import apply_fast_paths  # noqa: E402

small_grounding_dino = pytest.importorskip("small_grounding_dino")
emulated_graphs = pytest.importorskip("emulated_graphs")

# Without dropout: the region's denoising noise is drawn before BERT and the encoder run (stock: after), so random
# layers would draw other numbers than the eager step of the same seed.
BERT_WITHOUT_DROPOUT = dict(small_grounding_dino.TINY_BERT, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0)


def _without_dropout():
    model = small_grounding_dino.small_grounding_dino(bert=BERT_WITHOUT_DROPOUT)
    for module in model.modules():
        if type(module).__name__ == "BiMultiHeadAttention":  # the fusion layers' attention dropout (0.1)
            module.dropout = 0.0
    return model


def _losses_and_gradients(model, batch):
    data = model.data_preprocessor(copy.deepcopy(batch), True)
    torch.manual_seed(3)
    losses = model.loss(data["inputs"], data["data_samples"])
    total = sum(value.sum() for value in losses.values())
    params = [p for p in model.parameters() if p.requires_grad]
    return losses, torch.autograd.grad(total, params, allow_unused=True)


def _batch(model, sizes, seed):
    """Images of ``sizes`` (height, width), each its own random targets, padded as the data preprocessor pads."""
    batch = {"inputs": [], "data_samples": []}
    for index, ((height, width), num_gts) in enumerate(zip(sizes, (3, 0, 2))):
        image = small_grounding_dino.grounding_batch(model, (num_gts,), height, width, seed + index)
        batch["inputs"] += image["inputs"]
        batch["data_samples"] += image["data_samples"]
    return batch


@pytest.mark.parametrize("split", [False, True], ids=["one-region", "features-apart"])
def test_replays_give_the_eager_losses_and_gradients(split):
    stock, fast = _without_dropout(), _without_dropout()
    changed = apply_fast_paths(fast, cuda_graphs=True, batched_losses=True, sdpa_attention=True, ffn_recompute=True,
                               split_graphs_at_features=split, capture_policy=CapturePolicy(capture_after=1))
    assert changed["cuda_graphs"] == 1
    regions = fast.graphed_training_regions
    assert len(regions) == (2 if split else 1)
    for region in regions:
        region.__class__ = emulated_graphs.EmulatedGraphRegion
    # One padded shape twice (the eager warm-up, then captured), other image sizes; then a new padded shape, captured
    # at its first call.
    for sizes, seed in [(((48, 64), (40, 56)), 0), (((40, 64), (48, 48)), 5), (((56, 64), (56, 40)), 9)]:
        batch = _batch(stock, sizes, seed)
        expected, expected_grads = _losses_and_gradients(stock, batch)
        got, got_grads = _losses_and_gradients(fast, batch)
        assert list(got) == list(expected)
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], rtol=2e-5, atol=1e-5, msg=name)
        scale = max(grad.abs().max() for grad in expected_grads if grad is not None)
        for ours, theirs in zip(got_grads, expected_grads):
            assert (ours is None) == (theirs is None)
            if theirs is not None:
                torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5 * scale)
    for region in regions:
        assert (region.eager_calls, region.replays, len(region.captured)) == (1, 2, 2)


def test_checkpointing_keeps_the_step_out_of_graphs_by_name():
    model = small_grounding_dino.small_grounding_dino()
    model.backbone.layer1[0].with_cp = True
    model.encoder.num_cp = 2
    with pytest.raises(ValueError, match=r"fast path cuda_graphs has no exact form for GroundingDINO: .*with_cp=True"
                                         r".*num_cp > 0.*turn it off"):
        apply_fast_paths(model, cuda_graphs=True)
    assert "loss" not in vars(model)
