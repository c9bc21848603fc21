"""Record the calls of a piece of code that would make the host wait for a GPU, on any device (CPU tests included).

On a GPU, these block the host until all queued work is done: reading a device value on the host (``.item()``,
``bool()``, ``int()``, ``.tolist()``, ``.cpu()``, ``nonzero()``, ``unique()``, boolean-mask selection) and building
a device tensor from Python numbers (``tensor.new_tensor([...])``, ``torch.tensor(..., device=...)``, indexing with
a Python list such as ``x[[2, 1, 0]]``: a blocking copy from pageable memory). Run on CPU tensors the same calls
are made, so a CPU test can count them: each recorded call names the Python function that made it, with the
operation.
"""
from __future__ import annotations

import traceback
from typing import List, Tuple

import torch
from torch.overrides import TorchFunctionMode

READS = {torch.Tensor.item: "item", torch.Tensor.tolist: "tolist", torch.Tensor.__bool__: "bool",
         torch.Tensor.__int__: "int", torch.Tensor.__float__: "float", torch.Tensor.__index__: "index",
         torch.Tensor.nonzero: "nonzero", torch.nonzero: "nonzero", torch.Tensor.unique: "unique",
         torch.unique: "unique", torch.Tensor.cpu: "cpu", torch.masked_select: "masked_select",
         torch.Tensor.masked_select: "masked_select"}
FROM_HOST = {torch.Tensor.new_tensor: "new_tensor"}
DEVICE_FROM_HOST = {torch.tensor: "tensor", torch.as_tensor: "as_tensor"}  # only with a device argument


class HostTransferSpy(TorchFunctionMode):
    """``with HostTransferSpy() as spy: ...`` then ``spy.calls``: ``(operation, caller)`` pairs, the caller being the
    innermost Python function outside torch that made the call."""

    def __init__(self):
        super().__init__()
        self.calls: List[Tuple[str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        operation = READS.get(func) or FROM_HOST.get(func)
        if operation is None and func in DEVICE_FROM_HOST and kwargs.get("device") is not None:
            operation = DEVICE_FROM_HOST[func]
        if (operation is None and func is torch.Tensor.__getitem__ and len(args) > 1
                and isinstance(args[1], torch.Tensor) and args[1].dtype == torch.bool):
            operation = "boolean_mask_index"
        if operation is None and func is torch.Tensor.__getitem__ and len(args) > 1 and _has_list(args[1]):
            operation = "list_index"
        if operation is not None:
            self.calls.append((operation, _caller()))
        return func(*args, **kwargs)


def _has_list(index) -> bool:
    return isinstance(index, list) or (isinstance(index, tuple) and any(isinstance(i, list) for i in index))


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()):
        if "/torch/" not in frame.filename and not frame.filename.endswith("host_transfers.py"):
            return frame.name
    return "?"


def cuda_syncs_of(work) -> int:
    """How many host syncs ``work()`` makes on CUDA (after a warm-up call), counted by the sync debug mode."""
    import warnings
    work()  # warm-up
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            work()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)
