"""The level tables on the host, read at most once per tensor, and tables made on the host that are never read.

``spatial_shapes`` and ``level_start_index`` live on the device (the kernels read them there), but validation
and the reference path need their values on the host, and reading a CUDA tensor waits for every queued kernel. A
table tensor is therefore read at most once, the first time that tensor object (at that version) is seen; later
calls with the same tensor reuse the host copy, so a steady-state call never waits for the device, and a call whose
tables were seen before can be captured in a CUDA graph. mmdet builds the tables once per forward and passes the
same tensors to every layer: one read per table per forward. :func:`make_level_tables` removes even that one: it
builds the tables from host sizes, copies them without blocking, and records their host values, so they are
never read at all; it returns the same tensors for the same sizes. Inside a CUDA-graph capture, which cannot copy
from the host, it writes the values with captured kernels instead (replays write them again) and keeps nothing.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Dict, Sequence, Tuple

import torch

# Distinct image-size buckets kept (a training run with random resizing meets a few hundred).
_MADE_TABLES_KEPT = 512


class _HostCopies:
    """Host copies of small device tensors, keyed by tensor object and version, dropped when the tensor dies.

    Keyed by ``id`` with a weak reference rather than a ``WeakKeyDictionary``: tensors compare elementwise, so they
    cannot be dictionary keys that are compared by ``==``.
    """

    def __init__(self):
        self._entries: Dict[int, Tuple[weakref.ref, int, tuple]] = {}
        self.reads = 0

    def get(self, tensor: torch.Tensor, name: str) -> tuple:
        key = id(tensor)
        entry = self._entries.get(key)
        if entry is not None and entry[0]() is tensor and entry[1] == tensor._version:
            return entry[2]
        if tensor.is_cuda and torch.cuda.is_current_stream_capturing():
            raise ValueError(f"{name} is a tensor this op has not validated yet, and a CUDA graph is being captured, "
                             "where it cannot be read: run the call once outside the capture first (the usual "
                             "warm-up), so that the capture reuses the validated tables")
        values = tuple(tuple(row) if isinstance(row, list) else row for row in tensor.tolist())
        self.reads += 1
        self.record(tensor, values)
        return values

    def record(self, tensor: torch.Tensor, values: tuple) -> None:
        """Remember ``values`` as the host copy of ``tensor`` (which must hold exactly those values)."""
        key = id(tensor)
        entries = self._entries
        entries[key] = (weakref.ref(tensor, lambda _, key=key: entries.pop(key, None)), tensor._version, values)


_host_copies = _HostCopies()
_made_tables: "OrderedDict[tuple, Tuple[torch.Tensor, torch.Tensor]]" = OrderedDict()


def level_table_host_reads() -> int:
    """How many times a level table has been read on the host in this process (each read may wait for the GPU)."""
    return _host_copies.reads


def host_level_tables(spatial_shapes: torch.Tensor, level_start_index: torch.Tensor
                      ) -> Tuple[Tuple[Tuple[int, int], ...], Tuple[int, ...]]:
    """``((h, w) per level, start per level)`` on the host, reading each table tensor at most once."""
    return (_host_copies.get(spatial_shapes, "spatial_shapes"),
            _host_copies.get(level_start_index, "level_start_index"))


def host_spatial_shapes(spatial_shapes: torch.Tensor) -> Tuple[Tuple[int, int], ...]:
    """``(h, w)`` per level on the host, reading the tensor at most once."""
    return _host_copies.get(spatial_shapes, "spatial_shapes")


def make_level_tables(level_sizes: Sequence[Sequence[int]], device: torch.device
                      ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(spatial_shapes, level_start_index)`` int64 tensors on ``device`` for levels of ``(h, w)`` sizes.

    Made from host numbers and copied without blocking; the op knows their values without reading them. The same
    sizes on the same device give the same tensor objects again (do not modify them in place).
    """
    shapes = tuple((int(h), int(w)) for h, w in level_sizes)
    key = (shapes, torch.device(device))
    tables = _made_tables.get(key)
    if tables is not None:
        _made_tables.move_to_end(key)
        return tables
    starts, offset = [], 0
    for height, width in shapes:
        starts.append(offset)
        offset += height * width
    values = [value for shape in shapes for value in shape] + starts
    capturing = _in_graph_capture(key[1])
    flat = _filled_on_device(values, key[1]) if capturing else _copied_to_device(values, key[1])
    spatial_shapes, level_start_index = flat[:2 * len(shapes)].view(-1, 2), flat[2 * len(shapes):]
    _host_copies.record(spatial_shapes, shapes)
    _host_copies.record(level_start_index, tuple(starts))
    if not capturing:
        # Tables made in a capture are written only when the graph replays: an eager call must not find them.
        _made_tables[key] = (spatial_shapes, level_start_index)
        if len(_made_tables) > _MADE_TABLES_KEPT:
            _made_tables.popitem(last=False)
    return spatial_shapes, level_start_index


def _in_graph_capture(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _copied_to_device(values: Sequence[int], device: torch.device) -> torch.Tensor:
    host = torch.tensor(values, dtype=torch.int64)
    if device.type == "cuda":
        # Pinned memory lets the copy run asynchronously; the caching host allocator keeps the buffer alive until
        # the copy has completed.
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _filled_on_device(values: Sequence[int], device: torch.device) -> torch.Tensor:
    # One fill kernel per value: their arguments hold the values, so a graph captures them (a dozen tiny nodes).
    flat = torch.empty(len(values), dtype=torch.int64, device=device)
    for i, value in enumerate(values):
        flat[i].fill_(value)
    return flat
