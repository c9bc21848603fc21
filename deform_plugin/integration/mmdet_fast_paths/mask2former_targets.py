"""Mask2Former's ground truth made without waiting for the GPU (``batched_matching`` on its head, with its losses).

mmdet 3.3.0's ``MaskFormerHead.preprocess_gt`` runs ``preprocess_panoptic_gt`` on each image: the thing masks reach
the device through ``BitmapMasks.to_tensor``, a copy from pageable memory that first waits for all queued GPU work,
and for panoptic training the stuff classes of the semantic map are found with ``torch.unique`` (its size is read
on the host) and then tested one by one against the class ranges (a host read each): some 2 + 2 * (classes in the
map) waits per image, each draining the GPU's queue.

Here the stuff classes of every image of the batch are found on the device in one pass (which of the stuff classes
each image's map holds), copied to pinned host memory without blocking, and read once an event says the copy is
done: the host waits for the work queued before that copy, not for what comes after it. With ``cuda_graphs`` the
copy is queued before the graphed network's forward (the region's inputs call :func:`copy_stuff_classes_ahead`), so
the host waits for the batch's own copy to the device and the flags, not for the forward; run eagerly after the
forward, the one wait replaces mmdet's many. The thing masks go to
the device from pinned memory without blocking. The same labels, masks, dtypes and order as mmdet's: things, then
the stuff classes in ascending order, as ``torch.unique`` returns them.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np
import torch

from .matching import _to_device_without_blocking


def _stuff_flags(sem_segs: Sequence[torch.Tensor], num_things: int, num_stuff: int) -> torch.Tensor:
    """``(images, num_stuff)`` bool on the maps' device: whether each map holds each stuff class."""
    columns = num_stuff + 1  # the last one takes every other value (things, void, padding)
    indices = []
    for row, sem_seg in enumerate(sem_segs):
        stuff = sem_seg.reshape(-1).long() - num_things
        stuff = torch.where((stuff >= 0) & (stuff < num_stuff), stuff, num_stuff)
        indices.append(stuff + row * columns)
    flags = torch.zeros(len(sem_segs) * columns, dtype=torch.bool, device=sem_segs[0].device)
    flags.index_fill_(0, torch.cat(indices), True)
    return flags.view(len(sem_segs), columns)[:, :num_stuff]


class StuffClassesOnHost:
    """The stuff classes each semantic map of a batch holds, on their way to the host.

    Built from the batch's maps (``None`` for an image without one), it queues the search and the copy; the first
    :meth:`per_image` waits for that copy only (on the CPU there is nothing to wait for).
    """

    def __init__(self, sem_segs: Sequence[Optional[torch.Tensor]], num_things: int, num_stuff: int):
        self.sem_segs = list(sem_segs)
        self.num_things = num_things
        self._rows = [i for i, sem_seg in enumerate(self.sem_segs) if sem_seg is not None]
        self._flags: Optional[torch.Tensor] = None
        self._copied: Optional[torch.cuda.Event] = None
        if not self._rows or num_stuff == 0:
            return
        flags = _stuff_flags([self.sem_segs[i] for i in self._rows], num_things, num_stuff)
        if flags.device.type == "cuda":
            self._flags = torch.empty(flags.shape, dtype=torch.bool, pin_memory=True)
            self._flags.copy_(flags, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            self._flags = flags

    def belongs_to(self, sem_segs: Sequence[Optional[torch.Tensor]]) -> bool:
        """Whether these are the maps this was made from (the same tensors, not equal ones)."""
        return len(sem_segs) == len(self.sem_segs) and all(a is b for a, b in zip(sem_segs, self.sem_segs))

    def per_image(self) -> List[Optional[np.ndarray]]:
        """Each image's stuff labels (ascending, int64), or None where it has no map."""
        found: List[Optional[np.ndarray]] = [None] * len(self.sem_segs)
        if self._copied is not None:
            self._copied.synchronize()
        flags = None if self._flags is None else self._flags.numpy()
        for position, image in enumerate(self._rows):
            found[image] = (np.zeros(0, dtype=np.int64) if flags is None
                            else np.flatnonzero(flags[position]).astype(np.int64) + self.num_things)
        return found


def _semantic_maps(batch_gt_semantic_segs) -> List[Optional[torch.Tensor]]:
    return [None if seg is None else seg.sem_seg for seg in batch_gt_semantic_segs]


def copy_stuff_classes_ahead(head, batch_data_samples) -> None:
    """Queue the search and host copy of the batch's stuff classes now, for the head's next ``preprocess_gt`` on
    these samples (where no sample has a semantic map, nothing is queued)."""
    sem_segs = _semantic_maps([sample.gt_sem_seg if "gt_sem_seg" in sample else None
                               for sample in batch_data_samples])
    if any(sem_seg is not None for sem_seg in sem_segs):
        head._stuff_classes_ahead = StuffClassesOnHost(sem_segs, head.num_things_classes, head.num_stuff_classes)


def _thing_masks(masks, device: torch.device) -> torch.Tensor:
    """``masks.to_tensor(dtype=torch.bool, device=device)``; a ``BitmapMasks`` copied from pinned memory without
    blocking (another mask type converts itself)."""
    from mmdet.structures.mask import BitmapMasks
    if type(masks) is not BitmapMasks:
        return masks.to_tensor(dtype=torch.bool, device=device)
    return _to_device_without_blocking(torch.from_numpy(np.ascontiguousarray(masks.masks)), device).bool()


def mask2former_preprocess_gt_sync_free(self, batch_gt_instances, batch_gt_semantic_segs):
    """mmdet 3.3.0's ``MaskFormerHead.preprocess_gt`` without host syncs (see the module's docstring)."""
    from mmengine.structures import InstanceData
    sem_segs = _semantic_maps(batch_gt_semantic_segs)
    ahead = self.__dict__.pop("_stuff_classes_ahead", None)
    if ahead is None or not ahead.belongs_to(sem_segs):
        ahead = StuffClassesOnHost(sem_segs, self.num_things_classes, self.num_stuff_classes)
    processed = []
    for gt_instances, sem_seg, stuff in zip(batch_gt_instances, sem_segs, ahead.per_image()):
        labels = gt_instances["labels"]
        masks = _thing_masks(gt_instances["masks"], labels.device)
        if stuff is not None and len(stuff):
            # mmdet stacks elements of torch.unique's output: the stuff labels keep the map's dtype.
            stuff_labels = _to_device_without_blocking(torch.from_numpy(stuff).to(sem_seg.dtype), labels.device)
            stuff_masks = sem_seg.squeeze(0)[None] == stuff_labels[:, None, None]
            labels = torch.cat([labels, stuff_labels])
            masks = torch.cat([masks, stuff_masks])
        processed.append(InstanceData(labels=labels, masks=masks.long()))
    return processed


def enable_mask2former_sync_free_targets(head) -> bool:
    """Give a Mask2Former head with mmdet's own ``preprocess_gt`` the sync-free one (an instance attribute) and
    :func:`copy_stuff_classes_ahead` as ``copy_targets_ahead``; returns whether it changed."""
    from mmdet.models.dense_heads import MaskFormerHead
    if type(head).preprocess_gt is not MaskFormerHead.preprocess_gt or "preprocess_gt" in vars(head):
        return False
    head.preprocess_gt = mask2former_preprocess_gt_sync_free.__get__(head)
    head.copy_targets_ahead = copy_stuff_classes_ahead.__get__(head)
    return True
