"""The shapes set as mmdet sees it: a ``CocoDataset`` and a ``CocoMetric`` that find (or generate) their files.

Configs name them by type (``ShapesCocoDataset``, ``ShapesCocoMetric``) and need no paths: the data is
generated on first use, whether the run starts from ``tools/train.py`` or from a plain ``Runner``, because
generation happens when the dataloader or evaluator is built.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from mmdet.datasets import CocoDataset
from mmdet.evaluation import CocoMetric
from mmdet.registry import DATASETS, METRICS

from .shapes import SHAPES_CLASSES, SHAPES_PALETTE, ensure_shapes_dataset


@DATASETS.register_module()
class ShapesCocoDataset(CocoDataset):
    """mmdet's ``CocoDataset`` over one split of the embedded shapes set.

    Args:
        split: ``'train'`` or ``'val'``.
        cache_root: the cache folder of :func:`ensure_shapes_dataset`; ``None`` uses
            ``$DEFORM_PLUGIN_DATA`` or ``~/.cache/deform_plugin/shapes``.
        **kwargs: anything ``CocoDataset`` takes (``pipeline``, ``test_mode``, ``filter_cfg``...). An explicit
            ``data_root`` points at an existing copy of the set and skips generation.
    """

    METAINFO = dict(classes=SHAPES_CLASSES, palette=SHAPES_PALETTE)

    def __init__(self, split: str = "train", cache_root: Optional[str] = None, **kwargs) -> None:
        if "data_root" not in kwargs:
            kwargs["data_root"] = str(ensure_shapes_dataset(cache_root))
        kwargs.setdefault("ann_file", f"annotations/instances_{split}.json")
        kwargs.setdefault("data_prefix", dict(img=f"{split}/"))
        _refuse_inherited_coco_paths(kwargs["data_root"], kwargs["ann_file"], "ShapesCocoDataset")
        super().__init__(**kwargs)


@METRICS.register_module()
class ShapesCocoMetric(CocoMetric):
    """mmdet's ``CocoMetric`` with its ground truth taken from one split of the embedded shapes set.

    Args:
        split: the split whose annotation file is the ground truth, normally ``'val'``.
        cache_root: as for :class:`ShapesCocoDataset`.
        **kwargs: anything ``CocoMetric`` takes (``metric``, ``classwise``...). An explicit ``ann_file``
            wins over ``split``.
    """

    def __init__(self, split: str = "val", cache_root: Optional[str] = None, **kwargs) -> None:
        if "ann_file" not in kwargs:
            kwargs["ann_file"] = str(ensure_shapes_dataset(cache_root) / "annotations" / f"instances_{split}.json")
        _refuse_inherited_coco_paths("", kwargs["ann_file"], "ShapesCocoMetric")
        super().__init__(**kwargs)


def _refuse_inherited_coco_paths(data_root: str, ann_file: str, type_name: str) -> None:
    """A clear error where the paths came from a stock COCO config rather than from the shapes set.

    A config that inherits a stock mmdet config and only changes ``type`` keeps the base's ``data_root`` and
    ``ann_file`` (mmengine merges dicts key by key), which point at COCO files that are not there.
    """
    path = Path(data_root) / ann_file
    if not path.is_file():
        raise FileNotFoundError(
            f"{type_name} got ann_file {str(path)!r}, which does not exist: it looks inherited from a COCO config. "
            f"Replace the whole dataset/evaluator dict with `_delete_=True` (dict(_delete_=True, type='{type_name}', "
            "...)) so the shapes set's own paths are used; configs/shapes/ has a complete example.")
