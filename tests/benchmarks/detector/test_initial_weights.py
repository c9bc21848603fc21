"""deform_plugin.benchmarks.detector.initial_weights: one state dict per seed, the same for the same seed, and
readable by ``torch.load(weights_only=True)`` (what mmengine's ``load_from`` does under torch >= 2.6)."""
from __future__ import annotations

import pytest
import torch

from deform_plugin.benchmarks.detector import initial_weights
from deform_plugin.benchmarks.detector.ap_parity_config import PARITY_CONFIGS


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The demo model's initial weights for seeds 0 and 1, then for seed 0 again in another folder."""
    config = str(PARITY_CONFIGS["demo"].stock)
    first, again = tmp_path_factory.mktemp("first"), tmp_path_factory.mktemp("again")
    paths = initial_weights.build_initial_weights(config, [0, 1], first)
    (repeat,) = initial_weights.build_initial_weights(config, [0], again)
    return [torch.load(path, weights_only=True) for path in (*paths, repeat)]


def test_each_seed_has_its_weights_and_a_seed_repeats_exactly(built):
    seed0, seed1, seed0_again = built
    assert seed0["meta"]["seed"] == 0 and seed1["meta"]["seed"] == 1
    assert seed0["state_dict"].keys() == seed1["state_dict"].keys() == seed0_again["state_dict"].keys()
    assert all(torch.equal(seed0["state_dict"][k], seed0_again["state_dict"][k]) for k in seed0["state_dict"])
    differ = [k for k in seed0["state_dict"] if not torch.equal(seed0["state_dict"][k], seed1["state_dict"][k])]
    assert "backbone.conv1.weight" in differ and "bbox_head.cls_branches.0.weight" in differ


def test_the_files_hold_the_whole_model(built):
    seed0 = built[0]
    assert seed0["meta"]["parameters"] == sum(t.numel() for k, t in seed0["state_dict"].items()
                                              if "running_" not in k and "num_batches_tracked" not in k)
