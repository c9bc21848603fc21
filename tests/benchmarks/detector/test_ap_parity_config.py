"""deform_plugin.benchmarks.detector.ap_parity_config: each row's config derived from the shipped files, as mmengine
merges it. Stock rows are mmdet as it is, ours rows keep every fast path as shipped, and every row of a seed trains
the same model, data, schedule and initial weights."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from deform_plugin.benchmarks.detector import ap_parity_config as apc
from deform_plugin.benchmarks.detector.train_overlay import parse_row, plugin_references, read_base_config

DATA = apc.ShapesData(root=Path("/data/shapes-v1"), classes=("circle", "square", "triangle", "star"),
                      palette=((1, 2, 3),) * 4, val_ann_file=Path("/work/val_first8.json"), val_images=8)
SCHEDULE = apc.Schedule(iters=100, batch_size=4, scales=(288, 352), test_scale=320, lr=3e-4, warmup_iters=10,
                        val_every=50)


@pytest.fixture(scope="module")
def derive(tmp_path_factory):
    """derive(config name, row text, seed=0, schedule=SCHEDULE) -> the run's merged config (each base and each run's
    config read once: mmdet's bases take a while)."""
    folder = tmp_path_factory.mktemp("derived")
    bases, runs = {}, {}

    def derived(name, row_text, seed=0, schedule=SCHEDULE):
        if (name, row_text, seed, schedule) not in runs:
            runs[name, row_text, seed, schedule] = derive_once(name, row_text, seed, schedule)
        return runs[name, row_text, seed, schedule]

    def derive_once(name, row_text, seed, schedule):
        config, row = apc.PARITY_CONFIGS[name], parse_row(row_text)
        path = config.base_for(row)
        if path not in bases:
            bases[path] = read_base_config(path)
        files = apc.RunFiles(folder / f"{name}-{row.label.replace(':', '-')}-{seed}-{schedule.backbone}")
        overlay = apc.overlay_settings(bases[path], row, seed, schedule, DATA, files,
                                       folder / "inits" / name / f"seed{seed}.pth", time_limit_s=200, stop_at=1e10)
        apc.write_overlay(files.overlay, path, overlay, "test", stock=row.stock)
        return read_base_config(files.overlay)

    return derived


def hook_types(cfg):
    return [hook["type"] for hook in cfg.custom_hooks]


@pytest.mark.parametrize("name", ["ddetr", "dino"])
def test_stock_rows_are_mmdet_as_it_is(derive, name):
    cfg = derive(name, "stock:fp32")
    assert plugin_references(cfg.to_dict()) == []
    assert cfg.custom_imports.imports == [apc.TIMER_MODULE, apc.PARITY_MODULE]
    assert hook_types(cfg) == ["IterationTimerHook", "ParityRunHook"]
    assert cfg.optim_wrapper.type == "OptimWrapper" and "constructor" not in cfg.optim_wrapper
    assert cfg.custom_hooks[0]["expect_plugin"] is False  # the run fails if deform_plugin gets imported


@pytest.mark.parametrize("name", ["ddetr", "dino"])
def test_ours_rows_keep_every_fast_path_as_shipped(derive, name):
    shipped = read_base_config(apc.PARITY_CONFIGS[name].fast)
    cfg = derive(name, "ours:bf16")
    assert cfg.custom_imports.imports[:2] == ["deform_plugin", "deform_plugin.engine"]
    assert cfg.custom_hooks[:2] == shipped.custom_hooks  # FastPathsHook (cuda_graphs...) and ShapeBucketsHook(128)
    assert cfg.custom_hooks[0]["cuda_graphs"] is True and cfg.custom_hooks[1]["size_divisor"] == 128
    assert cfg.optim_wrapper.type == "SyncFreeOptimWrapper"
    assert cfg.optim_wrapper.constructor == "MergedParamGroupsOptimWrapperConstructor"
    assert cfg.default_hooks.runtime_info.type == "DeferredRuntimeInfoHook"
    assert cfg.custom_hooks[2]["expect_plugin"] is True
    no_buckets = derive(name, "ours:bf16:no-buckets")
    assert hook_types(no_buckets) == ["FastPathsHook", "IterationTimerHook", "ParityRunHook"]
    assert no_buckets.custom_hooks[0] == shipped.custom_hooks[0]


@pytest.mark.parametrize("name", ["ddetr", "dino"])
def test_every_row_of_a_seed_trains_the_same_model_data_and_schedule(derive, name):
    configs = [derive(name, row) for row in ("stock:fp32", "ours:bf16", "ours:bf16:no-buckets")]

    def trained(cfg):
        model = cfg.model.to_dict()
        model["data_preprocessor"].pop("non_blocking", None)  # the fast file's asynchronous copy: the same values
        return dict(model=model, dataset=cfg.train_dataloader.dataset.to_dict(),
                    batch=(cfg.train_dataloader.batch_size, cfg.train_dataloader.sampler.to_dict()),
                    val=(cfg.val_dataloader.dataset.to_dict(), cfg.val_evaluator.to_dict()),
                    loop=cfg.train_cfg.to_dict(), schedulers=cfg.param_scheduler,
                    optimizer=cfg.optim_wrapper.optimizer.to_dict(),
                    paramwise=cfg.optim_wrapper.paramwise_cfg.to_dict(), clip=cfg.optim_wrapper.clip_grad.to_dict(),
                    seed=cfg.randomness.to_dict(), load_from=cfg.load_from)

    stock = trained(configs[0])
    for cfg in configs[1:]:
        assert trained(cfg) == stock
    assert stock["load_from"].endswith(f"inits/{name}/seed0.pth") and stock["seed"] == dict(seed=0)
    assert derive(name, "stock:fp32", seed=2).load_from.endswith(f"inits/{name}/seed2.pth")
    assert stock["optimizer"]["lr"] == pytest.approx(3e-4)
    assert stock["paramwise"]["custom_keys"]["backbone"]["lr_mult"] == 1.0


