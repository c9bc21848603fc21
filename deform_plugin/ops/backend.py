"""Which implementation runs an op: a per-call choice, a process-wide default, and availability checks.

Backends:
    ``'auto'``    Triton for CUDA tensors, the PyTorch reference elsewhere;
    ``'triton'``  our fused Triton kernels (CUDA, or the CPU interpreter when ``TRITON_INTERPRET=1``);
    ``'pytorch'`` our pure-PyTorch reference (any device, float64-capable);
    ``'mmcv'``    mmcv's stock CUDA kernel, only where mmcv was built with its compiled ops.

The default is ``'auto'``; change it with :func:`set_default_backend`, the :func:`default_backend` context
manager, or the environment variable ``DEFORM_PLUGIN_BACKEND`` (read once, at import).
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
from typing import Iterator, Optional

import torch

BACKENDS = ("auto", "triton", "pytorch", "mmcv")


def _validated(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}: choose one of {', '.join(map(repr, BACKENDS))}")
    return name


_default_backend = _validated(os.environ.get("DEFORM_PLUGIN_BACKEND", "auto"))


def get_default_backend() -> str:
    """The process-wide default backend (``'auto'`` unless changed)."""
    return _default_backend


def set_default_backend(name: str) -> None:
    """Set the process-wide default backend used where a call or module passes ``backend=None``."""
    global _default_backend
    _default_backend = _validated(name)


@contextlib.contextmanager
def default_backend(name: str) -> Iterator[None]:
    """Temporarily change the default backend: ``with default_backend('pytorch'): model(x)``."""
    global _default_backend
    previous = _default_backend
    _default_backend = _validated(name)
    try:
        yield
    finally:
        _default_backend = previous


# Looked up once: torch.compile cannot trace importlib calls made on every op call.
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def triton_interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_unavailable_reason(device: torch.device) -> Optional[str]:
    """Why the Triton kernels cannot run on ``device``, or None when they can."""
    if not _TRITON_INSTALLED:
        return "the triton package is not installed (pip install triton)"
    if device.type == "cuda":
        return None
    if device.type == "cpu" and triton_interpreter_enabled():
        return None
    return (f"the Triton kernels need a CUDA device, got tensors on {device}; on a CPU they run only under the "
            "Triton interpreter (set TRITON_INTERPRET=1 before importing triton)")


def mmcv_ops_unavailable_reason(device: torch.device) -> Optional[str]:
    """Why mmcv's stock compiled MSDA kernel cannot run on ``device``, or None when it can."""
    from deform_plugin.integration.mmcv_ext import compiled_mmcv_ops_available
    if not compiled_mmcv_ops_available():
        return ("backend='mmcv' needs mmcv built with its compiled ops (mmcv._ext), but this environment has none "
                "(mmcv-lite or no mmcv): install mmcv 2.1.0 with ops (MMCV_WITH_OPS=1 pip install mmcv==2.1.0) "
                "or choose backend='triton' / 'pytorch'")
    if device.type != "cuda":
        return f"backend='mmcv' runs mmcv's CUDA kernel and needs CUDA tensors, got tensors on {device}"
    return None


def resolve_backend(name: Optional[str], device: torch.device) -> str:
    """Turn ``None``/``'auto'`` into a concrete backend for tensors on ``device``; raise if it cannot run there."""
    name = get_default_backend() if name is None else _validated(name)
    if name == "auto":
        return "triton" if device.type == "cuda" and triton_unavailable_reason(device) is None else "pytorch"
    if name == "triton":
        reason = triton_unavailable_reason(device)
        if reason is not None:
            raise RuntimeError(f"backend='triton' cannot run: {reason}")
    elif name == "mmcv":
        reason = mmcv_ops_unavailable_reason(device)
        if reason is not None:
            raise RuntimeError(reason)
    return name
