"""A synthetic COCO-like training set on disk, for timing training through a config's own data pipeline.

JPEG images in COCO's common sizes (480x640, 640x480, 640x640, 427x640, as height x width) hold 1-20 coloured
shapes (rectangles, ellipses, triangles) on a noisy background; ``annotations/instances_train.json`` gives each
shape a box, a polygon ``segmentation``, its ``area``, ``iscrowd=0`` and one of COCO's 80 categories (COCO's ids
and names, so the stock configs' ``CocoDataset`` metainfo matches). Boxes and polygons (``LoadAnnotations`` with
``with_mask=True``) load; the panoptic set is :mod:`.coco_panoptic_source`'s.

Everything comes from one seed; the folder name carries the format version, the image count and the seed, so a
change regenerates instead of reading a stale copy. Only numpy and OpenCV are needed (no mmdet, no deform_plugin,
no download)::

    <cache>/coco-v<VERSION>-n<images>-s<seed>/annotations/instances_train.json
    <cache>/coco-v<VERSION>-n<images>-s<seed>/train/000000000001.jpg ...
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Tuple, Union

import cv2
import numpy as np

COCO_SOURCE_VERSION = 1
DATA_ENV_VAR = "DEFORM_PLUGIN_DATA"
DEFAULT_CACHE = Path("~/.cache/deform_plugin")
ANN_FILE = "annotations/instances_train.json"
IMAGE_DIR = "train/"
IMAGE_SIZES = ((480, 640), (640, 480), (640, 640), (427, 640))  # (height, width)
OBJECTS_PER_IMAGE = (1, 20)  # inclusive
MIN_OBJECT_SIDE = 16  # pixels
MAX_OBJECT_FRACTION = 0.6  # of the image side
JPEG_QUALITY = 90

# COCO 2017's 80 detection categories: (id, name). The ids skip 12, 26, 29, 30, 45, 66, 68, 69, 71, 83.
COCO_CATEGORIES = (
    (1, "person"), (2, "bicycle"), (3, "car"), (4, "motorcycle"), (5, "airplane"), (6, "bus"), (7, "train"),
    (8, "truck"), (9, "boat"), (10, "traffic light"), (11, "fire hydrant"), (13, "stop sign"),
    (14, "parking meter"), (15, "bench"), (16, "bird"), (17, "cat"), (18, "dog"), (19, "horse"), (20, "sheep"),
    (21, "cow"), (22, "elephant"), (23, "bear"), (24, "zebra"), (25, "giraffe"), (27, "backpack"),
    (28, "umbrella"), (31, "handbag"), (32, "tie"), (33, "suitcase"), (34, "frisbee"), (35, "skis"),
    (36, "snowboard"), (37, "sports ball"), (38, "kite"), (39, "baseball bat"), (40, "baseball glove"),
    (41, "skateboard"), (42, "surfboard"), (43, "tennis racket"), (44, "bottle"), (46, "wine glass"), (47, "cup"),
    (48, "fork"), (49, "knife"), (50, "spoon"), (51, "bowl"), (52, "banana"), (53, "apple"), (54, "sandwich"),
    (55, "orange"), (56, "broccoli"), (57, "carrot"), (58, "hot dog"), (59, "pizza"), (60, "donut"), (61, "cake"),
    (62, "chair"), (63, "couch"), (64, "potted plant"), (65, "bed"), (67, "dining table"), (70, "toilet"),
    (72, "tv"), (73, "laptop"), (74, "mouse"), (75, "remote"), (76, "keyboard"), (77, "cell phone"),
    (78, "microwave"), (79, "oven"), (80, "toaster"), (81, "sink"), (82, "refrigerator"), (84, "book"),
    (85, "clock"), (86, "vase"), (87, "scissors"), (88, "teddy bear"), (89, "hair drier"), (90, "toothbrush"),
)
SHAPE_KINDS = ("rectangle", "ellipse", "triangle")


@dataclass(frozen=True)
class CocoSource:
    """Where a generated set lives, in the terms of an mmdet dataset config (``data_root`` + relative paths)."""

    root: Path
    num_images: int
    seed: int
    ann_file: str = ANN_FILE
    image_dir: str = IMAGE_DIR
    seg_dir: Optional[str] = None  # the panoptic PNGs' folder (``data_prefix.seg``) of a panoptic set

    @property
    def data_root(self) -> str:
        return str(self.root) + os.sep

    @property
    def ann_path(self) -> Path:
        return self.root / self.ann_file

    def describe(self) -> str:
        kind = "COCO-panoptic-like" if self.seg_dir else "COCO-like"
        return f"synthetic {kind} set, {self.num_images} JPEG images (seed {self.seed}) in {self.root}"


def default_cache_root() -> Path:
    """``$DEFORM_PLUGIN_DATA`` if set, else ``~/.cache/deform_plugin``."""
    return Path(os.environ.get(DATA_ENV_VAR) or DEFAULT_CACHE).expanduser()


def coco_source_dir(cache_root: Union[str, Path, None], num_images: int, seed: int) -> Path:
    base = Path(cache_root).expanduser() if cache_root is not None else default_cache_root()
    return base / f"coco-v{COCO_SOURCE_VERSION}-n{num_images}-s{seed}"


def ensure_coco_source(cache_root: Union[str, Path, None] = None, num_images: int = 64,
                       seed: int = 0) -> CocoSource:
    """The set for ``(num_images, seed)`` under ``cache_root``, generated first if it is not there.

    Args:
        cache_root: the folder that holds versioned copies; ``None`` means ``$DEFORM_PLUGIN_DATA`` or
            ``~/.cache/deform_plugin``.
        num_images: how many images the set has (at least 1).
        seed: the seed every image and annotation derives from.

    Returns:
        A complete set: generation writes into a temporary sibling folder and renames it into place, so a reader
        never sees a half-written set, and two processes generating at once both end with the same folder.
    """
    if num_images < 1:
        raise ValueError(f"num_images must be at least 1, got {num_images}")
    final = coco_source_dir(cache_root, num_images, seed)
    ensure_generated(final, ANN_FILE, lambda staging: generate_coco_source(staging, num_images, seed))
    return CocoSource(final, num_images, seed)


def ensure_generated(final: Path, marker: str, generate: Callable[[Path], object]) -> None:
    """Make ``final`` with ``generate(folder)`` unless ``final / marker`` exists: into a temporary sibling folder,
    then renamed into place, so that a reader never sees a half-written set."""
    if (final / marker).is_file():
        return
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        os.chmod(staging, 0o755)  # mkdtemp's 0700 would hide a shared cache from other users
        generate(staging)
        try:
            os.rename(staging, final)
        except OSError:
            # Another process renamed its copy first: the same bytes, so keep that one.
            if not (final / marker).is_file():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def generate_coco_source(out_dir: Union[str, Path], num_images: int, seed: int) -> dict:
    """Write the images and ``annotations/instances_train.json`` into ``out_dir``; return the annotation dict.

    Not atomic on its own: :func:`ensure_coco_source` is the entry point.
    """
    out_dir = Path(out_dir)
    (out_dir / IMAGE_DIR).mkdir(parents=True, exist_ok=True)
    (out_dir / ANN_FILE).parent.mkdir(parents=True, exist_ok=True)
    category_ids = [category_id for category_id, _ in COCO_CATEGORIES]
    images, annotations = [], []
    for image_id in range(1, num_images + 1):
        # One generator per image: an image never depends on its predecessors, so the first N images of a larger
        # set are those of a smaller one.
        rng = np.random.default_rng([seed, image_id])
        height, width = IMAGE_SIZES[int(rng.integers(len(IMAGE_SIZES)))]
        image, polygons = _render_image(rng, height, width)
        file_name = f"{image_id:012d}.jpg"
        ok, encoded = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, JPEG_QUALITY])
        if not ok:
            raise RuntimeError(f"OpenCV could not encode {file_name} as JPEG")
        (out_dir / IMAGE_DIR / file_name).write_bytes(encoded.tobytes())
        images.append(dict(id=image_id, file_name=file_name, height=height, width=width))
        for polygon in polygons:
            x0, y0 = polygon.min(axis=0)
            x1, y1 = polygon.max(axis=0)
            annotations.append(dict(
                id=len(annotations) + 1,
                image_id=image_id,
                category_id=int(rng.choice(category_ids)),
                bbox=[round(float(v), 2) for v in (x0, y0, x1 - x0, y1 - y0)],
                area=round(float(abs(cv2.contourArea(polygon))), 2),
                segmentation=[[round(float(v), 2) for v in polygon.reshape(-1)]],
                iscrowd=0,
            ))
    coco = dict(
        info=dict(description="deform_plugin synthetic COCO-like training set", version=str(COCO_SOURCE_VERSION)),
        licenses=[], images=images, annotations=annotations,
        categories=[dict(id=category_id, name=name) for category_id, name in COCO_CATEGORIES])
    # Sorted keys and fixed separators: the same data always serialises to the same bytes.
    (out_dir / ANN_FILE).write_text(json.dumps(coco, sort_keys=True, separators=(",", ":")))
    return coco


def _render_image(rng: np.random.Generator, height: int, width: int) -> Tuple[np.ndarray, List[np.ndarray]]:
    """A BGR uint8 image of shapes on noise, and each shape's outline as a float32 (N, 2) polygon in (x, y)."""
    base = rng.uniform(40, 215, size=3)
    noise = rng.normal(0.0, 18.0, size=(height, width, 3))
    image = np.clip(base + noise, 0, 255).astype(np.uint8)
    polygons = []
    for _ in range(int(rng.integers(OBJECTS_PER_IMAGE[0], OBJECTS_PER_IMAGE[1] + 1))):
        polygon = shape_polygon(rng, height, width)
        color = tuple(int(c) for c in rng.integers(0, 256, size=3))
        cv2.fillPoly(image, [np.round(polygon).astype(np.int32)], color)
        polygons.append(polygon)
    return image, polygons