def test_data_schedule_and_checkpoint(derive):
    cfg = derive("dino", "stock:fp32")
    dataset = cfg.train_dataloader.dataset
    assert (dataset.type, dataset.data_root, dataset.ann_file) == ("CocoDataset", "/data/shapes-v1",
                                                                   "annotations/instances_train.json")
    assert list(dataset.metainfo.classes) == ["circle", "square", "triangle", "star"]
    resize = [t for t in dataset.pipeline if t["type"] == "RandomChoiceResize"]
    assert [tuple(s) for s in resize[0]["scales"]] == [(288, 288), (352, 352)] and resize[0]["keep_ratio"]
    assert cfg.train_dataloader.sampler.type == "InfiniteSampler" and cfg.train_dataloader.batch_sampler is None
    assert cfg.train_dataloader.batch_size == 4
    assert cfg.val_dataloader.dataset.ann_file == "/work/val_first8.json"
    assert cfg.val_evaluator.to_dict() == dict(type="CocoMetric", ann_file="/work/val_first8.json", metric="bbox",
                                               format_only=False, backend_args=None)
    assert [t for t in cfg.val_dataloader.dataset.pipeline if t["type"] == "Resize"][0]["scale"] == (320, 320)
    assert cfg.model.bbox_head.num_classes == 4
    assert cfg.train_cfg.to_dict() == dict(type="IterBasedTrainLoop", max_iters=100, val_interval=50)
    assert [(s["type"], s["end"]) for s in cfg.param_scheduler] == [("LinearLR", 10), ("MultiStepLR", 100)]
    assert cfg.param_scheduler[1]["milestones"] == [80]
    checkpoint = cfg.default_hooks.checkpoint
    assert (checkpoint.interval, checkpoint.save_last, checkpoint.save_optimizer) == (100, True, False)
    assert cfg.log_processor.window_size == cfg.default_hooks.logger.interval
    parity = cfg.custom_hooks[-1]
    assert (parity["time_limit_s"], parity["stop_at"], parity["wait_for"]) == (200, 1e10, cfg.load_from)


def test_the_backbone_trains_from_scratch_or_as_the_config_has_it(derive):
    trainable = derive("ddetr", "stock:fp32").model.backbone
    assert (trainable.frozen_stages, trainable.norm_eval, trainable.norm_cfg.requires_grad) == (-1, False, True)
    assert trainable.init_cfg is None  # no ImageNet download
    kept = derive("ddetr", "stock:fp32", schedule=apc.Schedule(backbone="as-config")).model.backbone
    assert (kept.frozen_stages, kept.norm_eval, kept.norm_cfg.requires_grad) == (1, True, False)
    assert kept.init_cfg is None


def test_key_fields_name_what_differs_between_rows(derive):
    stock = apc.key_fields(derive("ddetr", "stock:fp32"))
    ours = apc.key_fields(derive("ddetr", "ours:bf16:no-buckets"))
    assert stock["custom_hooks"] == ["IterationTimerHook", "ParityRunHook"]
    assert ours["custom_hooks"] == ["FastPathsHook", "IterationTimerHook", "ParityRunHook"]
    assert stock["train"] == ours["train"] == "batch 4, 1 workers, scales [288, 352]"
    assert "MergedParamGroupsOptimWrapperConstructor" in ours["optim_wrapper"]


def test_scales_too_small_for_a_two_stage_model_are_refused():
    dino = read_base_config(apc.PARITY_CONFIGS["dino"].stock)
    (problem,) = apc.scale_problems("dino", dino, apc.Schedule(scales=(128, 320), test_scale=320))
    assert problem == ("dino: side 128 gives the encoder 340 tokens, but the model picks its 900 queries among them "
                       "(two-stage top-k): use --scales and --test-scale of at least 201")
    assert apc.scale_problems("dino", dino, apc.Schedule(scales=(208, 320), test_scale=320)) == []
    demo = read_base_config(apc.PARITY_CONFIGS["demo"].stock)  # one-stage: any size
    assert apc.scale_problems("demo", demo, apc.Schedule(scales=(32,), test_scale=32)) == []


def test_schedule_problems_name_each_bad_value():
    problems = apc.Schedule(iters=10, batch_size=0, scales=(96, -1), warmup_iters=10, val_every=20, lr=0.0,
                            backbone="frozen").problems()
    assert problems == ["--batch-size 0 must be at least 1", "--scales 96 -1: each must be a positive side length",
                        "--val-every 20 is more than --iters 10", "--warmup-iters 10 must be less than --iters 10",
                        "--lr 0.0 must be positive", "--backbone 'frozen' is not one of trainable, as-config"]
    assert apc.Schedule(iters=100, val_every=30).eval_iterations() == [30, 60, 90, 100]


def test_val_subset_keeps_its_images_annotations(tmp_path):
    data = apc.prepare_data(None, 5, tmp_path)
    coco = json.loads(data.val_ann_file.read_text())
    assert data.val_ann_file.parent == tmp_path / "data" and data.val_images == 5
    ids = [image["id"] for image in coco["images"]]
    assert len(ids) == 5 and coco["annotations"] and {a["image_id"] for a in coco["annotations"]} <= set(ids)
    full = json.loads((data.root / "annotations" / "instances_val.json").read_text())
    assert len([a for a in full["annotations"] if a["image_id"] in ids]) == len(coco["annotations"])
    with pytest.raises(apc.ToolError, match="--val-images 500: the val split has 128 images"):
        apc.prepare_data(None, 500, tmp_path)
