"""Synthetic training batches for the detector benchmark: what mmdet's dataloader yields, without a dataset."""
from __future__ import annotations

from typing import Dict

import torch


def detector_label_spaces(model) -> Dict[str, int]:
    """num_classes for box heads; things/stuff for MaskFormer-style heads."""
    head = getattr(model, "panoptic_head", None)
    if head is not None and hasattr(head, "num_things_classes"):
        return {"things": head.num_things_classes, "stuff": head.num_stuff_classes, "masks": True}
    head = getattr(model, "bbox_head", None)
    num_classes = getattr(head, "num_classes", 80)
    return {"things": num_classes, "stuff": 0, "masks": hasattr(model, "roi_head") and
            getattr(model.roi_head, "with_mask", False)}


def make_batch(model, batch_size: int, height: int, width: int, num_gts: int, seed: int) -> dict:
    """A packed batch as mmdet's dataloader yields it: uint8 images and DetDataSamples with random targets.

    Boxes are random xyxy boxes of 5-50% of the image side; masks (MaskFormer-style models) fill each box's
    inscribed ellipse; panoptic models also get a semantic map of stuff classes.
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
