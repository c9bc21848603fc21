"""FastPaths: the fast-path switches as one typed object, their implications, and apply_fast_paths taking either it
or its fields by keyword."""
import copy

import pytest
from detr_heads import detr_head
from mmcv.cnn.bricks.transformer import MultiheadAttention
from torch import nn

import deform_plugin  # noqa: F401  (mmcv stand-in where mmcv-lite is installed)
from deform_plugin.integration.mmdet_fast_paths import FAST_PATHS, FastPaths, apply_fast_paths


def test_every_switch_is_off_unless_set_and_truthy_values_count_as_on():
    assert FastPaths().selected() == () and FastPaths().split_graphs_at_features is None
    paths = FastPaths(sdpa_attention=1, ffn_recompute=0, split_graphs_at_features=0)
    assert paths.sdpa_attention is True and paths.ffn_recompute is False
    assert paths.split_graphs_at_features is False
    assert FAST_PATHS == FastPaths.switch_names() and len(FAST_PATHS) == 10
    assert FastPaths.field_names() == FAST_PATHS + ("split_graphs_at_features", "feature_bucket_size")


def test_the_implications_turn_on_what_each_switch_needs():
    assert FastPaths(batched_losses=True).with_implications().selected() == (
        "hungarian_host_syncs", "batched_matching", "batched_losses")
    assert FastPaths(batched_matching=True).with_implications().selected() == (
        "hungarian_host_syncs", "batched_matching")
    assert FastPaths(cuda_graphs=True).with_implications().selected() == ("sync_free_forward", "cuda_graphs")
    alone = FastPaths(sdpa_attention=True, split_graphs_at_features=True)
    assert alone.with_implications() == alone


def test_all_exact_turns_every_switch_on():
    every = FastPaths.all_exact()
    assert every.selected() == FAST_PATHS and every.split_graphs_at_features is None
    assert every.with_implications() == every


def test_an_unknown_switch_is_named_with_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown fast path switch sdpa: the switches are sdpa_attention, "
                                         r"hungarian_host_syncs, .*, split_graphs_at_features"):
        FastPaths.from_dict(dict(sdpa=True, batched_matching=True))
    with pytest.raises(ValueError, match="unknown fast path switches batched, sdpa:"):
        apply_fast_paths(MultiheadAttention(embed_dims=8, num_heads=2), sdpa=True, batched=True)
    assert FastPaths.from_dict(dict(batched_matching=True)) == FastPaths(batched_matching=True)


def test_apply_fast_paths_takes_the_object_or_its_fields_by_keyword():
    brick = MultiheadAttention(embed_dims=8, num_heads=2)
    by_object, by_keyword = copy.deepcopy(brick), copy.deepcopy(brick)
    assert apply_fast_paths(by_object, FastPaths(sdpa_attention=True)) == {"sdpa_attention": 1}
    assert apply_fast_paths(by_keyword, sdpa_attention=True) == {"sdpa_attention": 1}
    assert type(by_object) is type(by_keyword) is not MultiheadAttention
    with pytest.raises(TypeError, match="not both"):
        apply_fast_paths(brick, FastPaths(sdpa_attention=True), ffn_recompute=True)


def test_fast_paths_refuse_another_mmdet_version(monkeypatch):
    import mmdet
    monkeypatch.setattr(mmdet, "__version__", "3.2.0")
    holder = nn.Module()
    holder.bbox_head = detr_head("dino")
    with pytest.raises(RuntimeError, match=r"mirrors private methods of mmdet 3.3.0, but mmdet 3.2.0 is installed"):
        apply_fast_paths(holder, batched_matching=True)
    assert apply_fast_paths(holder, sdpa_attention=True) == {"sdpa_attention": 0}


def test_a_switch_that_changes_nothing_in_a_model_says_so(monkeypatch):
    from deform_plugin.integration import mmdet_fast_paths
    warnings = []
    monkeypatch.setattr(mmdet_fast_paths, "print_log", lambda message, logger, level: warnings.append(message))
    holder = nn.Module()
    holder.bbox_head = detr_head("dino")
    assert apply_fast_paths(holder, sdpa_attention=True, sync_free_losses=True) == {"sdpa_attention": 0,
                                                                                     "sync_free_losses": 1}
    assert warnings == ["deform_plugin: fast path sdpa_attention changes nothing in Module: it finds none of the "
                        "mmcv MultiheadAttention bricks it changes; that part of Module runs as stock"]
