"""The embedded shapes set: deterministic bytes, valid COCO, the documented classes and splits, atomic caching."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import cv2
import numpy as np
import pytest
from pycocotools.coco import COCO

from deform_plugin.datasets import shapes
from deform_plugin.datasets.shapes import (IMAGE_SIZE, OBJECTS_PER_IMAGE, SHAPES_CLASSES, SHAPES_VERSION,
                                           SPLIT_SIZES, ensure_shapes_dataset, generate_shapes_dataset,
                                           shapes_dataset_dir)


def _digest_tree(root: Path) -> dict[str, str]:
    return {str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(root.rglob("*")) if path.is_file()}


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory) -> Path:
    return ensure_shapes_dataset(tmp_path_factory.mktemp("cache"))


def test_generation_is_byte_identical(dataset_dir, tmp_path):
    again = generate_shapes_dataset(tmp_path / "again")
    first, second = _digest_tree(dataset_dir), _digest_tree(again)
    assert len(first) == sum(SPLIT_SIZES.values()) + len(SPLIT_SIZES)
    assert first == second


def test_cache_folder_is_versioned_and_reused(dataset_dir):
    assert dataset_dir.name == f"shapes-v{SHAPES_VERSION}"
    before = {p: p.stat().st_mtime_ns for p in dataset_dir.rglob("*.json")}
    assert ensure_shapes_dataset(dataset_dir.parent) == dataset_dir
    assert {p: p.stat().st_mtime_ns for p in dataset_dir.rglob("*.json")} == before
    # Nothing of the staging folder is left next to the finished one.
    assert [p.name for p in dataset_dir.parent.iterdir()] == [dataset_dir.name]


def test_environment_variable_picks_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(shapes.DATA_ENV_VAR, str(tmp_path))
    assert shapes_dataset_dir() == tmp_path / f"shapes-v{SHAPES_VERSION}"


def test_losing_the_rename_race_keeps_the_winner(tmp_path, monkeypatch):
    """A second process that finishes generating after the first has renamed its copy into place."""
    monkeypatch.setattr(shapes, "SPLIT_SIZES", {"train": 3, "val": 2})
    final = shapes_dataset_dir(tmp_path)
    real_generate = shapes.generate_shapes_dataset

    def generate_while_another_process_finishes(out_dir):
        real_generate(out_dir)
        real_generate(final)  # the other process's copy appears first
        return out_dir

    monkeypatch.setattr(shapes, "generate_shapes_dataset", generate_while_another_process_finishes)
    assert ensure_shapes_dataset(tmp_path) == final
    assert [p.name for p in tmp_path.iterdir()] == [final.name]


@pytest.mark.parametrize("split", sorted(SPLIT_SIZES))
def test_split_is_valid_coco(dataset_dir, split):
    coco = COCO(str(dataset_dir / "annotations" / f"instances_{split}.json"))
    assert [coco.cats[i]["name"] for i in sorted(coco.cats)] == list(SHAPES_CLASSES)
    assert len(coco.imgs) == SPLIT_SIZES[split]
    per_image = [len(coco.getAnnIds(imgIds=[image_id])) for image_id in coco.imgs]
    assert min(per_image) >= OBJECTS_PER_IMAGE[0] and max(per_image) <= OBJECTS_PER_IMAGE[1]
    seen_classes = {ann["category_id"] for ann in coco.anns.values()}
    assert seen_classes == set(coco.cats)
    for image_id, info in coco.imgs.items():
        image = cv2.imread(str(dataset_dir / split / info["file_name"]))
        assert image is not None and image.shape == (info["height"], info["width"], 3) == (IMAGE_SIZE, IMAGE_SIZE, 3)
        if image_id > 8:
            continue
        for ann in coco.loadAnns(coco.getAnnIds(imgIds=[image_id])):
            x, y, w, h = ann["bbox"]
            assert 0 <= x and 0 <= y and x + w <= info["width"] and y + h <= info["height"]
            assert 0 < ann["area"] <= w * h
            assert ann["iscrowd"] == 0
            # The polygon mask lies inside its box and covers most of it (a shape, not a sliver).
            mask = coco.annToMask(ann)
            ys, xs = np.nonzero(mask)
            assert xs.min() >= int(x) - 1 and xs.max() <= x + w and ys.min() >= int(y) - 1 and ys.max() <= y + h
            assert mask.sum() >= 0.3 * w * h


def test_boxes_do_not_overlap(dataset_dir):
    """Rejection sampling keeps objects apart, so every annotated shape is fully visible."""
    data = json.loads((dataset_dir / "annotations" / "instances_train.json").read_text())
    boxes_by_image: dict[int, list] = {}
    for ann in data["annotations"]:
        boxes_by_image.setdefault(ann["image_id"], []).append(ann["bbox"])
    for boxes in boxes_by_image.values():
        for i, (x0, y0, w0, h0) in enumerate(boxes):
            for x1, y1, w1, h1 in boxes[i + 1:]:
                assert x0 + w0 <= x1 or x1 + w1 <= x0 or y0 + h0 <= y1 or y1 + h1 <= y0


def test_splits_differ(dataset_dir):
    train = (dataset_dir / "train" / "000001.png").read_bytes()
    val = (dataset_dir / "val" / "000001.png").read_bytes()
    assert train != val


def test_mmdet_dataset_reads_the_split(dataset_dir):
    from deform_plugin.datasets import ShapesCocoDataset

    dataset = ShapesCocoDataset(split="val", cache_root=str(dataset_dir.parent), pipeline=[], test_mode=True)
    assert dataset.metainfo["classes"] == SHAPES_CLASSES
    assert len(dataset) == SPLIT_SIZES["val"]
    sample = dataset[0]
    assert os.path.dirname(sample["img_path"]) == str(dataset_dir / "val")
    assert {inst["bbox_label"] for inst in sample["instances"]} <= set(range(len(SHAPES_CLASSES)))
