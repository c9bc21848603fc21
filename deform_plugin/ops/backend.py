"""Which implementation runs an op: a per-call choice, a process-wide default, and a backend table per op.

Built-in backends, offered by every op:
    ``'auto'``    Triton for CUDA tensors, the PyTorch reference elsewhere;
    ``'triton'``  our fused Triton kernels (CUDA, or the CPU interpreter when ``TRITON_INTERPRET=1``);
    ``'pytorch'`` our pure-PyTorch reference (any device, float64-capable).

Other backends are registered into one op's table by the layer that knows them (:func:`register_backend`): the
integration layer registers mmcv's stock CUDA kernel as MSDA's ``'mmcv'`` backend. The ops themselves import only
torch and triton.

The default is ``'auto'``; change it with :func:`set_default_backend`, the :func:`default_backend` context
manager, or the environment variable ``DEFORM_PLUGIN_BACKEND`` (read at the first call; empty means unset). A
default that an op does not offer (``'mmcv'`` for deform_sdpa) counts as ``'auto'`` for that op.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, Optional, Tuple

import torch

from .triton_support import triton_unavailable_reason

BUILTIN_BACKENDS = ("auto", "triton", "pytorch")
BACKEND_ENV = "DEFORM_PLUGIN_BACKEND"


@dataclass(frozen=True)
class RegisteredBackend:
    """A backend an op gained from outside: its implementation and why it cannot run on a device (None: it can)."""

    implementation: Callable
    unavailable_reason: Callable[[torch.device], Optional[str]]


_REGISTERED: Dict[str, Dict[str, RegisteredBackend]] = {}


def register_backend(op: str, name: str, implementation: Callable,
                     unavailable_reason: Callable[[torch.device], Optional[str]]) -> None:
    """Add backend ``name`` to op ``op``'s table (idempotent: registering again replaces the entry)."""
    if name in BUILTIN_BACKENDS:
        raise ValueError(f"backend name {name!r} is built in and cannot be registered")
    _REGISTERED.setdefault(op, {})[name] = RegisteredBackend(implementation, unavailable_reason)


def backend_names(op: str) -> Tuple[str, ...]:
    """Every backend name ``op`` accepts: the built-in ones, then those registered for it."""
    return BUILTIN_BACKENDS + tuple(_REGISTERED.get(op, {}))


def registered_backend(op: str, name: str) -> RegisteredBackend:
    return _REGISTERED[op][name]


def _all_backend_names() -> Tuple[str, ...]:
    names = list(BUILTIN_BACKENDS)
    for table in _REGISTERED.values():
        names.extend(n for n in table if n not in names)
    return tuple(names)


def _validated_default(name: str, source: str) -> str:
    names = _all_backend_names()
    if name not in names:
        raise ValueError(f"{source} = {name!r} is not a backend: choose one of {', '.join(map(repr, names))}")
    return name


_UNSET = object()
_default_backend = _UNSET


def get_default_backend() -> str:
    """The process-wide default backend (``'auto'`` unless changed)."""
    global _default_backend
    if _default_backend is _UNSET:
        # Read at the first call rather than at import, so backends registered by the integration layer are known.
        from_env = os.environ.get(BACKEND_ENV, "").strip()
        _default_backend = _validated_default(from_env, f"environment variable {BACKEND_ENV}") if from_env else "auto"
    return _default_backend


def set_default_backend(name: str) -> None:
    """Set the process-wide default backend used where a call or module passes ``backend=None``."""
    global _default_backend
    _default_backend = _validated_default(name, "default backend")


@contextlib.contextmanager
def default_backend(name: str) -> Iterator[None]:
    """Temporarily change the default backend: ``with default_backend('pytorch'): model(x)``."""
    global _default_backend
    previous = get_default_backend()
    _default_backend = _validated_default(name, "default backend")
    try:
        yield
    finally:
        _default_backend = previous


def validate_backend_name(op: str, name: Optional[str]) -> Optional[str]:
    """``name`` if ``op`` offers it (None stays None), else a ValueError listing the op's backends."""
    if name is not None and name not in backend_names(op):
        raise ValueError(f"{op} has no backend {name!r}: choose one of {', '.join(map(repr, backend_names(op)))} "
                         "or None for the process default")
    return name


def resolve_backend(op: str, name: Optional[str], device: torch.device) -> str:
    """Turn ``None``/``'auto'`` into a concrete backend of ``op`` for ``device``; raise if it cannot run there."""
    if name is None:
        name = get_default_backend()
        if name not in backend_names(op):
            name = "auto"
    else:
        validate_backend_name(op, name)
    if name == "auto":
        return "triton" if device.type == "cuda" and triton_unavailable_reason(device) is None else "pytorch"
    if name == "triton":
        reason = triton_unavailable_reason(device)
        if reason is not None:
            raise RuntimeError(f"backend='triton' cannot run: {reason}")
    elif name != "pytorch":
        reason = registered_backend(op, name).unavailable_reason(device)
        if reason is not None:
            raise RuntimeError(reason)
    return name
