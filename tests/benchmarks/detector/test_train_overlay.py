"""deform_plugin.benchmarks.detector.train_overlay: the overlay config of stock and our rows (stock rows lose every
deform_plugin piece), pretrained weights dropped, unsupported configs refused, the timed windows and the profile."""
from __future__ import annotations


import pytest
from train_benchmark_cases import (FAST_DDETR, FAST_DDQ, FAST_MASK2FORMER, FAST_PANOPTIC, PANOPTIC, REPO_ROOT,
                                   merged_overlay)

from deform_plugin.benchmarks.detector import train_overlay, user_path


def test_stock_overlay_strips_every_plugin_piece_and_keeps_the_pipeline(tmp_path, source):
    settings = user_path.Settings(iters=7, batch_size=3, workers=2)
    base, cfg = merged_overlay(tmp_path, FAST_DDETR, "stock:fp32", source, settings)
    assert user_path.plugin_references(base.to_dict())  # the fast config does name deform_plugin ...
    assert user_path.plugin_references(cfg.to_dict()) == []  # ... and the stock overlay no longer does
    assert cfg.custom_imports.imports == [user_path.TIMER_MODULE]
    assert [hook.type for hook in cfg.custom_hooks] == [user_path.TIMER_HOOK]
    assert cfg.custom_hooks[0].expect_plugin is False
    expected_optim = {k: v for k, v in base.optim_wrapper.to_dict().items() if k != "constructor"}
    expected_optim["type"] = "OptimWrapper"  # the fast config's SyncFreeOptimWrapper is ours
    assert cfg.optim_wrapper.to_dict() == expected_optim
    assert base.default_hooks.runtime_info.type == "DeferredRuntimeInfoHook"
    assert cfg.default_hooks.runtime_info.type == "RuntimeInfoHook"
    loader, base_loader = cfg.train_dataloader, base.train_dataloader
    assert loader.dataset.pipeline == base_loader.dataset.pipeline
    assert loader.dataset.type == "CocoDataset" and loader.dataset.filter_cfg == base_loader.dataset.filter_cfg
    assert (loader.dataset.data_root, loader.dataset.ann_file) == (source.data_root, source.ann_file)
    assert loader.dataset.data_prefix.img == source.image_dir
    assert (loader.batch_size, loader.num_workers, loader.persistent_workers) == (3, 2, True)
    assert loader.sampler.to_dict() == dict(type="InfiniteSampler", shuffle=True)
    assert loader.batch_sampler == base_loader.batch_sampler
    assert cfg.train_cfg.to_dict() == dict(type="IterBasedTrainLoop", max_iters=7, val_interval=user_path.NEVER)
    for key in ("val_dataloader", "val_evaluator", "val_cfg", "test_dataloader", "test_evaluator", "test_cfg"):
        assert cfg[key] is None, key
    assert cfg.default_hooks.checkpoint.save_last is False and cfg.default_hooks.checkpoint.by_epoch is False
    assert cfg.model.backbone.init_cfg is None and base.model.backbone.init_cfg.type == "Pretrained"
    assert cfg.load_from is None and cfg.randomness.seed == 0
    assert cfg.model.encoder == base.model.encoder  # the model is the user's


def test_our_overlay_keeps_the_plugin_pieces(tmp_path, source):
    base, cfg = merged_overlay(tmp_path, FAST_MASK2FORMER, "ours:bf16", source)
    assert cfg.custom_imports.imports == ["deform_plugin", "deform_plugin.engine", user_path.TIMER_MODULE]
    assert [hook.type for hook in cfg.custom_hooks] == ["FastPathsHook", user_path.TIMER_HOOK]
    assert cfg.custom_hooks[0] == base.custom_hooks[0] and cfg.custom_hooks[1].expect_plugin is True
    _, ddetr = merged_overlay(tmp_path, FAST_DDETR, "ours:bf16", source)
    assert [hook.type for hook in ddetr.custom_hooks] == ["FastPathsHook", "ShapeBucketsHook", user_path.TIMER_HOOK]
    assert cfg.optim_wrapper == base.optim_wrapper
    assert cfg.optim_wrapper.constructor == train_overlay.MERGED_CONSTRUCTOR
    assert cfg.train_dataloader.dataset.pipeline == base.train_dataloader.dataset.pipeline
    assert cfg.train_dataloader.dataset.data_prefix.seg == base.train_dataloader.dataset.data_prefix.seg
    assert cfg.train_cfg.type == "IterBasedTrainLoop" and "dynamic_intervals" not in cfg.train_cfg


def test_an_own_shapes_row_pads_each_rank_to_its_own_bucket(tmp_path, source):
    base, cfg = merged_overlay(tmp_path, FAST_DDETR, "ours:bf16:own-shapes", source)
    buckets = [hook for hook in cfg.custom_hooks if hook.type == "ShapeBucketsHook"]
    shipped = [hook for hook in base.custom_hooks if hook.type == "ShapeBucketsHook"]
    assert len(buckets) == 1 and buckets[0].same_shape_on_every_rank is False
    assert {k: v for k, v in buckets[0].items() if k != "same_shape_on_every_rank"} == shipped[0].to_dict()
    with pytest.raises(user_path.UnsupportedConfig, match="has no ShapeBucketsHook to pad per rank"):
        merged_overlay(tmp_path, FAST_MASK2FORMER, "ours:bf16:own-shapes", source)


