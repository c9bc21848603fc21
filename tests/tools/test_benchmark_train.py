"""The user-path training benchmark (tools/benchmark_train.py, deform_plugin/benchmarks/detector/): the synthetic COCO-like
source, the overlay configs of stock and our rows, the timing hook's windows, and one tiny CPU run of both rows.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path
from types import SimpleNamespace

import cv2
import numpy as np
import pytest
import torch

from deform_plugin.benchmarks.detector import coco_source, train_overlay, user_path
from deform_plugin.benchmarks.detector.iteration_timer import IterationTimerHook
from deform_plugin.benchmarks.stock_process import stock_command

REPO_ROOT = Path(__file__).resolve().parents[2]
FAST_DDETR = REPO_ROOT / "configs" / "fast" / "deformable-detr-refine-twostage_r50_16xb2-50e_coco_deform-plugin-fast.py"
FAST_MASK2FORMER = REPO_ROOT / "configs" / "fast" / "mask2former_r50_8xb2-lsj-50e_coco_deform-plugin-fast.py"
PANOPTIC = REPO_ROOT / "configs" / "mask2former" / "mask2former_r50_8xb2-lsj-50e_coco-panoptic_deform-plugin.py"
TINY_COCO_CONFIG = Path(__file__).parent / "configs" / "deformable-detr-refine_r18_tiny_1xb2_coco-format.py"
SOURCE_IMAGES = 24


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> coco_source.CocoSource:
    return coco_source.ensure_coco_source(tmp_path_factory.mktemp("coco_cache"), num_images=SOURCE_IMAGES, seed=0)


def merged_overlay(tmp_path: Path, config: Path, row_text: str, source, settings=None):
    """The overlay of ``row_text`` on ``config``, written and loaded back as mmengine merges it."""
    row = user_path.parse_row(row_text)
    base = user_path.read_base_config(config)
    overlay = user_path.overlay_settings(base, row, source, settings or user_path.Settings(), tmp_path / "t.json")
    path = tmp_path / f"{row.side}-{row.mode}.py"
    path.write_text(user_path.render_overlay(config, overlay, row))
    return base, user_path.read_base_config(path)


# ---------------------------------------------------------------------------------------------------------------------
# The synthetic COCO-like source
# ---------------------------------------------------------------------------------------------------------------------

def test_coco_source_is_a_valid_coco_set(source):
    from pycocotools.coco import COCO
    coco = COCO(str(source.ann_path))
    assert len(coco.imgs) == SOURCE_IMAGES
    assert [(c["id"], c["name"]) for c in coco.loadCats(coco.getCatIds())] == list(coco_source.COCO_CATEGORIES)
    for image_id, info in coco.imgs.items():
        image = cv2.imread(str(source.root / source.image_dir / info["file_name"]))
        assert image is not None, info["file_name"]
        assert image.shape[:2] == (info["height"], info["width"])
        assert (info["height"], info["width"]) in coco_source.IMAGE_SIZES
        anns = coco.loadAnns(coco.getAnnIds(imgIds=[image_id]))
        assert coco_source.OBJECTS_PER_IMAGE[0] <= len(anns) <= coco_source.OBJECTS_PER_IMAGE[1]
        for ann in anns:
            x, y, w, h = ann["bbox"]
            assert 0 <= x and 0 <= y and x + w <= info["width"] and y + h <= info["height"]
            assert w >= coco_source.MIN_OBJECT_SIDE - 1 and h >= coco_source.MIN_OBJECT_SIDE - 1
            assert ann["area"] > 0 and ann["iscrowd"] == 0
            assert len(ann["segmentation"]) == 1 and len(ann["segmentation"][0]) >= 6
            assert coco.annToMask(ann).sum() > 0  # the polygon rasterises, as LoadAnnotations(with_mask) needs


def test_coco_categories_are_mmdets():
    import deform_plugin  # noqa: F401  (mmdet.datasets imports mmcv.ops: the stand-in where mmcv-lite is installed)
    from mmdet.datasets import CocoDataset
    assert tuple(name for _, name in coco_source.COCO_CATEGORIES) == CocoDataset.METAINFO["classes"]


def test_coco_source_is_deterministic_and_cached(tmp_path):
    first = coco_source.ensure_coco_source(tmp_path / "a", num_images=3, seed=5)
    second = coco_source.ensure_coco_source(tmp_path / "b", num_images=3, seed=5)
    files = sorted(p.relative_to(first.root) for p in first.root.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(second.root) for p in second.root.rglob("*") if p.is_file())
    assert all((first.root / f).read_bytes() == (second.root / f).read_bytes() for f in files)
    stamp = first.ann_path.stat().st_mtime_ns
    assert coco_source.ensure_coco_source(tmp_path / "a", num_images=3, seed=5).root == first.root
    assert first.ann_path.stat().st_mtime_ns == stamp  # found, not regenerated
    other_seed = coco_source.ensure_coco_source(tmp_path / "a", num_images=3, seed=6)
    assert other_seed.root != first.root and other_seed.ann_path.read_bytes() != first.ann_path.read_bytes()


@pytest.mark.parametrize("config", [FAST_DDETR, FAST_MASK2FORMER], ids=["deformable-detr", "mask2former-instance"])
def test_config_pipeline_loads_the_source(tmp_path, source, config):
    """The config's own train pipeline (multi-scale resize and crop; LSJ with polygon masks) runs on the source."""
    import deform_plugin  # noqa: F401  (mmdet.datasets imports mmcv.ops: the stand-in where mmcv-lite is installed)
    from mmdet.registry import DATASETS
    from mmdet.utils import register_all_modules
    register_all_modules()
    _, cfg = merged_overlay(tmp_path, config, "stock:fp32", source)
    dataset = DATASETS.build(cfg.train_dataloader.dataset)
    assert len(dataset) == SOURCE_IMAGES
    np.random.seed(0)  # the random resize and crop draw from numpy's global generator
    samples = [dataset[i] for i in range(3)]
    assert sum(len(s["data_samples"].gt_instances) for s in samples) > 0
    for sample in samples:
        assert sample["inputs"].ndim == 3
        instances = sample["data_samples"].gt_instances
        if config == FAST_MASK2FORMER:  # polygon masks through the LSJ resize and 1024 crop
            assert len(instances.masks) == len(instances.bboxes)
            assert (instances.masks.height, instances.masks.width) == tuple(sample["inputs"].shape[1:])
            assert max(instances.masks.height, instances.masks.width) <= 1024


