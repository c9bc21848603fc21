"""Batch-1 images reach the GPU through a reusable pinned buffer instead of a copy from pageable memory.

mmengine's data preprocessor moves each image tensor with ``tensor.to(device)``. ``inference_detector`` hands it a
fresh CPU tensor per image (the test pipeline's output), so the copy runs from pageable memory: the CUDA driver
stages it through its own small pinned buffers, chunk by chunk, and the call waits for all of it (and, without
``non_blocking``, for the stream). This module gives a preprocessor instance a ``cast_data`` that first copies each
CPU image into a pinned buffer kept for the purpose (one host memcpy), then sends it with one asynchronous copy. The
values are the same bytes; only the route changes. Everything else in the data (the data samples) goes through
mmengine's own ``cast_data``.

The buffer is reused by the next call only after the copy that read it has finished (an event recorded after the
copy), so a caller that does not synchronise between images never has its image overwritten in flight.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import List, Optional

import torch


class PinnedInputStaging:
    """The ``cast_data`` of one data preprocessor, with its image tensors staged through pinned host memory.

    Use :func:`stage_inputs_through_pinned_memory` to install it.
    """

    def __init__(self, preprocessor):
        self.preprocessor = preprocessor
        self.mmengine_cast_data = type(preprocessor).cast_data.__get__(preprocessor)
        self.buffers: List[torch.Tensor] = []  # uint8 pinned buffers, one per image of a batch
        self.copied: List[Optional[torch.cuda.Event]] = []
        self.staged_images = 0

    def _stage(self, index: int, image: torch.Tensor, device: torch.device) -> torch.Tensor:
        if image.is_pinned():  # a data loader with pin_memory=True did it already
            return image.to(device, non_blocking=True)
        nbytes = image.numel() * image.element_size()
        while len(self.buffers) <= index:
            self.buffers.append(torch.empty(0, dtype=torch.uint8))
            self.copied.append(None)
        if self.copied[index] is not None:
            self.copied[index].synchronize()  # the previous image's copy has read the buffer
        if self.buffers[index].numel() < nbytes:
            self.buffers[index] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        host = self.buffers[index][:nbytes].view(image.dtype).view(image.shape)
        host.copy_(image)
        on_device = host.to(device, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        self.copied[index] = event
        self.staged_images += 1
        return on_device

    def __call__(self, data):
        device = torch.device(self.preprocessor.device)
        if device.type != "cuda" or not isinstance(data, Mapping):
            return self.mmengine_cast_data(data)
        inputs = data.get("inputs")
        if not (isinstance(inputs, (list, tuple)) and inputs
                and all(isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.is_contiguous() for x in inputs)):
            return self.mmengine_cast_data(data)
        staged = [self._stage(index, image, device) for index, image in enumerate(inputs)]
        rest = self.mmengine_cast_data({key: value for key, value in data.items() if key != "inputs"})
        return {key: (staged if key == "inputs" else rest[key]) for key in data}


def stage_inputs_through_pinned_memory(preprocessor) -> PinnedInputStaging:
    """Give ``preprocessor`` (an mmengine ``BaseDataPreprocessor`` instance) the pinned route for its images (see
    the module); returns the installed :class:`PinnedInputStaging` (installing twice returns the first)."""
    current = preprocessor.__dict__.get("cast_data")
    if isinstance(current, PinnedInputStaging):
        return current
    staging = PinnedInputStaging(preprocessor)
    preprocessor.cast_data = staging
    return staging
