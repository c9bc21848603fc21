"""mmdet 3.3's ``DetInferencer`` with the class names of the model at hand (for ``tools/infer.py``).

``DetInferencer`` takes class names from the checkpoint's meta data and otherwise falls back to COCO's 80 names,
whatever the model predicts: a 4-class model loaded without a checkpoint, or from one that saved no names, draws
COCO names. :class:`NamedClassesInferencer` takes them from the checkpoint, else from the config's test dataset,
and keeps only names whose count matches the model's number of classes; failing both, ``class 0``, ``class 1``, ...
It overrides ``_load_weights_to_model``, the step of mmdet's inferencer that sets ``model.dataset_meta``.
"""
from __future__ import annotations

import copy
import warnings
from typing import List, Optional, Sequence, Tuple

from mmdet.apis import DetInferencer

# mmdet's own warnings about the class names it would pick (the names are chosen here instead) and about random
# weights (which the caller says in its own words).
_REPLACED_WARNINGS = ("weights is None, use COCO classes by default",
                      "dataset_meta or class names are not saved in the checkpoint",
                      "Checkpoint is not loaded, and the inference result is calculated by the randomly")


def model_num_classes(model) -> Optional[int]:
    """How many classes a detector predicts (DETR family: its bbox head; Mask2Former: things + stuff), or None."""
    head = getattr(model, "bbox_head", None)
    if isinstance(getattr(head, "num_classes", None), int):
        return head.num_classes
    head = getattr(model, "panoptic_head", None)
    if isinstance(getattr(head, "num_things_classes", None), int):
        return head.num_things_classes + head.num_stuff_classes
    return None


def checkpoint_class_names(checkpoint: Optional[dict]) -> Optional[List[str]]:
    meta = (checkpoint or {}).get("meta", {})
    dataset_meta = {key.lower(): value for key, value in meta.get("dataset_meta", {}).items()}
    names = dataset_meta.get("classes", meta.get("CLASSES"))  # CLASSES: checkpoints of mmdet 2.x
    return list(names) if names else None


def config_class_names(cfg) -> Optional[List[str]]:
    """The class names of the config's test dataset, read as mmdet's inferencer reads its palette (lazily: no
    annotation file is opened)."""
    from mmdet.registry import DATASETS

    try:
        dataset_cfg = copy.deepcopy(cfg.test_dataloader.dataset)
        dataset_cfg["lazy_init"] = True
        names = DATASETS.build(dataset_cfg).metainfo.get("classes")
    except Exception:  # a dataset that cannot be built here has no names to offer
        return None
    return list(names) if names else None


def choose_class_names(candidates: Sequence[Tuple[str, Optional[List[str]]]],
                       num_classes: Optional[int]) -> Tuple[List[str], str]:
    """The first ``(source, names)`` candidate with names, of the model's class count where that is known; else
    ``class 0`` ... ``class N-1``. Returns the names and a phrase saying where they came from."""
    for source, names in candidates:
        if names and (num_classes is None or len(names) == num_classes):
            return list(names), source
    if num_classes is None:
        raise ValueError("no class names found, and the model's number of classes is unknown")
    tried = ", ".join(f"{source} has {len(names)}" for source, names in candidates if names)
    return [f"class {index}" for index in range(num_classes)], (
        f"numbered: the model predicts {num_classes} classes" + (f" ({tried})" if tried else ""))


class NamedClassesInferencer(DetInferencer):
    """``DetInferencer`` whose class names come from the checkpoint, else the config, never COCO's by default.

    ``class_names_source`` says where the names came from.
    """

    class_names_source = ""

    def _load_weights_to_model(self, model, checkpoint: Optional[dict], cfg) -> None:
        with warnings.catch_warnings():
            for message in _REPLACED_WARNINGS:
                warnings.filterwarnings("ignore", message=message)
            super()._load_weights_to_model(model, checkpoint, cfg)
        names, self.class_names_source = choose_class_names(
            [("the checkpoint", checkpoint_class_names(checkpoint)),
             ("the config's test dataset", config_class_names(cfg))],
            model_num_classes(model))
        model.dataset_meta["classes"] = names
        palette = model.dataset_meta.get("palette")
        if isinstance(palette, list) and len(palette) < len(names):
            model.dataset_meta["palette"] = "random"  # a palette of other names would run out of colours