# ---------------------------------------------------------------------------------------------------------------------
# Overlay configs
# ---------------------------------------------------------------------------------------------------------------------

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


def test_pretrained_init_cfgs_are_dropped_wherever_they_are():
    pretrained = dict(type="Pretrained", checkpoint="torchvision://resnet50")
    kaiming = dict(type="Kaiming", layer="Conv2d")
    model = dict(type="M", init_cfg=[kaiming, pretrained], backbone=dict(depth=50, init_cfg=pretrained),
                 heads=[dict(type="H", init_cfg=pretrained), dict(type="H")], neck=dict(init_cfg=kaiming))
    assert train_overlay.pretrained_overrides(model) == dict(
        init_cfg=[kaiming], backbone=dict(init_cfg=None), heads=[dict(type="H", init_cfg=None), dict(type="H")])


def test_panoptic_and_non_coco_configs_are_refused():
    with pytest.raises(user_path.UnsupportedConfig, match="panoptic PNG"):
        user_path.check_supported(user_path.read_base_config(PANOPTIC), PANOPTIC)
    demo = REPO_ROOT / "configs" / "demo" / "deformable-detr-refine_r18_tiny_1xb4-500i_shapes.py"
    with pytest.raises(user_path.UnsupportedConfig, match="ShapesCocoDataset"):
        user_path.check_supported(user_path.read_base_config(demo), demo)


