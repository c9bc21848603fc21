"""deform_plugin.benchmarks.detector.configs: the synthetic image size a config runs at, and the sizes its model
refuses."""
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from deform_plugin.benchmarks.detector.configs import (FALLBACK_SHAPE, default_shape, fixed_size, read_config,
                                                       shape_problems)

ROOT = Path(__file__).resolve().parents[3]
MASK2FORMER = ROOT / "configs" / "mask2former" / "mask2former_r50_8xb2-lsj-50e_coco_deform-plugin.py"


def _mmdet_config(relative: str) -> Path:
    import mmdet
    return Path(mmdet.__file__).parent / ".mim" / "configs" / relative


STOCK_MASK2FORMER = _mmdet_config("mask2former/mask2former_r50_8xb2-lsj-50e_coco.py")


@pytest.mark.parametrize("transform, size", [
    pytest.param(dict(type="Resize", scale=(1333, 800), keep_ratio=True), (800, 1333), id="resize-keep-ratio"),
    pytest.param(dict(type="Resize", scale=(800, 1333), keep_ratio=True), (800, 1333), id="resize-keep-ratio-hw"),
    pytest.param(dict(type="Resize", scale=(640, 480), keep_ratio=False), (480, 640), id="resize-exact"),
    pytest.param(dict(type="mmdet.Resize", scale=512, keep_ratio=True), (512, 512), id="resize-int-scoped"),
    pytest.param(dict(type="Resize", img_scale=(1024, 1024), keep_ratio=True), (1024, 1024), id="resize-img-scale"),
    pytest.param(dict(type="Resize", scale=(1024, 1024), ratio_range=(0.1, 2.0)), None, id="resize-jitter"),
    pytest.param(dict(type="RandomResize", scale=(1024, 1024), ratio_range=(0.1, 2.0)), None, id="random-resize"),
    pytest.param(dict(type="RandomChoiceResize", scales=[(480, 1333), (512, 1333)]), None, id="choice-resize"),
    pytest.param(dict(type="RandomCrop", crop_size=(600, 400)), (400, 600), id="crop-absolute"),
    pytest.param(dict(type="RandomCrop", crop_size=(384, 600), crop_type="absolute_range"), None, id="crop-range"),
    pytest.param(dict(type="FixedShapeResize", width=640, height=480), (480, 640), id="fixed-shape-resize"),
    pytest.param(dict(type="RandomFlip", prob=0.5), None, id="flip"),
])
def test_fixed_size_of_a_transform(transform, size):
    assert fixed_size(transform) == size


def test_mask2former_default_is_its_lsj_crop():
    assert default_shape(read_config(str(MASK2FORMER))) == ((1024, 1024), "train pipeline: RandomCrop")


@pytest.mark.skipif(not STOCK_MASK2FORMER.exists(), reason="mmdet's configs (.mim) are not installed")
def test_stock_mask2former_default_is_its_lsj_crop():
    assert default_shape(read_config(str(STOCK_MASK2FORMER)))[0] == (1024, 1024)


def test_demo_config_default_is_its_own_size():
    cfg = read_config(str(ROOT / "configs" / "demo" / "deformable-detr-refine_r18_tiny_1xb4-500i_shapes.py"))
    assert default_shape(cfg) == ((cfg.image_size, cfg.image_size), "test pipeline: Resize")


def test_deformable_detr_default_is_its_test_scale():
    """Its training pipeline picks among scales at random: the test pipeline's Resize decides."""
    cfg = read_config(str(ROOT / "configs" / "deformable_detr" / "deformable-detr_r50_16xb2-50e_coco_deform-plugin.py"))
    assert default_shape(cfg) == ((800, 1333), "test pipeline: Resize")


def test_fallback_without_a_fixed_size(tmp_path):
    path = tmp_path / "no_pipeline.py"
    path.write_text("model = dict(type='DETR')\ntrain_pipeline = [dict(type='RandomFlip', prob=0.5)]\n")
    shape, source = default_shape(read_config(str(path)))
    assert shape == FALLBACK_SHAPE == (800, 1333)
    assert "fix no size" in source


