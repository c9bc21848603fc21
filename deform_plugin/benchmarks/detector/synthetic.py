"""Synthetic training batches for the detector benchmark: what mmdet's dataloader yields, without a dataset."""
from __future__ import annotations

import random
from typing import Dict, List, Tuple

import torch

# Image sizes of COCO-like sources, and mmdet's DETR-family training resize: the shorter side drawn from 480-800 in
# steps of 32, the longer side at most 1333, aspect ratio kept.
SOURCE_SIZES = ((480, 640), (640, 480), (640, 640), (427, 640))
SHORT_SIDES = tuple(range(480, 801, 32))
LONG_SIDE_MAX = 1333


def detector_label_spaces(model) -> Dict[str, int]:
    """num_classes for box heads; things/stuff for MaskFormer-style heads."""
    head = getattr(model, "panoptic_head", None)
    if head is not None and hasattr(head, "num_things_classes"):
        return {"things": head.num_things_classes, "stuff": head.num_stuff_classes, "masks": True}
    head = getattr(model, "bbox_head", None)
    num_classes = getattr(head, "num_classes", 80)
    return {"things": num_classes, "stuff": 0, "masks": hasattr(model, "roi_head") and
            getattr(model.roi_head, "with_mask", False)}


def caption_classes(num_classes: int) -> Tuple[str, ...]:
    """The class names a grounding detector's synthetic samples carry as their caption: COCO's for 80 classes
    (what ``CocoDataset(return_classes=True)`` gives), else numbered names."""
    if num_classes == 80:
        from .coco_source import COCO_CATEGORIES
        return tuple(name for _, name in COCO_CATEGORIES)
    return tuple(f"object {index}" for index in range(num_classes))


def make_batch(model, batch_size: int, height: int, width: int, num_gts: int, seed: int) -> dict:
    """A packed batch as mmdet's dataloader yields it: uint8 images and DetDataSamples with random targets.

    Boxes are random xyxy boxes of 5-50% of the image side; masks (MaskFormer-style models) fill each box's
    inscribed ellipse; panoptic models also get a semantic map of stuff classes; grounding detectors (those with a
    language model) get the class names as their caption (``text``, ``custom_entities``), as Grounding-DINO's
    training pipeline packs them.
    """
    import numpy as np
    from mmdet.structures import DetDataSample
    from mmdet.structures.mask import BitmapMasks
    from mmengine.structures import InstanceData, PixelData

    generator = torch.Generator().manual_seed(seed)
    spaces = detector_label_spaces(model)
    inputs, samples = [], []
    for index in range(batch_size):
        inputs.append(torch.randint(0, 256, (3, height, width), dtype=torch.uint8, generator=generator))
        sizes = torch.rand(num_gts, 2, generator=generator) * 0.45 + 0.05
        centres = torch.rand(num_gts, 2, generator=generator)
        wh = sizes * torch.tensor([width, height])
        cxcy = centres * torch.tensor([width, height])
        boxes = torch.cat([cxcy - wh / 2, cxcy + wh / 2], dim=1)
        boxes[:, 0::2] = boxes[:, 0::2].clamp(0, width - 1)
        boxes[:, 1::2] = boxes[:, 1::2].clamp(0, height - 1)
        boxes[:, 2:] = torch.maximum(boxes[:, 2:], boxes[:, :2] + 2)
        labels = torch.randint(0, spaces["things"], (num_gts,), generator=generator)
        sample = DetDataSample(metainfo=dict(
            img_id=index, img_path="", ori_shape=(height, width), img_shape=(height, width),
            scale_factor=(1.0, 1.0), flip=False, flip_direction=None))
        if getattr(model, "language_model", None) is not None:
            sample.set_metainfo(dict(text=caption_classes(spaces["things"]), custom_entities=True))
        gt = InstanceData(bboxes=boxes, labels=labels)
        if spaces["masks"]:
            ys = np.arange(height)[:, None] + 0.5
            xs = np.arange(width)[None, :] + 0.5
            masks = np.zeros((num_gts, height, width), dtype=np.uint8)
            for k, (x1, y1, x2, y2) in enumerate(boxes.tolist()):
                cx, cy, rx, ry = (x1 + x2) / 2, (y1 + y2) / 2, max((x2 - x1) / 2, 1), max((y2 - y1) / 2, 1)
                masks[k] = (((xs - cx) / rx) ** 2 + ((ys - cy) / ry) ** 2) <= 1
            gt.masks = BitmapMasks(masks, height, width)
        sample.gt_instances = gt
        sample.ignored_instances = InstanceData(bboxes=torch.zeros(0, 4), labels=torch.zeros(0, dtype=torch.long))
        if spaces["stuff"]:
            stuff = torch.randint(spaces["things"], spaces["things"] + spaces["stuff"], (1,), generator=generator)
            sem = torch.full((1, height, width), int(stuff), dtype=torch.long)
            sample.gt_sem_seg = PixelData(sem_seg=sem)
        samples.append(sample)
    return {"inputs": inputs, "data_samples": samples}


def random_resize_sizes(count: int, seed: int) -> List[Tuple[int, int]]:
    """``count`` (height, width) pairs as the DETR configs' random resize turns COCO-like sources into."""
    rng = random.Random(seed)
    sizes = []
    for _ in range(count):
        height, width = rng.choice(SOURCE_SIZES)
        scale = min(rng.choice(SHORT_SIDES) / min(height, width), LONG_SIDE_MAX / max(height, width))
        sizes.append((int(height * scale + 0.5), int(width * scale + 0.5)))
    return sizes


def make_variable_batches(model, count: int, batch_size: int, num_gts: int, seed: int) -> List[dict]:
    """``count`` batches whose images each have their own random-resize size (mmdet pads each batch to its largest)."""
    sizes = random_resize_sizes(count * batch_size, seed)
    batches = []
    for index in range(count):
        images = [make_batch(model, 1, h, w, num_gts, seed + index * batch_size + k)
                  for k, (h, w) in enumerate(sizes[index * batch_size:(index + 1) * batch_size])]
        batches.append({"inputs": [b["inputs"][0] for b in images],
                        "data_samples": [b["data_samples"][0] for b in images]})
    return batches