def test_row_commands_use_each_sides_script(tmp_path):
    stock = user_path.row_command(user_path.parse_row("stock:bf16"), tmp_path / "o.py", tmp_path / "w")
    assert stock[1:3] == stock_command(user_path.STOCK_TRAIN_MODULE)
    assert stock[-3:] == ["--amp", "--cfg-options", "optim_wrapper.dtype=bfloat16"]
    ours = user_path.row_command(user_path.parse_row("ours:fp16"), tmp_path / "o.py", tmp_path / "w")
    assert ours[1] == str(REPO_ROOT / "tools" / "train.py") and ours[-2:] == ["--amp-dtype", "float16"]
    assert "--amp" not in user_path.row_command(user_path.parse_row("ours:fp32"), tmp_path / "o.py", tmp_path / "w")
    with pytest.raises(Exception, match="side 'mmcv'.*mode 'tf32'"):
        user_path.parse_row("mmcv:tf32")


def test_default_windows_follow_the_iterations():
    assert user_path.Settings(iters=100).windows() == dict(first=(1, 20), first_100=(1, 100), all=(1, 100),
                                                           steady=(51, 100))
    assert user_path.Settings(iters=250, steady_start=151).windows() == dict(
        first=(1, 20), first_100=(1, 100), all=(1, 250), steady=(151, 250))
    assert user_path.Settings(iters=3, first_iters=1, steady_start=2).windows() == dict(
        first=(1, 1), first_100=(1, 3), all=(1, 3), steady=(2, 3))
    with pytest.raises(ValueError, match="first <= last"):
        user_path.Settings(iters=10, steady_start=11).windows()


# ---------------------------------------------------------------------------------------------------------------------
# The timing hook, on a fake runner
# ---------------------------------------------------------------------------------------------------------------------

class FakeClock:
    """Seconds that advance only when the test says; counts how often the hook read it."""

    def __init__(self):
        self.now, self.reads = 100.0, 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now


def run_fake_training(hook, iterations, seconds_per_iter=0.5, images_per_iter=2, tmp_path=None):
    runner = SimpleNamespace(iter=0, work_dir=str(tmp_path), model=None, optim_wrapper=None)
    hook.before_train(runner)
    for batch_idx in range(iterations):
        hook.clock.now += seconds_per_iter
        hook.after_train_iter(runner, batch_idx, data_batch=dict(inputs=[None] * images_per_iter))
    hook.after_train(runner)
    return runner


def test_timer_windows_sync_only_at_boundaries(tmp_path):
    clock = FakeClock()
    out = tmp_path / "timing.json"
    hook = IterationTimerHook(windows=[(1, 2), (1, 6), (4, 6), (5, 9)], warmup_iters=2, out_file=str(out),
                              clock=clock)
    run_fake_training(hook, iterations=6, tmp_path=tmp_path)
    assert hook.boundaries == [0, 2, 3, 4, 6, 9]
    # Window marks (each with a device sync on a GPU) before training and after iterations 2, 3, 4 and 6 (9 is
    # never reached); every iteration's end is read once more, without a sync.
    assert sorted(hook._marks) == [0, 2, 3, 4, 6]
    assert clock.reads == 5 + 6
    result = json.loads(out.read_text())
    windows = {(w["first"], w["last"]): w for w in result["windows"]}
    assert windows[(1, 2)]["images"] == 4 and windows[(1, 2)]["seconds"] == pytest.approx(1.0)
    assert windows[(1, 6)]["img_per_s"] == pytest.approx(12 / 3.0)
    assert windows[(4, 6)]["img_per_s"] == pytest.approx(6 / 1.5)
    assert windows[(4, 6)]["ms_per_iter"] == pytest.approx(500.0)
    assert windows[(5, 9)]["img_per_s"] is None and windows[(5, 9)]["seconds"] is None
    assert (result["iterations_run"], result["images_run"]) == (6, 12)


def test_timer_counts_our_compiles_and_checks_the_plugin(tmp_path):
    import deform_plugin  # noqa: F401
    hook = IterationTimerHook(windows=[(1, 2)], warmup_iters=1, out_file=str(tmp_path / "t.json"),
                              expect_plugin=True, clock=FakeClock())
    run_fake_training(hook, iterations=2, tmp_path=tmp_path)
    result = json.loads((tmp_path / "t.json").read_text())
    assert result["deform_plugin_loaded"] is True
    assert set(result["compiled_variants_end"]) >= {"msda_forward", "msda_backward"}
    assert result["compiled_after_warmup"] == result["compiled_total"] - sum(
        result["compiled_variants_after_warmup"].values())
    stock_hook = IterationTimerHook(windows=[(1, 1)], expect_plugin=False, clock=FakeClock())
    with pytest.raises(RuntimeError, match="must stay stock"):
        stock_hook.before_train(SimpleNamespace(iter=0))


