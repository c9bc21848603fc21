"""deform_plugin.integration.mmengine_pinned_samples: a loader's pin_memory pins the data samples' tensors (nested
elements included), keeps their metainfo and other values, and leaves the loader's own batch unchanged."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data._utils.pin_memory import pin_memory as loader_pin_memory

import deform_plugin  # noqa: F401  (installs the integration)
from deform_plugin.integration.mmengine_pinned_samples import install_data_element_pinning, pinned_data_element


def _panoptic_sample():
    from mmdet.structures import DetDataSample
    from mmdet.structures.mask import BitmapMasks
    from mmengine.structures import InstanceData, PixelData

    sample = DetDataSample(metainfo=dict(img_shape=(6, 8), pad_shape=(8, 8), img_id=3))
    masks = BitmapMasks(np.ones((2, 6, 8), dtype=np.uint8), 6, 8)
    sample.gt_instances = InstanceData(bboxes=torch.tensor([[0.0, 0.0, 4.0, 3.0], [1.0, 1.0, 7.0, 5.0]]),
                                       labels=torch.tensor([1, 4]), masks=masks)
    sample.gt_sem_seg = PixelData(sem_seg=torch.arange(48, dtype=torch.int32).view(1, 6, 8))
    return sample, masks


@pytest.fixture
def fake_pinning(monkeypatch):
    """Tensor.pin_memory as a recorded copy: pinning needs a GPU, what is pinned does not."""
    pinned = []

    def pin(tensor, *args, **kwargs):
        copy = tensor.clone()
        pinned.append(copy)
        return copy
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    return pinned


def test_the_loaders_pinning_reaches_every_tensor_of_the_targets(fake_pinning):
    from mmdet.structures import DetDataSample
    sample, masks = _panoptic_sample()
    image = torch.zeros(3, 6, 8, dtype=torch.uint8)
    batch = loader_pin_memory({"inputs": [image], "data_samples": [sample]})
    out = batch["data_samples"][0]
    assert isinstance(out, DetDataSample) and out is not sample
    assert dict(out.metainfo_items()) == dict(sample.metainfo_items())
    targets = (out.gt_instances.bboxes, out.gt_instances.labels, out.gt_sem_seg.sem_seg)
    originals = (sample.gt_instances.bboxes, sample.gt_instances.labels, sample.gt_sem_seg.sem_seg)
    assert len(fake_pinning) == 4  # the image, then the three target tensors
    for pinned, original in zip(targets, originals):
        assert any(pinned is copy for copy in fake_pinning)
        assert pinned is not original and torch.equal(pinned, original)
    assert out.gt_instances.masks is masks  # not a tensor: the same object
    assert dict(out.gt_sem_seg.metainfo_items()) == dict(sample.gt_sem_seg.metainfo_items())
    # The loader's batch itself is left as it was.
    assert not any(original is copy for original in originals for copy in fake_pinning)


def test_pinned_tensors_are_not_pinned_again(fake_pinning, monkeypatch):
    sample, _ = _panoptic_sample()
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda tensor, *args: True)
    out = pinned_data_element(sample)
    assert fake_pinning == [] and out.gt_sem_seg.sem_seg is sample.gt_sem_seg.sem_seg


def test_installed_once_on_mmengines_data_elements():
    from mmengine.structures import BaseDataElement
    assert BaseDataElement.pin_memory is pinned_data_element
    assert install_data_element_pinning() is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory needs a CUDA device")
def test_the_targets_are_pinned_for_real():
    sample, _ = _panoptic_sample()
    out = loader_pin_memory([sample])[0]
    assert out.gt_sem_seg.sem_seg.is_pinned() and out.gt_instances.bboxes.is_pinned()
    assert not sample.gt_sem_seg.sem_seg.is_pinned()
