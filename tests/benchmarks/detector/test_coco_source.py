"""deform_plugin.benchmarks.detector.coco_source: the synthetic COCO-like set the training benchmark reads, valid,
deterministic, cached, and read by the fast configs' own pipelines."""
from __future__ import annotations


import cv2
import numpy as np
import pytest
from train_benchmark_cases import FAST_DDETR, FAST_MASK2FORMER, SOURCE_IMAGES, merged_overlay

from deform_plugin.benchmarks.detector import coco_source


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