def _timed_batches(tmp_path, model, sizes):
    """The timing hook's result after one batch of images of each ``sizes`` entry."""
    runner = SimpleNamespace(iter=0, work_dir=str(tmp_path), model=model, optim_wrapper=None)
    hook = IterationTimerHook(windows=[(1, 3)], warmup_iters=1, out_file=str(tmp_path / "t.json"), clock=FakeClock())
    hook.before_train(runner)
    for batch_idx, batch in enumerate(sizes):
        images = [torch.zeros(3, h, w, dtype=torch.uint8) for h, w in batch]
        hook.after_train_iter(runner, batch_idx, data_batch=dict(inputs=images))
    hook.after_train(runner)
    return json.loads((tmp_path / "t.json").read_text())


def test_timer_counts_padded_batch_shapes_and_pixels(tmp_path):
    model, wrapper = torch.nn.Module(), torch.nn.Module()  # the wrapper stands for DDP's
    model.data_preprocessor = SimpleNamespace(pad_size_divisor=32)
    wrapper.module = model
    sizes = [[(40, 60), (30, 70)], [(64, 64), (50, 50)], [(33, 65), (10, 10)]]  # padded: 64x96, 64x64, 64x96
    result = _timed_batches(tmp_path, wrapper, sizes)
    assert (result["batch_shapes"], result["batch_shapes_after_warmup"]) == (2, 1)
    image_pixels = sum(h * w for batch in sizes for h, w in batch)
    assert result["padded_over_image_pixels"] == pytest.approx(2 * (64 * 96 + 64 * 64 + 64 * 96) / image_pixels)
    assert [e["shape"] for e in result["per_iteration"]] == [[64, 96], [64, 64], [64, 96]]
    assert [e["run_shape"] for e in result["per_iteration"]] == [None] * 3


def test_timer_counts_the_pixels_of_the_shape_a_batch_ran_at(tmp_path):
    model = torch.nn.Module()
    # ShapeBucketsHook's further padding (a borrowed shape, the ranks' common one) leaves the shape it ran at here.
    model.data_preprocessor = SimpleNamespace(pad_size_divisor=32, deform_plugin_training_shape=(96, 128))
    sizes = [[(40, 60), (30, 70)]]  # its own padding: 64x96
    result = _timed_batches(tmp_path, model, sizes)
    image_pixels = sum(h * w for batch in sizes for h, w in batch)
    assert result["padded_over_image_pixels"] == pytest.approx(2 * 96 * 128 / image_pixels)
    assert [(e["shape"], e["run_shape"]) for e in result["per_iteration"]] == [([64, 96], [96, 128])]


def test_timer_counts_the_fixed_size_pad_of_lsj_configs(tmp_path):
    from mmdet.models.data_preprocessors import BatchFixedSizePad
    model = torch.nn.Module()
    model.data_preprocessor = SimpleNamespace(pad_size_divisor=32, batch_augments=[BatchFixedSizePad(size=(96, 128))])
    sizes = [[(40, 60), (30, 70)], [(96, 128), (50, 50)], [(33, 65), (10, 10)], [(100, 40), (20, 20)]]
    result = _timed_batches(tmp_path, model, sizes)
    # Every batch padded to 96x128, except the one with a taller image (128x128 after the divisor).
    assert (result["batch_shapes"], result["batch_shapes_after_warmup"]) == (2, 1)
    image_pixels = sum(h * w for batch in sizes for h, w in batch)
    assert result["padded_over_image_pixels"] == pytest.approx(2 * (3 * 96 * 128 + 128 * 128) / image_pixels)