def test_cfg_options_reach_the_default(tmp_path):
    cfg = read_config(str(MASK2FORMER), {"train_dataloader.dataset.pipeline.4.crop_size": (640, 512)})
    assert default_shape(cfg)[0] == (512, 640)


@pytest.mark.parametrize("shape, refused", [
    pytest.param((800, 1333), True, id="800x1333-wider-and-shorter"),
    pytest.param((1024, 1024), False, id="1024x1024-the-crop"),
    pytest.param((512, 768), False, id="512x768-within"),
    pytest.param((1100, 1400), False, id="1100x1400-beyond"),
    pytest.param((1000, 1100), False, id="1000x1100-pads-to-1024-tall"),
    pytest.param((1100, 900), True, id="1100x900-taller-and-narrower"),
])
def test_shape_problems_agree_with_mmdet_data_preprocessor(shape, refused):
    """What shape_problems refuses is exactly what mmdet's preprocessor fails on (Mask2Former, with masks)."""
    import deform_plugin  # noqa: F401  (mmdet imports with mmcv-lite)
    from mmdet.registry import MODELS
    from mmdet.utils import register_all_modules

    from deform_plugin.benchmarks.detector.synthetic import make_batch

    register_all_modules()
    cfg = read_config(str(MASK2FORMER))
    problems = shape_problems(cfg, shape)
    assert bool(problems) == refused
    preprocessor = MODELS.build(cfg.model.data_preprocessor)
    model = SimpleNamespace(panoptic_head=SimpleNamespace(num_things_classes=80, num_stuff_classes=0))
    batch = make_batch(model, 1, *shape, num_gts=2, seed=0)
    if refused:
        assert "BatchFixedSizePad" in problems[0]
        with pytest.raises(ValueError, match="cannot reshape array"):
            preprocessor(batch, True)
    else:
        assert preprocessor(batch, True)["inputs"].shape[-2:] == (max(1024, -(-shape[0] // 32) * 32),
                                                                  max(1024, -(-shape[1] // 32) * 32))


def test_shape_problems_without_fixed_padding():
    cfg = read_config(str(ROOT / "configs" / "dino" / "dino-4scale_r50_8xb2-12e_coco_deform-plugin.py"))
    assert shape_problems(cfg, (800, 1333)) == [] and shape_problems(cfg, (37, 2001)) == []
    assert shape_problems(cfg, (0, 10)) == ["0x10 is not an image size"]


@pytest.mark.parametrize("fast, expected", [
    ("config", 128),  # the fast config's ShapeBucketsHook
    ("none", None),
    ("all", None),  # every exact fast path: the padding is not one
    ("sdpa+buckets", 128),
    ("sdpa", None),
])
def test_rows_take_the_training_buckets_from_the_config_or_their_fast_choice(fast, expected):
    from deform_plugin.benchmarks.detector.configs import RowSpeedups, load_config, resolve_fast_paths
    from deform_plugin.benchmarks.detector.rows import parse_row
    cfg = load_config(str(ROOT / "configs" / "fast" / "dino-4scale_r50_8xb2-12e_coco_deform-plugin-fast.py"), None,
                      plugin=True)
    speedups = resolve_fast_paths(cfg, parse_row(f"pytorch:fp32:{fast}"))
    assert speedups.bucket_divisor == expected
    assert resolve_fast_paths(cfg, parse_row("stock:fp32")) == RowSpeedups()


def test_rows_name_the_fast_paths_by_their_switches():
    from deform_plugin.benchmarks.detector.configs import load_config, resolve_fast_paths
    from deform_plugin.benchmarks.detector.rows import parse_row
    from deform_plugin.integration.mmdet_fast_paths import FastPaths
    cfg = load_config(str(ROOT / "configs" / "fast" / "dino-4scale_r50_8xb2-12e_coco_deform-plugin-fast.py"), None,
                      plugin=True)
    every = resolve_fast_paths(cfg, parse_row("triton:fp32:all"))
    assert every.fast_paths.with_implications() == FastPaths.all_exact() and every.graph_inference
    assert resolve_fast_paths(cfg, parse_row("triton:fp32:none")).fast_paths == FastPaths()
    as_configured = resolve_fast_paths(cfg, parse_row("triton:fp32:config")).fast_paths
    # The fast DINO config selects them all but DDQ-DETR's float32_nms (DINO has no NMS).
    assert as_configured.with_implications() == dataclasses.replace(FastPaths.all_exact(), float32_nms=False)
    assert resolve_fast_paths(cfg, parse_row("triton:fp32:sdpa+graph")).fast_paths.selected() == (
        "sdpa_attention", "cuda_graphs")


def test_variable_sizes_follow_the_detr_random_resize():
    from deform_plugin.benchmarks.detector.synthetic import LONG_SIDE_MAX, SHORT_SIDES, random_resize_sizes
    sizes = random_resize_sizes(200, seed=0)
    assert sizes == random_resize_sizes(200, seed=0) and len(set(sizes)) > 20
    for height, width in sizes:
        assert max(height, width) <= LONG_SIDE_MAX + 1
        assert min(height, width) in SHORT_SIDES or max(height, width) >= LONG_SIDE_MAX - 1


def test_variable_size_timing_runs_every_batch_twice_and_counts_padded_shapes():
    import torch

    from deform_plugin.benchmarks.detector.timing import time_variable_sizes

    class Model:
        data_preprocessor = SimpleNamespace(pad_size_divisor=128)

        def __init__(self):
            self.steps = []

        def train(self):
            pass

        def train_step(self, batch, optim_wrapper):
            self.steps.append(tuple(batch["inputs"][0].shape))

    sizes = [[(500, 700), (480, 640)], [(600, 900), (400, 500)], [(510, 760), (500, 700)]]
    batches = [{"inputs": [torch.zeros(3, h, w, dtype=torch.uint8) for h, w in batch]} for batch in sizes]
    model = Model()
    result = time_variable_sizes(model, None, batches, torch.device("cpu"), False, "test")
    assert model.steps == [(3, 500, 700), (3, 600, 900), (3, 510, 760)] * 2
    assert result["distinct_batch_shapes"] == 2  # 512x768 (twice) and 640x1024 at a divisor of 128
    for name in ("new_sizes", "seen_sizes"):
        assert result[name]["n"] == 3 and result[name]["img_per_s"] > 0
    assert result["new_size_cost_ms"] == pytest.approx(
        (result["new_sizes"]["total_s"] - result["seen_sizes"]["total_s"]) * 1e3 / 3)


def test_runner_logging_defers_the_gradient_norm_as_the_fast_configs_runner_does():
    import torch
    from mmengine.config import Config

    from deform_plugin.benchmarks.detector.configs import runner_logging
    from deform_plugin.benchmarks.detector.rows import Row
    from deform_plugin.engine.sync_free import DEFERRED_SCALARS
    fast = Config(dict(default_hooks=dict(runtime_info=dict(type="DeferredRuntimeInfoHook"))))
    plain = Config(dict(default_hooks=dict(runtime_info=dict(type="RuntimeInfoHook"))))
    with runner_logging(fast, Row("triton", "bf16")) as deferred:
        assert deferred and DEFERRED_SCALARS.active
        DEFERRED_SCALARS.defer("grad_norm", torch.tensor(2.0))
    assert not DEFERRED_SCALARS.active and not DEFERRED_SCALARS._pending  # nothing kept after the row
    for cfg, row in ((fast, Row("stock", "fp32")), (plain, Row("triton", "bf16")), (Config(), Row("triton", "fp32"))):
        with runner_logging(cfg, row) as deferred:
            assert not deferred and not DEFERRED_SCALARS.active
