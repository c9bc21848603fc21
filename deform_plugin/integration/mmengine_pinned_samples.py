"""Data samples pinned by the data loader: ``pin_memory=True`` then reaches the targets, not only the images.

torch's ``DataLoader(pin_memory=True)`` pins what it recognises: tensors, mappings, sequences and objects with a
``pin_memory()`` method. mmengine's data elements (mmdet's ``DetDataSample`` and the ``InstanceData`` and
``PixelData`` inside it) have no such method, so the loader pins the images and leaves every tensor of the targets
in pageable memory. The data preprocessor's copy of a large pageable tensor then blocks the host, ``non_blocking``
or not, until the GPU has run all the work queued before it: in a Mask2Former panoptic bf16 step on an H200 the host
waited 26 ms in the copy of a 4 MB semantic map while the previous step's backward ran, and the GPU then waited for
the host's preprocessing (a profile through mmengine's Runner; docs/results.md).

:func:`install_data_element_pinning` gives ``BaseDataElement`` a ``pin_memory()``: a new element of the same type
with the same metainfo, whose tensors (in nested elements too) are pinned copies; other values (mmdet's
``BitmapMasks``, numpy arrays, lists) stay the same objects. It only adds a method that mmengine lacks, so loaders
without ``pin_memory`` never call it, and the values the preprocessor receives are the same.
"""
from __future__ import annotations

import torch

def pinned_data_element(element):
    """``element`` (an mmengine ``BaseDataElement``) with every CPU tensor it holds, nested elements included, in
    pinned memory; metainfo and other values as they are. ``element`` itself is left unchanged."""
    from mmengine.structures import BaseDataElement

    pinned = element.new()
    for key, value in element.items():
        if isinstance(value, torch.Tensor) and value.device.type == "cpu" and not value.is_pinned():
            pinned.set_data({key: value.pin_memory()})
        elif isinstance(value, BaseDataElement):
            pinned.set_data({key: pinned_data_element(value)})
    return pinned


def install_data_element_pinning() -> bool:
    """Give mmengine's ``BaseDataElement`` a ``pin_memory()`` (:func:`pinned_data_element`) where it has none;
    returns whether this call added it. Idempotent."""
    from mmengine.structures import BaseDataElement

    if hasattr(BaseDataElement, "pin_memory"):
        return False
    BaseDataElement.pin_memory = pinned_data_element
    return True