def test_timer_reports_the_graph_captures_of_graphed_training(tmp_path):
    region = SimpleNamespace(captured={"a": 1, "b": 2}, capture_seconds=1.5, eager_calls=3, replays=7,
                             eager_reasons={"c": "too many"}, first_call_captures=1,
                             first_call_capture_failures={"d": "cudnn.benchmark"},
                             capture_phase_seconds=dict(forward=0.5, backward=0.75, instantiate=0.25))
    other = SimpleNamespace(captured={"e": 3}, capture_seconds=0.5, eager_calls=0, replays=1, eager_reasons={},
                            first_call_captures=0, first_call_capture_failures={},
                            capture_phase_seconds=dict(forward=0.25, backward=0.25, instantiate=0.125))
    detector, second = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    detector.graphed_training_region, second.graphed_training_region = region, other
    model = torch.nn.Sequential(detector, second)
    result = _timed_batches(tmp_path, model, [[(32, 32)]])
    assert result["graphed_training"] == dict(
        captures=3, capture_seconds=2.0, capture_phase_seconds=dict(forward=0.75, backward=1.0, instantiate=0.375),
        eager_calls=3, replays=8, fallbacks=1, first_call_captures=1, first_call_capture_failures=1)
    assert _timed_batches(tmp_path, torch.nn.Linear(2, 2), [[(32, 32)]])["graphed_training"] is None


def test_timer_counts_a_split_detectors_shapes_once_and_all_of_its_capture_time(tmp_path):
    def region(captured, seconds, reports):
        return SimpleNamespace(captured=captured, capture_seconds=seconds, eager_calls=1, replays=4, eager_reasons={},
                               first_call_captures=1, first_call_capture_failures={}, reports_signatures=reports,
                               capture_phase_seconds=dict(forward=seconds / 2, backward=seconds / 2, instantiate=0.0))
    # The backbone's region captures the same two shapes as the transformer's, in 0.5 of the 2 seconds.
    backbone, rest = region({"a": 1, "b": 2}, 0.5, False), region({"a": 1, "b": 2}, 1.5, True)
    detector = torch.nn.Linear(2, 2)
    detector.graphed_training_region, detector.graphed_training_regions = rest, (backbone, rest)
    result = _timed_batches(tmp_path, torch.nn.Sequential(detector), [[(32, 32)]])
    assert result["graphed_training"] == dict(
        captures=2, capture_seconds=2.0, capture_phase_seconds=dict(forward=1.0, backward=1.0, instantiate=0.0),
        eager_calls=1, replays=4, fallbacks=0, first_call_captures=1, first_call_capture_failures=0)


