"""The embedded "shapes" detection set: generated on first use, never downloaded.

Small COCO-format images of coloured shapes (circle, square, triangle, star) on textured backgrounds
(noise, gradients, stripes, checkers). Everything comes from fixed seeds, so every machine generates the
same bytes; the folder name carries :data:`SHAPES_VERSION`, so a change of format regenerates instead of
reading stale files. This module needs only numpy and OpenCV (no mmdet), so it can run anywhere.

Layout of ``<cache>/shapes-v<SHAPES_VERSION>/``::

    annotations/instances_train.json   annotations/instances_val.json
    train/000001.png ...               val/000001.png ...
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Union

import cv2
import numpy as np

SHAPES_VERSION = 1
SHAPES_CLASSES = ("circle", "square", "triangle", "star")
# One colour per class for mmdet's visualizer (RGB).
SHAPES_PALETTE = [(220, 20, 60), (0, 130, 200), (60, 180, 75), (255, 190, 0)]
IMAGE_SIZE = 128
SPLIT_SIZES = {"train": 512, "val": 128}
OBJECTS_PER_IMAGE = (1, 4)  # inclusive range
OBJECT_SIZE = (20, 52)  # diameter of the circumscribed circle, in pixels

DATA_ENV_VAR = "DEFORM_PLUGIN_DATA"
DEFAULT_CACHE = Path("~/.cache/deform_plugin/shapes")

# A split's seed is part of every image's seed; changing these changes the data, so bump the version too.
_SPLIT_SEEDS = {"train": 1, "val": 2}
_BASE_SEED = 20240601
# OpenCV draws polygons with fixed-point vertices when given `shift`: 4 bits = 1/16 px precision.
_SUBPIXEL_BITS = 4


def default_cache_root() -> Path:
    """``$DEFORM_PLUGIN_DATA`` if set, else ``~/.cache/deform_plugin/shapes``."""
    return Path(os.environ.get(DATA_ENV_VAR) or DEFAULT_CACHE).expanduser()


def shapes_dataset_dir(root: Union[str, Path, None] = None) -> Path:
    """Where the current version of the set lives (or will live) under ``root``."""
    base = Path(root).expanduser() if root is not None else default_cache_root()
    return base / f"shapes-v{SHAPES_VERSION}"


def ensure_shapes_dataset(root: Union[str, Path, None] = None) -> Path:
    """Return the folder of the shapes set, generating it first if it is not there.

    Args:
        root: the cache folder that holds versioned copies of the set. ``None`` means
            ``$DEFORM_PLUGIN_DATA``, or ``~/.cache/deform_plugin/shapes`` when that is unset.

    Returns:
        ``<root>/shapes-v<SHAPES_VERSION>``, complete: generation writes into a temporary sibling folder
        and renames it into place, so a reader never sees a half-written set and two processes that
        generate at once both end up with the same complete folder.
    """
    final = shapes_dataset_dir(root)
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        # mkdtemp makes the folder private (0700); the cache may be shared, so open it up like any other folder.
        os.chmod(staging, 0o755)
        generate_shapes_dataset(staging)
        try:
            os.rename(staging, final)
        except OSError:
            # Another process renamed its copy first; it holds the same bytes, so keep that one.
            if not final.is_dir():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return final


def generate_shapes_dataset(out_dir: Union[str, Path]) -> Path:
    """Write every split of the set into ``out_dir`` (created if needed) and return it.

    Not atomic on its own; :func:`ensure_shapes_dataset` is the entry point that callers should use.
    """
    out_dir = Path(out_dir)
    (out_dir / "annotations").mkdir(parents=True, exist_ok=True)
    for split, num_images in SPLIT_SIZES.items():
        coco = _generate_split(out_dir, split, num_images)
        ann_path = out_dir / "annotations" / f"instances_{split}.json"
        # Sorted keys and fixed separators: the same data always serialises to the same bytes.
        ann_path.write_text(json.dumps(coco, sort_keys=True, separators=(",", ":")))
    return out_dir


def _generate_split(out_dir: Path, split: str, num_images: int) -> dict:
    image_dir = out_dir / split
    image_dir.mkdir(parents=True, exist_ok=True)
    images, annotations = [], []
    for image_id in range(1, num_images + 1):
        # One generator per image, seeded by (base, split, index): an image never depends on its
        # predecessors, so changing a split's size keeps the images it already had.
        rng = np.random.default_rng([_BASE_SEED, _SPLIT_SEEDS[split], image_id])
        image, objects = _render_image(rng)
        file_name = f"{image_id:06d}.png"
        ok, encoded = cv2.imencode(".png", image)
        if not ok:
            raise RuntimeError(f"OpenCV could not encode {split}/{file_name} as PNG")
        (image_dir / file_name).write_bytes(encoded.tobytes())
        images.append(dict(id=image_id, file_name=file_name, width=IMAGE_SIZE, height=IMAGE_SIZE))
        for category_id, polygon in objects:
            x0, y0 = polygon.min(axis=0)
            x1, y1 = polygon.max(axis=0)
            annotations.append(dict(
                id=len(annotations) + 1,
                image_id=image_id,
                category_id=category_id,
                bbox=[round(float(v), 2) for v in (x0, y0, x1 - x0, y1 - y0)],
                area=round(float(_polygon_area(polygon)), 2),
                segmentation=[[round(float(v), 2) for v in polygon.reshape(-1)]],
                iscrowd=0,
            ))
    categories = [dict(id=i + 1, name=name, supercategory="shape") for i, name in enumerate(SHAPES_CLASSES)]
    info = dict(description=f"deform_plugin embedded shapes set, {split} split", version=str(SHAPES_VERSION))
    return dict(info=info, licenses=[], images=images, annotations=annotations, categories=categories)


def _render_image(rng: np.random.Generator) -> tuple[np.ndarray, list[tuple[int, np.ndarray]]]:
    image = _background(rng)
    objects: list[tuple[int, np.ndarray]] = []
    boxes: list[np.ndarray] = []
    wanted = int(rng.integers(OBJECTS_PER_IMAGE[0], OBJECTS_PER_IMAGE[1] + 1))
    # Rejection sampling keeps boxes apart, so no object hides another and every label is fully visible.
    for _ in range(wanted * 20):
        if len(objects) == wanted:
            break
        class_index = int(rng.integers(len(SHAPES_CLASSES)))
        radius = rng.uniform(*OBJECT_SIZE) / 2
        centre = rng.uniform(radius + 1, IMAGE_SIZE - radius - 1, size=2)
        polygon = _shape_polygon(SHAPES_CLASSES[class_index], centre, radius, rng.uniform(0, 2 * np.pi))
        box = np.concatenate([polygon.min(axis=0) - 2, polygon.max(axis=0) + 2])
        if any(_boxes_overlap(box, other) for other in boxes):
            continue
        colour = _contrasting_colour(rng, image, box)
        fixed_point = np.round(polygon * (1 << _SUBPIXEL_BITS)).astype(np.int32)
        cv2.fillPoly(image, [fixed_point], colour, lineType=cv2.LINE_AA, shift=_SUBPIXEL_BITS)
        boxes.append(box)
        objects.append((class_index + 1, polygon))
    noise = rng.normal(0.0, 6.0, size=image.shape)
    image = np.clip(image.astype(np.float64) + noise, 0, 255).astype(np.uint8)
    return image, objects


def _background(rng: np.random.Generator) -> np.ndarray:
    size = IMAGE_SIZE
    colour_a = rng.uniform(0, 255, size=3)
    colour_b = rng.uniform(0, 255, size=3)
    ys, xs = np.mgrid[0:size, 0:size].astype(np.float64)
    kind = int(rng.integers(4))
    if kind == 0:  # blurred noise: blotches of two colours
        field = cv2.GaussianBlur(rng.uniform(0, 1, size=(size, size)), (0, 0), sigmaX=rng.uniform(2, 6))
        weight = (field - field.min()) / max(float(np.ptp(field)), 1e-6)
    elif kind == 1:  # linear gradient at a random angle
        angle = rng.uniform(0, 2 * np.pi)
        along = xs * np.cos(angle) + ys * np.sin(angle)
        weight = (along - along.min()) / max(float(np.ptp(along)), 1e-6)
    elif kind == 2:  # soft stripes at a random angle and period
        angle = rng.uniform(0, np.pi)
        period = rng.uniform(6, 24)
        weight = 0.5 + 0.5 * np.sin(2 * np.pi * (xs * np.cos(angle) + ys * np.sin(angle)) / period)
    else:  # checkerboard
        cell = int(rng.integers(6, 20))
        weight = ((xs // cell + ys // cell) % 2).astype(np.float64)
    # Backgrounds stay low-contrast against the objects drawn on them: the two colours are pulled together.
    colour_b = colour_a + 0.5 * (colour_b - colour_a)
    image = colour_a * (1 - weight[..., None]) + colour_b * weight[..., None]
    return np.clip(image, 0, 255).astype(np.uint8)


def _shape_polygon(name: str, centre: np.ndarray, radius: float, rotation: float) -> np.ndarray:
    """Vertices ``(N, 2)`` as (x, y) floats of a shape inscribed in a circle of ``radius``."""
    if name == "circle":
        angles, radii = np.linspace(0, 2 * np.pi, 48, endpoint=False), np.full(48, radius)
    elif name == "square":
        angles, radii = rotation + np.arange(4) * np.pi / 2, np.full(4, radius)
    elif name == "triangle":
        angles, radii = rotation + np.arange(3) * 2 * np.pi / 3, np.full(3, radius)
    elif name == "star":
        angles = rotation + np.arange(10) * np.pi / 5
        radii = np.where(np.arange(10) % 2 == 0, radius, radius * 0.45)
    else:
        raise ValueError(f"unknown shape {name!r}: expected one of {SHAPES_CLASSES}")
    return np.stack([centre[0] + radii * np.cos(angles), centre[1] + radii * np.sin(angles)], axis=1)


def _contrasting_colour(rng: np.random.Generator, image: np.ndarray, box: np.ndarray) -> tuple[int, int, int]:
    x0, y0 = np.clip(box[:2].astype(int), 0, IMAGE_SIZE - 1)
    x1, y1 = np.clip(box[2:].astype(int), x0 + 1, IMAGE_SIZE)
    local_mean = image[y0:y1, x0:x1].reshape(-1, 3).mean(axis=0)
    colour = rng.uniform(0, 255, size=3)
    for _ in range(32):
        if np.abs(colour - local_mean).sum() >= 150:
            break
        colour = rng.uniform(0, 255, size=3)
    else:
        # Fall back to the opposite of the local mean, which always stands out.
        colour = 255 - local_mean
    return tuple(int(c) for c in colour)


def _boxes_overlap(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3])


def _polygon_area(polygon: np.ndarray) -> float:
    x, y = polygon[:, 0], polygon[:, 1]
    return 0.5 * abs(float(np.dot(x, np.roll(y, -1)) - np.dot(y, np.roll(x, -1))))


if __name__ == "__main__":
    print(ensure_shapes_dataset())
