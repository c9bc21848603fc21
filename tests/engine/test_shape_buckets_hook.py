"""ShapeBucketsHook pads training batches to its divisor and leaves evaluation at the config's own padding."""
import os
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import deform_plugin  # noqa: F401  (mmcv stand-in where mmcv-lite is installed)
from deform_plugin.engine import ShapeBucketsHook, training_size_divisor_from_config

# One pytest-xdist worker runs this whole module, so that its module-scoped fixture (processes) runs once.
pytestmark = pytest.mark.xdist_group("shape_buckets_hook")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _detector_with_preprocessor(pad_size_divisor: int) -> nn.Module:
    from mmdet.models.data_preprocessors import DetDataPreprocessor
    model = nn.Module()
    model.data_preprocessor = DetDataPreprocessor(mean=[0.0, 0.0, 0.0], std=[1.0, 1.0, 1.0],
                                                  pad_size_divisor=pad_size_divisor)
    return model


def _preprocessed_shape(model, training: bool):
    from mmdet.structures import DetDataSample
    images = [torch.zeros(3, 100, 150, dtype=torch.uint8), torch.zeros(3, 90, 161, dtype=torch.uint8)]
    samples = [DetDataSample(metainfo=dict(img_shape=tuple(i.shape[1:]))) for i in images]
    out = model.data_preprocessor(dict(inputs=images, data_samples=samples), training=training)
    assert all(s.batch_input_shape == tuple(out["inputs"].shape[-2:]) for s in out["data_samples"])
    return tuple(out["inputs"].shape[-2:])


def test_training_batches_pad_to_the_divisor_and_evaluation_keeps_its_own():
    model = _detector_with_preprocessor(pad_size_divisor=1)
    runner = SimpleNamespace(model=model)
    hook = ShapeBucketsHook(size_divisor=128)
    assert _preprocessed_shape(model, training=True) == (100, 161)  # mmdet's own: the largest image
    hook.before_train(runner)
    assert _preprocessed_shape(model, training=True) == (128, 256)
    hook.before_val_epoch(runner)
    assert _preprocessed_shape(model, training=False) == (100, 161)
    hook.after_val_epoch(runner)
    assert _preprocessed_shape(model, training=True) == (128, 256)
    hook.before_test_epoch(runner)
    assert model.data_preprocessor.pad_size_divisor == 1
    hook.after_train(runner)
    assert model.data_preprocessor.pad_size_divisor == 1


def test_the_config_divisor_is_kept_as_a_factor_and_ddp_models_are_unwrapped():
    model = _detector_with_preprocessor(pad_size_divisor=32)
    hook = ShapeBucketsHook(size_divisor=48)
    hook.before_train(SimpleNamespace(model=SimpleNamespace(module=model)))
    assert model.data_preprocessor.pad_size_divisor == 96  # lcm(32, 48)
    assert _preprocessed_shape(model, training=True) == (192, 192)


@pytest.mark.parametrize("bad", [0, -128, 1.5, True, "128"])
def test_bad_divisors_are_refused_by_value(bad):
    with pytest.raises(ValueError, match=f"size_divisor must be an int >= 1, got {bad!r}"):
        ShapeBucketsHook(size_divisor=bad)


def test_a_model_without_a_padding_preprocessor_is_refused():
    with pytest.raises(TypeError, match="pad_size_divisor.*this model has Module"):
        ShapeBucketsHook().before_train(SimpleNamespace(model=SimpleNamespace(data_preprocessor=nn.Module())))


@pytest.mark.parametrize("name, divisor", [
    ("deformable-detr-refine-twostage_r50_16xb2-50e_coco_deform-plugin-fast.py", 128),
    ("dino-4scale_r50_8xb2-12e_coco_deform-plugin-fast.py", 128),
    ("mask2former_r50_8xb2-lsj-50e_coco_deform-plugin-fast.py", None),  # LSJ: one fixed 1024x1024 shape already
])
def test_fast_configs_bucket_the_random_resize_pipelines(name, divisor):
    from mmengine.config import Config
    cfg = Config.fromfile(os.path.join(REPO_ROOT, "configs", "fast", name), import_custom_modules=False)
    assert training_size_divisor_from_config(cfg) == divisor
    if divisor is not None:  # the random-resize DETRs: a new shape's first batches borrow one that ran before
        hook = next(h for h in cfg.custom_hooks if h["type"] == "ShapeBucketsHook")
        built = ShapeBucketsHook(**{k: v for k, v in hook.items() if k != "type"})
        assert (built.borrowing.until_seen, built.borrowing.max_pixels) == (5, 1.5)


# ---- every rank pads to one shape under distributed training ------------------------------------------------------