def test_timer_splits_the_run_by_what_graphed_training_did(tmp_path):
    from deform_plugin.benchmarks.detector.train_report import iteration_split, replay_median_ms, split_table
    region = SimpleNamespace(captured={}, capture_seconds=0.0, eager_calls=0, replays=0, eager_reasons={},
                             first_call_captures=0, first_call_capture_failures={}, capture_phase_seconds={})
    detector = torch.nn.Linear(2, 2)
    detector.graphed_training_region = region
    clock = FakeClock()
    hook = IterationTimerHook(windows=[(1, 5)], warmup_iters=1, out_file=str(tmp_path / "t.json"), clock=clock)
    runner = SimpleNamespace(iter=0, work_dir=str(tmp_path), model=torch.nn.Sequential(detector), optim_wrapper=None)
    hook.before_train(runner)
    # iteration: (seconds, what the region did): eager warm-up, eager warm-up of another shape, capture, replays.
    steps = [(2.0, "eager"), (0.5, "eager"), (0.75, "capture"), (0.25, "replay"), (0.125, "replay")]
    for batch_idx, (seconds, kind) in enumerate(steps):
        clock.now += seconds
        if kind == "eager":
            region.eager_calls += 1
        elif kind == "capture":
            region.captured[batch_idx] = object()
            region.replays += 1  # a capture's iteration replays too: it counts as the capture
        else:
            region.replays += 1
        hook.after_train_iter(runner, batch_idx, data_batch=dict(inputs=[None, None]))
    hook.after_train(runner)
    result = json.loads((tmp_path / "t.json").read_text())
    assert [(e["iteration"], e["kind"]) for e in result["per_iteration"]] == [
        (1, "eager"), (2, "eager"), (3, "capture"), (4, "replay"), (5, "replay")]
    assert [e["seconds"] for e in result["per_iteration"]] == pytest.approx([s for s, _ in steps])
    split = iteration_split(result["per_iteration"], (1, 5))
    assert split == dict(first=dict(iterations=1, seconds=2.0), eager=dict(iterations=1, seconds=0.5),
                         capture=dict(iterations=1, seconds=0.75), replay=dict(iterations=2, seconds=0.375))
    assert iteration_split(result["per_iteration"], (4, 5)) == dict(replay=dict(iterations=2, seconds=0.375))
    assert replay_median_ms(result["per_iteration"], (1, 5)) == pytest.approx(187.5)  # (250 + 125) / 2
    assert replay_median_ms(result["per_iteration"], (2, 4)) == pytest.approx(250.0)
    assert replay_median_ms(result["per_iteration"], (1, 3)) is None  # no replay there
    table = split_table([dict(config="c.py", row="ours:bf16", split=split, steady_replay_median_ms=187.5)], (1, 5),
                        (4, 5))
    assert table[-3].endswith("| replay | other | replay median, it 4-5 |")
    assert table[-1] == ("| c.py | ours:bf16 | 1, 2.00 s, 2000 | 1, 0.50 s, 500 | 1, 0.75 s, 750 | 2, 0.38 s, 188 "
                         "| - | 187.5 ms |")
    # Stock training (no graphed region): every iteration after the first is "other".
    stock = IterationTimerHook(windows=[(1, 3)], out_file=str(tmp_path / "s.json"), clock=FakeClock())
    run_fake_training(stock, iterations=3, tmp_path=tmp_path)
    stock_split = iteration_split(json.loads((tmp_path / "s.json").read_text())["per_iteration"], (1, 3))
    assert stock_split == dict(first=dict(iterations=1, seconds=0.5), other=dict(iterations=2, seconds=1.0))


def test_timer_rejects_bad_windows():
    with pytest.raises(ValueError, match=r"window \(3, 2\)"):
        IterationTimerHook(windows=[(3, 2)])


# ---------------------------------------------------------------------------------------------------------------------
# End to end: both rows of a tiny config, each through its own training script, on the CPU
# ---------------------------------------------------------------------------------------------------------------------

