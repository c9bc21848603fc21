"""deform_plugin.benchmarks.detector.coco_panoptic_source: the synthetic COCO-panoptic-like set the training benchmark
reads for panoptic configs, valid, deterministic, cached, and read by the panoptic config's own pipeline."""
from __future__ import annotations

import importlib.util
import json

import cv2
import numpy as np
import pytest
from train_benchmark_cases import FAST_PANOPTIC, PANOPTIC_SOURCE_IMAGES, merged_overlay

from deform_plugin.benchmarks.detector import coco_panoptic_source, coco_source


def _segment_ids(png_path):
    """The PNG's segment ids, decoded as panopticapi's rgb2id does (R + 256 G + 256^2 B)."""
    rgb = cv2.imread(str(png_path), cv2.IMREAD_COLOR)[..., ::-1].astype(np.int64)
    return rgb[..., 0] + 256 * rgb[..., 1] + 256 * 256 * rgb[..., 2]


def test_coco_panoptic_source_is_a_valid_panoptic_set(panoptic_source):
    coco = json.loads(panoptic_source.ann_path.read_text())
    is_thing = {category["id"]: category["isthing"] for category in coco["categories"]}
    assert len(coco["images"]) == len(coco["annotations"]) == PANOPTIC_SOURCE_IMAGES
    segment_ids = [segment["id"] for ann in coco["annotations"] for segment in ann["segments_info"]]
    assert len(segment_ids) == len(set(segment_ids))  # unique over the set
    for info, ann in zip(coco["images"], coco["annotations"]):
        assert ann["image_id"] == info["id"] and ann["file_name"] == info["file_name"].replace(".jpg", ".png")
        image = cv2.imread(str(panoptic_source.root / panoptic_source.image_dir / info["file_name"]))
        assert image.shape[:2] == (info["height"], info["width"])
        ids = _segment_ids(panoptic_source.root / panoptic_source.seg_dir / ann["file_name"])
        assert ids.shape == image.shape[:2]
        assert (ids == 0).any()  # void pixels
        kinds = [is_thing[segment["category_id"]] for segment in ann["segments_info"]]
        assert 1 in kinds and 0 in kinds  # things and stuff in every image
        stuff = [segment["category_id"] for segment in ann["segments_info"] if not is_thing[segment["category_id"]]]
        assert len(stuff) == len(set(stuff))  # one segment per stuff class, as in COCO panoptic
        assert set(np.unique(ids)) == {0} | {segment["id"] for segment in ann["segments_info"]}
        for segment in ann["segments_info"]:
            mask = ids == segment["id"]
            x, y, w, h = segment["bbox"]
            assert segment["area"] == mask.sum() > 0 and segment["iscrowd"] == 0
            rows, cols = np.flatnonzero(mask.any(1)), np.flatnonzero(mask.any(0))
            assert (x, y, x + w - 1, y + h - 1) == (cols[0], rows[0], cols[-1], rows[-1])


def test_coco_panoptic_categories_are_mmdets():
    import deform_plugin  # noqa: F401  (mmdet.datasets imports mmcv.ops: the stand-in where mmcv-lite is installed)
    from mmdet.datasets import CocoPanopticDataset
    names = [name for _, name in coco_source.COCO_CATEGORIES + coco_panoptic_source.COCO_STUFF_CATEGORIES]
    assert tuple(names) == CocoPanopticDataset.METAINFO["classes"]
    ids = [category_id for category_id, _ in coco_source.COCO_CATEGORIES + coco_panoptic_source.COCO_STUFF_CATEGORIES]
    assert ids == sorted(set(ids)) and max(ids) == 200


def test_coco_panoptic_source_is_deterministic_and_cached(tmp_path):
    first = coco_panoptic_source.ensure_coco_panoptic_source(tmp_path / "a", num_images=2, seed=5)
    second = coco_panoptic_source.ensure_coco_panoptic_source(tmp_path / "b", num_images=2, seed=5)
    files = sorted(p.relative_to(first.root) for p in first.root.rglob("*") if p.is_file())
    assert len(files) == 1 + 2 * 2  # the JSON, a JPEG and a PNG per image
    assert files == sorted(p.relative_to(second.root) for p in second.root.rglob("*") if p.is_file())
    assert all((first.root / f).read_bytes() == (second.root / f).read_bytes() for f in files)
    stamp = first.ann_path.stat().st_mtime_ns
    assert coco_panoptic_source.ensure_coco_panoptic_source(tmp_path / "a", num_images=2, seed=5).root == first.root
    assert first.ann_path.stat().st_mtime_ns == stamp  # found, not regenerated
    assert "COCO-panoptic-like" in first.describe()


# mmdet's LoadPanopticAnnotations imports panopticapi (not on PyPI under that name: the Makefile installs the
# panopticapi-lite wheel, which provides the module).
@pytest.mark.skipif(importlib.util.find_spec("panopticapi") is None,
                    reason="mmdet's panoptic loading needs panopticapi")
def test_the_panoptic_config_pipeline_loads_the_source(tmp_path, panoptic_source):
    """The panoptic config's own train pipeline (LoadPanopticAnnotations, LSJ resize and crop, PackDetInputs) runs on
    the set through mmdet's CocoPanopticDataset: thing instances and a semantic map of things and stuff."""
    import deform_plugin  # noqa: F401  (mmdet.datasets imports mmcv.ops: the stand-in where mmcv-lite is installed)
    from mmdet.registry import DATASETS
    from mmdet.utils import register_all_modules
    register_all_modules()
    _, cfg = merged_overlay(tmp_path, FAST_PANOPTIC, "stock:fp32", panoptic_source)
    dataset = DATASETS.build(cfg.train_dataloader.dataset)
    assert len(dataset) == PANOPTIC_SOURCE_IMAGES  # every image has a thing: none filtered out
    np.random.seed(0)  # the random resize, crop and flip draw from numpy's global generator
    sample = dataset[0]
    instances, sem_seg = sample["data_samples"].gt_instances, sample["data_samples"].gt_sem_seg.sem_seg
    assert sample["inputs"].shape[1:] == sem_seg.shape[1:] and max(sem_seg.shape[1:]) <= 1024
    assert len(instances) > 0 and len(instances.masks) == len(instances.labels)
    labels = set(sem_seg.unique().tolist())
    num_things = len(coco_source.COCO_CATEGORIES)
    assert set(instances.labels.tolist()) <= labels  # the things' pixels carry their class
    assert any(num_things <= label < 255 for label in labels) and labels <= set(range(133)) | {255}
