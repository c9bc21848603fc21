"""Grounding-DINO through the training benchmark: both sides get the same random text encoder (labelled, for timing
only) where BERT's files are missing, and the synthetic set's class names as captions."""
from __future__ import annotations

import pytest
from train_benchmark_cases import FAST_GROUNDING_DINO, merged_overlay

from deform_plugin.benchmarks.detector import random_text_encoder, train_report, user_path


@pytest.mark.parametrize("row", ["stock:fp32", "ours:bf16"])
def test_both_sides_time_the_same_random_text_encoder(tmp_path, source, row):
    settings = user_path.Settings(text_encoder="random")
    base, cfg = merged_overlay(tmp_path, FAST_GROUNDING_DINO, row, source, settings)
    language_model = cfg.model.language_model
    assert language_model.type == random_text_encoder.RANDOM_TEXT_ENCODER and "name" not in language_model
    assert language_model.special_tokens_list == base.model.language_model.special_tokens_list
    assert random_text_encoder.MODULE in cfg.custom_imports.imports
    assert cfg.model.backbone == base.model.backbone  # the rest of the model is the user's
    if row.startswith("stock"):
        assert user_path.plugin_references(cfg.to_dict()) == []  # the encoder's module is no plugin piece
    # CocoDataset(return_classes=True) gives each image its classes as the caption, which the pipeline packs.
    assert cfg.train_dataloader.dataset.return_classes
    assert {"text", "custom_entities"} <= set(cfg.train_dataloader.dataset.pipeline[-1].meta_keys)


def test_real_keeps_bert_and_the_report_labels_random_rows(tmp_path, source):
    _, cfg = merged_overlay(tmp_path, FAST_GROUNDING_DINO, "ours:fp32", source, user_path.Settings(
        text_encoder="real"))
    assert cfg.model.language_model.type == "BertModel"
    report = dict(results=[dict(config=str(FAST_GROUNDING_DINO), text_encoder=random_text_encoder.TIMING_ONLY_LABEL),
                           dict(config="other.py", text_encoder=None)])
    assert train_report._random_text_encoder_configs(report) == [str(FAST_GROUNDING_DINO)]


def test_the_fast_config_builds_with_its_switches_and_the_hook_takes_them():
    from mmengine.config import Config
    from mmengine.registry import HOOKS

    from deform_plugin.engine import fast_path_switches_from_config
    cfg = Config.fromfile(str(FAST_GROUNDING_DINO), import_custom_modules=False)
    assert fast_path_switches_from_config(cfg) == dict(sdpa_attention=True, batched_matching=True,
                                                       batched_losses=True, sync_free_forward=True,
                                                       cuda_graphs=True, ffn_recompute=True)
    assert cfg.optim_wrapper.constructor == "MergedParamGroupsOptimWrapperConstructor"
    assert cfg.model_wrapper_cfg == dict(type="FlatGradientsDataParallel")
    assert [hook["type"] for hook in cfg.custom_hooks] == ["FastPathsHook", "ShapeBucketsHook"]
    # Checkpointing off (the captured backward cannot run it), the preprocessor's non-blocking copy kept.
    assert not cfg.model.backbone.with_cp and cfg.model.encoder.num_cp == 0
    assert cfg.model.data_preprocessor.non_blocking and cfg.model.data_preprocessor.type == "DetDataPreprocessor"
    HOOKS.build(cfg.custom_hooks[0])
    assert random_text_encoder.use_random_text_encoder(cfg, "random")
    assert cfg.model.language_model.type == random_text_encoder.RANDOM_TEXT_ENCODER


def test_the_fast_config_model_builds_offline_at_full_size():
    from mmdet.registry import MODELS
    from mmdet.utils import register_all_modules
    from mmengine.config import Config

    import deform_plugin  # noqa: F401  (our MSDA at mmdet's construction sites)
    from deform_plugin.benchmarks.detector import random_text_encoder_model  # noqa: F401  (registers it)
    from deform_plugin.integration.mmdet_fast_paths.graphed_grounding import graph_blockers
    register_all_modules()
    cfg = Config.fromfile(str(FAST_GROUNDING_DINO), import_custom_modules=False)
    assert random_text_encoder.use_random_text_encoder(cfg, "random")
    model = MODELS.build(cfg.model)
    assert graph_blockers(model) == []  # no checkpointing, mmdet's own pieces: cuda_graphs takes it
    assert model.language_model.language_backbone.body.language_dim == 768
    assert sum(p.numel() for p in model.parameters()) > 150_000_000  # Swin-T, BERT-base and the transformer