def test_tiny_benchmark_runs_stock_and_our_rows(tmp_path, source, monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the child processes: one thread each on a small shared CPU
    out_dir = tmp_path / "out"
    status = user_path.main([
        str(TINY_COCO_CONFIG), "--rows", "stock:fp32", "ours:fp32", "--iters", "3", "--first-iters", "1",
        "--batch-size", "2", "--workers", "1", "--images", str(SOURCE_IMAGES),
        "--data-cache", str(source.root.parent), "--out-dir", str(out_dir), "--timeout", "300"])
    report = json.loads((out_dir / "train_benchmark.json").read_text())
    assert status == 0, [r["error"] for r in report["results"]]
    stock, ours = report["results"]
    for result in (stock, ours):
        assert result["status"] == "ok"
        # first, first_100 (the whole of a 3-iteration run), all, steady
        assert [w["img_per_s"] > 0 for w in result["timing"]["windows"]] == [True, True, True, True]
        assert result["timing"]["iterations_run"] == 3 and result["timing"]["images_run"] == 6
    assert stock["timing"]["deform_plugin_loaded"] is False
    assert list(stock["timing"]["msda_modules"]) == ["mmcv.ops.multi_scale_deform_attn.MultiScaleDeformableAttention"]
    assert ours["timing"]["deform_plugin_loaded"] is True
    assert list(ours["timing"]["msda_modules"]) == ["deform_plugin.models.msda.MultiScaleDeformableAttention"]
    rows = report["rows"]
    assert rows[0]["speedup"] == pytest.approx(1.0) and rows[1]["speedup"] > 0
    markdown = (out_dir / "train_benchmark.md").read_text()
    assert "| stock:fp32 | ok |" in markdown and "| ours:fp32 | ok |" in markdown
    assert "| img/s it 1-3 |" in markdown and "| 1-3 / steady |" in markdown  # a run shorter than 100 iterations
    assert "| stock:fp32 | ok |" in capsys.readouterr().out  # the table is printed too
    with open(out_dir / "train_benchmark.csv") as handle:
        assert [r["row"] for r in csv.DictReader(handle)] == ["stock:fp32", "ours:fp32"]


def test_multi_gpu_rows_run_each_script_under_torch_distributed(tmp_path):
    ours = user_path.row_command(user_path.parse_row("ours:bf16"), tmp_path / "o.py", tmp_path / "w", gpus=2)
    assert ours[1:4] == ["-m", "torch.distributed.run", "--nproc_per_node=2"]
    assert ours[-2:] == ["--launcher", "pytorch"] and "--amp-dtype" in ours
    stock = user_path.row_command(user_path.parse_row("stock:fp32"), tmp_path / "o.py", tmp_path / "w", gpus=2)
    assert stock[5:7] == stock_command(user_path.STOCK_TRAIN_MODULE) and stock[-2:] == ["--launcher", "pytorch"]
    bound = user_path.row_command(user_path.parse_row("ours:bf16"), tmp_path / "o.py", tmp_path / "w", gpus=2,
                                  numa_binding="node")
    assert bound[:6] == ours[:5] + ["--numa-binding=node"] and bound[6:] == ours[5:]
    single = user_path.row_command(user_path.parse_row("ours:bf16"), tmp_path / "o.py", tmp_path / "w",
                                   numa_binding="node")
    assert not any("numa" in part for part in single)  # one process: nothing to bind


def test_the_csv_appends_rows_and_sets_a_file_of_other_columns_aside(tmp_path):
    from deform_plugin.benchmarks.detector import train_report
    windows = dict(first=(1, 1), all=(1, 3), steady=(2, 3))
    row = train_report.row_metrics(dict(config="c.py", row="ours:fp32", status="ok"), windows)
    row.update(steady_img_s=1.5, batch_shapes=4)
    machine = dict(device="cpu", cuda=None, torch="torch ?", triton="triton ?", mmcv="mmcv ?", mmengine="mmengine ?",
                   mmdet="mmdet ?", python="3", commit="abc")
    report = dict(timestamp="2026-11-26T12:00:00", machine=machine, rows=[row], results=[],
                  settings=dict(iters=3, batch_size=2, workers=1, windows={k: list(v) for k, v in windows.items()}),
                  source=dict(images=4, seed=0))
    (tmp_path / "train_benchmark.csv").write_text("timestamp,row,img_s\n2026-01-01,stock:fp32,1.0\n")
    train_report.write_reports(report, tmp_path)
    train_report.write_reports(report, tmp_path)
    with open(tmp_path / "train_benchmark.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["row"], r["steady_img_s"], r["batch_shapes"]) for r in rows] == [("ours:fp32", "1.5", "4")] * 2
    older = list(tmp_path.glob("train_benchmark.*.older-columns.csv"))
    assert len(older) == 1 and "stock:fp32,1.0" in older[0].read_text()


def test_the_table_shows_reserved_memory_and_signatures_that_ran_eagerly():
    from deform_plugin.benchmarks.detector import train_report
    windows = dict(first=(1, 1), all=(1, 3), steady=(2, 3))
    timing = dict(windows=[dict(first=2, last=3, img_per_s=4.0, ms_per_iter=500.0)], peak_allocated_mib=9681.4,
                  peak_reserved_mib=61234.0, graphed_training=dict(captures=9, capture_seconds=1.62, eager_calls=30,
                                                                   replays=40, fallbacks=7))
    row = train_report.row_metrics(dict(config="c.py", row="ours:fp32", status="ok", timing=timing), windows)
    assert (row["peak_reserved_mib"], row["graph_captures"], row["graph_fallbacks"]) == (61234.0, 9, 7)
    machine = dict(device="cpu", cuda=None, torch="torch ?", triton="triton ?", mmcv="mmcv ?", mmengine="mmengine ?",
                   mmdet="mmdet ?", python="3", commit="abc")
    report = dict(machine=machine, rows=[row], results=[],
                  settings=dict(iters=3, batch_size=2, workers=1, windows={k: list(v) for k, v in windows.items()}),
                  source=dict(images=4, seed=0))
    table_row = train_report.markdown(report).splitlines()[-1]
    assert "| 9 (1.6 s; 7 eager) |" in table_row and "| 9681 (61234) |" in table_row
    row.update(graph_fallbacks=0)
    assert "| 9 (1.6 s) |" in train_report.markdown(report).splitlines()[-1]
    timing["graphed_training"]["capture_phase_seconds"] = dict(forward=0.7, backward=0.8, instantiate=0.2)
    row = train_report.row_metrics(dict(config="c.py", row="ours:fp32", status="ok", timing=timing), windows)
    report["rows"] = [row]
    assert ("| 9 (1.6 s: forward 0.7, backward 0.8, of which instantiation 0.2; 7 eager) |"
            in train_report.markdown(report).splitlines()[-1])


# ---------------------------------------------------------------------------------------------------------------------
# The steady-state step profile
# ---------------------------------------------------------------------------------------------------------------------

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


@pytest.mark.parametrize("text", ["151", "a:3", "0:3", "151:0", "1:2:3"])
def test_a_bad_profile_window_is_refused_with_its_text(text):
    import argparse
    with pytest.raises(argparse.ArgumentTypeError, match=text):
        user_path.parse_profile_window(text)


def test_the_step_profiler_profiles_only_its_iterations(tmp_path):
    import gzip

    from deform_plugin.benchmarks.detector.step_profiler import StepProfilerHook
    with pytest.raises(ValueError, match="first=0"):
        StepProfilerHook(first=0)
    hook = StepProfilerHook(first=3, steps=2, out_dir=str(tmp_path / "p"))
    runner = SimpleNamespace(iter=0, work_dir=str(tmp_path))
    x = torch.randn(32, 32)
    for index in range(6):
        runner.iter = index
        hook.before_train_iter(runner, index)
        # Each iteration its own op: the tables must hold exactly those of iterations 3 and 4.
        (torch.mm, torch.add, torch.sub, torch.mul, torch.div, torch.maximum)[index](x, x)
        hook.after_train_iter(runner, index)
    text = (tmp_path / "p" / "profile_rank0.txt").read_text()
    assert text.startswith("rank 0: iterations 3-4,")
    assert "aten::sub" in text and "aten::mul" in text
    assert not any(op in text for op in ("aten::mm", "aten::add", "aten::div", "aten::maximum"))
    trace = json.loads(gzip.open(tmp_path / "p" / "trace_rank0.json.gz").read())
    assert any(event.get("name") == "aten::sub" for event in trace["traceEvents"])


def test_the_ramp_up_column_is_the_first_100_iterations_of_a_longer_run():
    from deform_plugin.benchmarks.detector import train_report
    windows = dict(first=(1, 20), first_100=(1, 100), all=(1, 250), steady=(151, 250))
    timing = dict(windows=[dict(first=1, last=100, img_per_s=15.0, ms_per_iter=133.3),
                           dict(first=1, last=250, img_per_s=24.0, ms_per_iter=83.3),
                           dict(first=151, last=250, img_per_s=37.5, ms_per_iter=53.3)])
    row = train_report.row_metrics(dict(config="c.py", row="ours:bf16", status="ok", timing=timing), windows)
    assert row["first_100_over_steady"] == pytest.approx(0.4) and row["all_over_steady"] == pytest.approx(0.64)
    machine = dict(device="cpu", cuda=None, torch="torch ?", triton="triton ?", mmcv="mmcv ?", mmengine="mmengine ?",
                   mmdet="mmdet ?", python="3", commit="abc")
    report = dict(machine=machine, rows=[row], results=[],
                  settings=dict(iters=250, batch_size=2, workers=1, windows={k: list(v) for k, v in windows.items()}),
                  source=dict(images=4, seed=0))
    lines = train_report.markdown(report).splitlines()
    header = next(line for line in lines if line.startswith("| config |"))
    assert "| img/s it 1-100 |" in header and "| 1-100 / steady |" in header
    assert "| 37.50 | 53.3 | 15.00 | - | 0.40 |" in next(line for line in lines if "| ours:bf16 |" in line)