_RANK_IMAGE_SIZES = {0: [(100, 150), (90, 161)], 1: [(200, 120), (130, 140)]}


def _one_shape_worker(rank, out_dir):
    from mmdet.structures import DetDataSample

    from deform_plugin.engine.shape_buckets_hook import ShapeBucketsHook as Hook

    def batch():
        generator = torch.Generator().manual_seed(rank)
        images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=generator)
                  for h, w in _RANK_IMAGE_SIZES[rank]]
        samples = [DetDataSample(metainfo=dict(img_shape=tuple(i.shape[1:]))) for i in images]
        return dict(inputs=images, data_samples=samples)

    model = _detector_with_preprocessor(pad_size_divisor=1)
    model.data_preprocessor.mean.fill_(100.0)  # padding is added after normalisation: pad_value, not -mean/std
    own = model.data_preprocessor(batch(), training=True)
    hook = Hook(size_divisor=32)
    hook.before_train(SimpleNamespace(model=model))
    hook.before_train(SimpleNamespace(model=model))  # a second train() wraps nothing twice
    if rank == 0:  # ranks may run different numbers of evaluation batches: no collective there
        evaluation = model.data_preprocessor(batch(), training=False)
    else:
        evaluation = None
    shared = model.data_preprocessor(batch(), training=True)
    reference = _detector_with_preprocessor(pad_size_divisor=32)
    reference.data_preprocessor.mean.fill_(100.0)
    bucketed = reference.data_preprocessor(batch(), training=True)
    torch.save(dict(own=own["inputs"], shared=shared["inputs"], bucketed=bucketed["inputs"],
                    batch_input_shapes=[s.batch_input_shape for s in shared["data_samples"]],
                    evaluation=None if evaluation is None else tuple(evaluation["inputs"].shape[-2:])),
               os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    """{worker name: its folder}: the two-rank workers of this file, run in one pair of gloo ranks (spawning a pair
    costs seconds)."""
    from gloo_ranks import run_gloo_workers
    return run_gloo_workers((_one_shape_worker, _borrow_worker), tmp_path_factory.mktemp("gloo"))


def test_every_rank_pads_its_training_batch_to_the_largest_padded_shape_of_all_ranks(gloo_results):
    results = [torch.load(gloo_results["_one_shape_worker"] / f"rank{rank}.pt") for rank in range(2)]
    # Rank 0 pads to (128, 192) on its own, rank 1 to (224, 160): both get (224, 192).
    assert [tuple(r["bucketed"].shape[-2:]) for r in results] == [(128, 192), (224, 160)]
    for rank, result in enumerate(results):
        shared, bucketed = result["shared"], result["bucketed"]
        assert tuple(shared.shape[-2:]) == (224, 192), rank
        assert result["batch_input_shapes"] == [(224, 192)] * 2, rank
        height, width = bucketed.shape[-2:]
        torch.testing.assert_close(shared[..., :height, :width], bucketed, rtol=0, atol=0)
        outside = torch.ones(shared.shape[-2:], dtype=torch.bool)
        outside[:height, :width] = False
        assert bool((shared[..., outside] == 0).all()), rank  # the preprocessor's pad_value
        assert bool((bucketed != 0).any()), rank  # the comparison above sees normalised pixels, not zeros
    assert results[0]["evaluation"] == (128, 192)  # rank 0's own padding: no agreement outside training


# Each rank's own padded shapes differ: rank 0 (128, 160) then (64, 128); rank 1 (64, 64) then (96, 96).
_RANK_BORROW_SIZES = {0: [(100, 150)] + [(60, 100)] * 3, 1: [(50, 60)] + [(90, 90)] * 3}


def _borrow_worker(rank, out_dir):
    from mmdet.structures import DetDataSample

    model = _detector_with_preprocessor(pad_size_divisor=1)
    hook = ShapeBucketsHook(size_divisor=32, borrow_until_seen=3, borrow_max_pixels=2.0)
    hook.before_train(SimpleNamespace(model=model))
    shapes = []
    for height, width in _RANK_BORROW_SIZES[rank]:
        images = [torch.ones(3, height, width, dtype=torch.uint8)]
        samples = [DetDataSample(metainfo=dict(img_shape=(height, width)))]
        out = model.data_preprocessor(dict(inputs=images, data_samples=samples), training=True)
        shapes.append(tuple(out["inputs"].shape[-2:]))
    torch.save(shapes, os.path.join(out_dir, f"rank{rank}.pt"))


def test_ranks_agree_on_a_shape_before_borrowing_so_they_borrow_alike(gloo_results):
    shapes = [torch.load(gloo_results["_borrow_worker"] / f"rank{rank}.pt") for rank in range(2)]
    # The ranks' common shapes: (128, 160), then (96, 128) three times. (96, 128) is new: its first two batches
    # borrow (128, 160) (1.67x its pixels), its third runs as itself; both ranks alike.
    assert shapes[0] == shapes[1] == [(128, 160), (128, 160), (128, 160), (96, 128)]


def test_a_single_process_leaves_the_preprocessor_unwrapped():
    model = _detector_with_preprocessor(pad_size_divisor=1)
    ShapeBucketsHook(size_divisor=128).before_train(SimpleNamespace(model=model))
    assert "forward" not in vars(model.data_preprocessor)


def test_new_shapes_borrow_the_smallest_covering_shape_that_ran_until_seen_enough():
    from deform_plugin.engine.shape_buckets_hook import ShapeBorrowing
    borrowing = ShapeBorrowing(until_seen=3, max_pixels=1.5)
    sequence = [((768, 1024), (768, 1024)),  # nothing ran yet: runs as itself
                ((768, 768), (768, 1024)),  # 1.33x its pixels: borrows
                ((640, 640), (640, 640)),  # (768, 1024) is 1.92x: runs as itself
                ((512, 640), (640, 640)),  # the smaller of the two that cover it within 1.5x... (640, 640): 1.25x
                ((768, 768), (768, 1024)),  # seen twice: still borrows
                ((768, 768), (768, 768)),  # the third time: runs as itself
                ((768, 768), (768, 768)),  # and keeps doing so
                ((640, 768), (768, 768)),  # now the smallest covering shape
                ((896, 640), (896, 640))]  # nothing covers it (wider than none, taller than all)
    got = [borrowing.choose(shape) for shape, _ in sequence]
    assert got == [expected for _, expected in sequence]
    assert (borrowing.batches, borrowing.borrowed) == (9, 4)
    assert borrowing.running == {(768, 1024), (640, 640), (768, 768), (896, 640)}
    never = ShapeBorrowing(until_seen=1)
    assert [never.choose(s) for s, _ in sequence] == [s for s, _ in sequence]


@pytest.mark.parametrize("bad", [dict(borrow_until_seen=0), dict(borrow_until_seen=2.0),
                                 dict(borrow_until_seen=True), dict(borrow_max_pixels=0.9),
                                 dict(borrow_max_pixels=float("nan")), dict(borrow_max_pixels="2")])
def test_bad_borrowing_settings_are_refused_by_value(bad):
    ((name, value),) = bad.items()
    with pytest.raises(ValueError, match=f"{name} must be .*got {value!r}"):
        ShapeBucketsHook(**bad)


def test_a_borrowed_shape_pads_the_batch_further_and_only_in_training():
    from mmdet.structures import DetDataSample

    def batch(height, width):
        images = [torch.full((3, height, width), 7, dtype=torch.uint8), torch.ones(3, 40, 50, dtype=torch.uint8)]
        samples = [DetDataSample(metainfo=dict(img_shape=tuple(i.shape[1:]))) for i in images]
        return dict(inputs=images, data_samples=samples)

    model = _detector_with_preprocessor(pad_size_divisor=1)
    hook = ShapeBucketsHook(size_divisor=32, borrow_until_seen=2)
    hook.before_train(SimpleNamespace(model=model))
    first = model.data_preprocessor(batch(120, 150), training=True)  # (128, 160) runs as itself
    borrowed = model.data_preprocessor(batch(100, 120), training=True)  # pads to (128, 128): new
    assert tuple(first["inputs"].shape[-2:]) == (128, 160)
    assert tuple(borrowed["inputs"].shape[-2:]) == (128, 160)  # (128, 128) borrows (128, 160): 1.25x its pixels
    assert model.data_preprocessor.deform_plugin_training_shape == (128, 160)  # for timers: what it ran at
    assert all(s.batch_input_shape == (128, 160) for s in borrowed["data_samples"])
    own = model.data_preprocessor(batch(100, 120), training=True)  # seen twice: runs as (128, 128)
    assert tuple(own["inputs"].shape[-2:]) == (128, 128)
    torch.testing.assert_close(borrowed["inputs"][..., :128, :128], own["inputs"], rtol=0, atol=0)
    assert bool((borrowed["inputs"][..., 128:] == 0).all())  # the preprocessor's pad_value
    hook.before_val_epoch(SimpleNamespace(model=model))
    evaluation = model.data_preprocessor(batch(100, 120), training=False)
    assert tuple(evaluation["inputs"].shape[-2:]) == (100, 120)  # the config's own divisor (1), no borrowing
    assert (hook.borrowing.batches, hook.borrowing.borrowed) == (3, 1)
