"""A synthetic COCO-panoptic-like training set on disk, for timing panoptic training through a config's own pipeline.

Each JPEG (COCO's common sizes, as :mod:`.coco_source` makes them) is covered by 1-4 horizontal bands of stuff, each
of its own class among COCO panoptic's 53, with 1-20 thing shapes drawn over them (rectangles, ellipses, triangles,
each of one of COCO's 80 thing classes; a later shape covers an earlier one, and the last one drawn always shows, so
every image has a thing); the top two rows are left unlabelled (void). ``annotations/panoptic_train.json`` is in
COCO's panoptic format: per image the ``file_name`` of its PNG and ``segments_info`` (``id``, ``category_id``,
``area``, ``bbox``, ``iscrowd=0``; ids unique over the set); ``annotations/panoptic_train/<image>.png`` holds each
pixel's segment id as RGB (``id = R + 256 G + 256^2 B``, 0 for void). The 133 categories are COCO panoptic's (ids,
names, ``isthing``), so the stock configs' ``CocoPanopticDataset`` metainfo matches; mmdet's
``LoadPanopticAnnotations`` reads the PNGs (it imports the ``panopticapi`` module).

Deterministic from one seed and cached like :mod:`.coco_source` (only numpy and OpenCV are needed)::

    <cache>/coco-panoptic-v<VERSION>-n<images>-s<seed>/annotations/panoptic_train.json
    <cache>/coco-panoptic-v<VERSION>-n<images>-s<seed>/annotations/panoptic_train/000000000001.png ...
    <cache>/coco-panoptic-v<VERSION>-n<images>-s<seed>/train/000000000001.jpg ...
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Tuple, Union

import cv2
import numpy as np

from .coco_source import (COCO_CATEGORIES, IMAGE_DIR, IMAGE_SIZES, JPEG_QUALITY, OBJECTS_PER_IMAGE, CocoSource,
                          default_cache_root, ensure_generated, shape_polygon)

COCO_PANOPTIC_SOURCE_VERSION = 1
PANOPTIC_ANN_FILE = "annotations/panoptic_train.json"
PANOPTIC_SEG_DIR = "annotations/panoptic_train/"
STUFF_BANDS = (1, 4)  # inclusive
VOID_ROWS = 2  # unlabelled rows along the top

# COCO panoptic's 53 stuff categories (id, name), after its 80 things (COCO_CATEGORIES).
COCO_STUFF_CATEGORIES = (
    (92, "banner"), (93, "blanket"), (95, "bridge"), (100, "cardboard"), (107, "counter"), (109, "curtain"),
    (112, "door-stuff"), (118, "floor-wood"), (119, "flower"), (122, "fruit"), (125, "gravel"), (128, "house"),
    (130, "light"), (133, "mirror-stuff"), (138, "net"), (141, "pillow"), (144, "platform"), (145, "playingfield"),
    (147, "railroad"), (148, "river"), (149, "road"), (151, "roof"), (154, "sand"), (155, "sea"), (156, "shelf"),
    (159, "snow"), (161, "stairs"), (166, "tent"), (168, "towel"), (171, "wall-brick"), (175, "wall-stone"),
    (176, "wall-tile"), (177, "wall-wood"), (178, "water-other"), (180, "window-blind"), (181, "window-other"),
    (184, "tree-merged"), (185, "fence-merged"), (186, "ceiling-merged"), (187, "sky-other-merged"),
    (188, "cabinet-merged"), (189, "table-merged"), (190, "floor-other-merged"), (191, "pavement-merged"),
    (192, "mountain-merged"), (193, "grass-merged"), (194, "dirt-merged"), (195, "paper-merged"),
    (196, "food-other-merged"), (197, "building-other-merged"), (198, "rock-merged"), (199, "wall-other-merged"),
    (200, "rug-merged"),
)


def coco_panoptic_source_dir(cache_root: Union[str, Path, None], num_images: int, seed: int) -> Path:
    base = Path(cache_root).expanduser() if cache_root is not None else default_cache_root()
    return base / f"coco-panoptic-v{COCO_PANOPTIC_SOURCE_VERSION}-n{num_images}-s{seed}"


def ensure_coco_panoptic_source(cache_root: Union[str, Path, None] = None, num_images: int = 64,
                                seed: int = 0) -> CocoSource:
    """The panoptic set for ``(num_images, seed)`` under ``cache_root`` (``None``: ``$DEFORM_PLUGIN_DATA`` or
    ``~/.cache/deform_plugin``), generated first if it is not there (atomically, as
    :func:`.coco_source.ensure_coco_source`)."""
    if num_images < 1:
        raise ValueError(f"num_images must be at least 1, got {num_images}")
    final = coco_panoptic_source_dir(cache_root, num_images, seed)
    ensure_generated(final, PANOPTIC_ANN_FILE, lambda staging: generate_coco_panoptic_source(staging, num_images, seed))
    return CocoSource(final, num_images, seed, ann_file=PANOPTIC_ANN_FILE, seg_dir=PANOPTIC_SEG_DIR)


def generate_coco_panoptic_source(out_dir: Union[str, Path], num_images: int, seed: int) -> dict:
    """Write the images, the panoptic PNGs and ``annotations/panoptic_train.json`` into ``out_dir``; return the
    annotation dict. Not atomic on its own: :func:`ensure_coco_panoptic_source` is the entry point."""
    out_dir = Path(out_dir)
    for folder in (IMAGE_DIR, PANOPTIC_SEG_DIR):
        (out_dir / folder).mkdir(parents=True, exist_ok=True)
    images, annotations = [], []
    next_segment_id = 1
    for image_id in range(1, num_images + 1):
        # One generator per image, as in the detection set: a smaller set is the start of a larger one's images.
        rng = np.random.default_rng([seed, image_id, 1])
        height, width = IMAGE_SIZES[int(rng.integers(len(IMAGE_SIZES)))]
        image, segment_map, categories = _render_panoptic_image(rng, height, width)
        stem = f"{image_id:012d}"
        ok, encoded = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, JPEG_QUALITY])
        if not ok:
            raise RuntimeError(f"OpenCV could not encode {stem}.jpg as JPEG")
        (out_dir / IMAGE_DIR / f"{stem}.jpg").write_bytes(encoded.tobytes())
        segments_info = []
        ids = np.zeros(segment_map.shape, dtype=np.int64)
        for local_id, category_id in enumerate(categories, start=1):
            mask = segment_map == local_id
            if not mask.any():  # covered by later shapes
                continue
            ids[mask] = next_segment_id
            rows, cols = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
            segments_info.append(dict(id=next_segment_id, category_id=category_id, area=int(mask.sum()), iscrowd=0,
                                      bbox=[int(cols[0]), int(rows[0]), int(cols[-1] - cols[0] + 1),
                                            int(rows[-1] - rows[0] + 1)]))
            next_segment_id += 1
        # id = R + 256 G + 256^2 B, written as OpenCV's BGR.
        rgb = np.stack([(ids >> shift) & 255 for shift in (0, 8, 16)], axis=-1).astype(np.uint8)
        if not cv2.imwrite(str(out_dir / PANOPTIC_SEG_DIR / f"{stem}.png"), rgb[..., ::-1]):
            raise RuntimeError(f"OpenCV could not write {stem}.png")
        images.append(dict(id=image_id, file_name=f"{stem}.jpg", height=height, width=width))
        annotations.append(dict(image_id=image_id, file_name=f"{stem}.png", segments_info=segments_info))
    categories = ([dict(id=i, name=name, isthing=1) for i, name in COCO_CATEGORIES]
                  + [dict(id=i, name=name, isthing=0) for i, name in COCO_STUFF_CATEGORIES])
    coco = dict(info=dict(description="deform_plugin synthetic COCO-panoptic-like training set",
                          version=str(COCO_PANOPTIC_SOURCE_VERSION)),
                licenses=[], images=images, annotations=annotations, categories=categories)
    (out_dir / PANOPTIC_ANN_FILE).write_text(json.dumps(coco, sort_keys=True, separators=(",", ":")))
    return coco


def _render_panoptic_image(rng: np.random.Generator, height: int, width: int
                           ) -> Tuple[np.ndarray, np.ndarray, List[int]]:
    """A BGR uint8 image; its map of segment numbers (1-based into the returned category ids, 0 void)."""
    image = np.clip(rng.uniform(40, 215, size=3) + rng.normal(0.0, 18.0, size=(height, width, 3)), 0, 255)
    image = image.astype(np.uint8)
    segment_map = np.zeros((height, width), dtype=np.int32)
    categories: List[int] = []
    num_bands = int(rng.integers(STUFF_BANDS[0], STUFF_BANDS[1] + 1))
    stuff_ids = [category_id for category_id, _ in COCO_STUFF_CATEGORIES]
    cuts = [0] + sorted(int(v) for v in rng.integers(1, height, size=num_bands - 1)) + [height]
    for band, category_id in enumerate(rng.choice(stuff_ids, size=num_bands, replace=False)):
        top, bottom = cuts[band], cuts[band + 1]
        if bottom <= top:
            continue
        categories.append(int(category_id))
        segment_map[top:bottom] = len(categories)
        image[top:bottom] = np.clip(image[top:bottom].astype(np.int16) + rng.integers(-60, 61, size=3), 0, 255)
    thing_ids = [category_id for category_id, _ in COCO_CATEGORIES]
    for _ in range(int(rng.integers(OBJECTS_PER_IMAGE[0], OBJECTS_PER_IMAGE[1] + 1))):
        polygon = np.round(shape_polygon(rng, height, width)).astype(np.int32)
        categories.append(int(rng.choice(thing_ids)))
        cv2.fillPoly(image, [polygon], tuple(int(c) for c in rng.integers(0, 256, size=3)))
        cv2.fillPoly(segment_map, [polygon], len(categories))
    # Last, over everything: a strip too thin to hide any shape (each is at least 16 px tall).
    segment_map[:VOID_ROWS] = 0
    return image, segment_map, categories