def shape_polygon(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """A rectangle, ellipse or triangle of COCO-like size inside the image, as a float32 (N, 2) (x, y) polygon."""
    # Log-uniform sides: many small objects and a few large ones, as in COCO.
    box_w = float(np.exp(rng.uniform(np.log(MIN_OBJECT_SIDE), np.log(MAX_OBJECT_FRACTION * width))))
    box_h = float(np.exp(rng.uniform(np.log(MIN_OBJECT_SIDE), np.log(MAX_OBJECT_FRACTION * height))))
    x0 = float(rng.uniform(0, width - box_w))
    y0 = float(rng.uniform(0, height - box_h))
    kind = SHAPE_KINDS[int(rng.integers(len(SHAPE_KINDS)))]
    if kind == "rectangle":
        points = [(x0, y0), (x0 + box_w, y0), (x0 + box_w, y0 + box_h), (x0, y0 + box_h)]
    elif kind == "triangle":
        apex = x0 + float(rng.uniform(0, box_w))
        points = [(apex, y0), (x0 + box_w, y0 + box_h), (x0, y0 + box_h)]
    else:
        angles = np.linspace(0, 2 * np.pi, 24, endpoint=False)
        points = np.stack([x0 + box_w / 2 * (1 + np.cos(angles)), y0 + box_h / 2 * (1 + np.sin(angles))], axis=1)
    return np.asarray(points, dtype=np.float32)