def test_the_ddq_fast_config_gives_a_stock_and_our_overlay(tmp_path, source):
    # Its FastPathsHook is written out in the config (not a fast_step.py value): the stock overlay still drops it.
    base, stock = merged_overlay(tmp_path, FAST_DDQ, "stock:fp32", source)
    user_path.check_supported(base, FAST_DDQ)
    assert user_path.plugin_references(stock.to_dict()) == []
    assert [hook.type for hook in stock.custom_hooks] == [user_path.TIMER_HOOK]
    _, ours = merged_overlay(tmp_path, FAST_DDQ, "ours:bf16", source)
    assert [hook.type for hook in ours.custom_hooks] == ["FastPathsHook", "ShapeBucketsHook", user_path.TIMER_HOOK]
    for cfg in (stock, ours):
        assert cfg.model.type == "DDQDETR" and cfg.model.backbone.init_cfg is None
        assert cfg.train_dataloader.dataset.pipeline == base.train_dataloader.dataset.pipeline


def test_pretrained_init_cfgs_are_dropped_wherever_they_are():
    pretrained = dict(type="Pretrained", checkpoint="torchvision://resnet50")
    kaiming = dict(type="Kaiming", layer="Conv2d")
    model = dict(type="M", init_cfg=[kaiming, pretrained], backbone=dict(depth=50, init_cfg=pretrained),
                 heads=[dict(type="H", init_cfg=pretrained), dict(type="H")], neck=dict(init_cfg=kaiming))
    assert train_overlay.pretrained_overrides(model) == dict(
        init_cfg=[kaiming], backbone=dict(init_cfg=None), heads=[dict(type="H", init_cfg=None), dict(type="H")])


def test_each_config_reads_the_set_of_its_dataset_and_other_datasets_are_refused():
    for config, kind in ((FAST_DDETR, "detection"), (FAST_MASK2FORMER, "detection"), (PANOPTIC, "panoptic"),
                         (FAST_PANOPTIC, "panoptic")):
        assert user_path.check_supported(user_path.read_base_config(config), config) == kind, config.name
    demo = REPO_ROOT / "configs" / "demo" / "deformable-detr-refine_r18_tiny_1xb4-500i_shapes.py"
    with pytest.raises(user_path.UnsupportedConfig, match="ShapesCocoDataset: .*CocoDataset or CocoPanopticDataset"):
        user_path.check_supported(user_path.read_base_config(demo), demo)


def test_panoptic_overlays_read_the_panoptic_pngs_through_the_configs_pipeline(tmp_path, panoptic_source):
    for row in ("stock:fp32", "ours:bf16"):
        base, cfg = merged_overlay(tmp_path, FAST_PANOPTIC, row, panoptic_source)
        dataset = cfg.train_dataloader.dataset
        assert dataset.type == "CocoPanopticDataset" and dataset.pipeline == base.train_dataloader.dataset.pipeline
        assert (dataset.data_root, dataset.ann_file) == (panoptic_source.data_root, panoptic_source.ann_file)
        assert dataset.data_prefix.to_dict() == dict(img=panoptic_source.image_dir, seg=panoptic_source.seg_dir)
    assert [hook.type for hook in cfg.custom_hooks] == ["FastPathsHook", user_path.TIMER_HOOK]


def test_default_windows_follow_the_iterations():
    assert user_path.Settings(iters=100).windows() == dict(first=(1, 20), first_100=(1, 100), all=(1, 100),
                                                           steady=(51, 100))
    assert user_path.Settings(iters=250, steady_start=151).windows() == dict(
        first=(1, 20), first_100=(1, 100), all=(1, 250), steady=(151, 250))
    assert user_path.Settings(iters=3, first_iters=1, steady_start=2).windows() == dict(
        first=(1, 1), first_100=(1, 3), all=(1, 3), steady=(2, 3))
    with pytest.raises(ValueError, match="first <= last"):
        user_path.Settings(iters=10, steady_start=11).windows()


def test_a_profile_window_adds_the_step_profiler_to_the_overlay(tmp_path, source):
    settings = user_path.Settings(iters=200, profile_first=151, profile_steps=3)
    row = user_path.parse_row("ours:bf16")
    base = user_path.read_base_config(FAST_DDETR)
    with pytest.raises(ValueError, match="profile_dir"):
        user_path.overlay_settings(base, row, source, settings, tmp_path / "t.json")
    overlay = user_path.overlay_settings(base, row, source, settings, tmp_path / "t.json", tmp_path / "profiles")
    assert overlay["custom_imports"]["imports"][-1] == train_overlay.PROFILER_MODULE
    assert overlay["custom_hooks"][-1] == dict(type=train_overlay.PROFILER_HOOK, first=151, steps=3,
                                               out_dir=str(tmp_path / "profiles"))
    unprofiled = user_path.overlay_settings(base, row, source, user_path.Settings(), tmp_path / "t.json")
    assert train_overlay.PROFILER_MODULE not in unprofiled["custom_imports"]["imports"]
