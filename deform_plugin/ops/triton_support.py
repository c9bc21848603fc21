"""What every op's Triton tier needs from its surroundings: is Triton usable here, and on which device to launch.

Imports torch only: triton itself is imported by the kernel files, never here, so that the ops load on machines
without it.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
from typing import Optional

import torch

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


def launch_device(tensor: torch.Tensor):
    """A context that makes ``tensor``'s CUDA device current for a launch (a no-op where it already is).

    Triton launches on the current CUDA device, which need not be the tensors' device: a tensor on ``cuda:1`` would
    otherwise be read by a kernel on ``cuda:0``. Switching devices costs host time, so only when needed.
    """
    if tensor.is_cuda and tensor.device.index != torch.cuda.current_device():
        return torch.cuda.device(tensor.device)
    return contextlib.nullcontext()


def next_power_of_2(n: int) -> int:
    # Plain Python: triton.next_power_of_2 is patched (and slow) under the interpreter, and this runs every call.
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
