"""The embedded shapes detection set: a generator that needs only numpy and OpenCV (:mod:`.shapes`) and the
mmdet dataset and metric that read it (:mod:`.coco_shapes`)."""
from .coco_shapes import ShapesCocoDataset, ShapesCocoMetric
from .shapes import (SHAPES_CLASSES, SHAPES_PALETTE, SHAPES_VERSION, default_cache_root, ensure_shapes_dataset,
                     generate_shapes_dataset, shapes_dataset_dir)

__all__ = [
    "SHAPES_CLASSES",
    "SHAPES_PALETTE",
    "SHAPES_VERSION",
    "ShapesCocoDataset",
    "ShapesCocoMetric",
    "default_cache_root",
    "ensure_shapes_dataset",
    "generate_shapes_dataset",
    "shapes_dataset_dir",
]
