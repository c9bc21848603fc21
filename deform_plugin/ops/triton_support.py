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

from .background_compile import wait_for_background_compile

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
    return device_of_launch(tensor.device)


def device_of_launch(device: torch.device):
    """:func:`launch_device` for a launch whose tensors are on ``device``."""
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return _NO_SWITCH


# One shared no-op context: entering it twice is harmless, and making one per launch costs host time.
_NO_SWITCH = contextlib.nullcontext()


def data_pointers(tensors) -> tuple:
    """The tensors' data pointers, in order."""
    return tuple([tensor.data_ptr() for tensor in tensors])


def alignment_bits(pointers) -> int:
    """One bit per pointer: whether it is 16-byte aligned (Triton compiles a variant per answer)."""
    bits = 0
    for pointer in pointers:
        bits = (bits << 1) | (pointer % 16 == 0)
    return bits


def _hook_set(hook) -> bool:
    # Triton keeps its launch hooks in chains (empty unless a profiler adds one); a plain callable may be set too.
    return hook is not None and bool(getattr(hook, "calls", True))


class DirectLaunches:
    """Launches of one Triton kernel that skip Triton's per-call argument binding once a variant has been launched.

    ``kernel[grid](*args)`` binds and specialises every argument on every call, which for a kernel of twenty
    arguments costs more host time than a small launch itself. The caller knows which properties of its arguments
    select the compiled variant (tensor dtypes, 16-byte pointer alignment, the values of specialised integers and of
    constexprs, whether an unspecialised integer fits 32 bits, launch options) and passes them as ``variant``. The
    first launch of a variant goes through Triton (compiling if needed) and keeps the compiled kernel; later ones
    call its launcher with the same arguments, as Triton's own ``run`` does. A ``variant`` must tell apart every
    pair of calls that Triton would compile apart; finer is harmless (one more launch through Triton).

    Under the interpreter, on CPU tensors and while a Triton launch hook is set (profilers use them), every launch
    goes through Triton. A launch through Triton first waits for a background worker that compiles its variant,
    where one was started (:mod:`deform_plugin.ops.background_compile`).
    """

    def __init__(self, kernel):
        self.kernel = kernel
        self._variants: dict = {}
        self._runtime_knobs = None

    def launch(self, grid, variant, device: torch.device, tensors: tuple, pointers: tuple, scalars: tuple,
               num_warps: int, num_stages: int) -> None:
        """``kernel[grid](*tensors, *scalars, num_warps=..., num_stages=...)``: the kernel's pointer parameters
        first (``tensors``, with ``pointers`` their :func:`data_pointers`), then the rest in signature order,
        constexprs included (``scalars``).

        A direct launch passes the pointers as integers: for a tensor, Triton's launcher calls ``data_ptr()`` and
        asks the driver whether the address is a device pointer (``cuPointerGetAttribute``) on every launch, which
        the first launch of the variant has done already for tensors of the same kind.
        """
        entry = self._variants.get(variant)
        if entry is not None:
            runtime = self._runtime_knobs
            if not _hook_set(runtime.launch_enter_hook) and not _hook_set(runtime.launch_exit_hook):
                run, function, packed_metadata = entry
                stream = torch._C._cuda_getCurrentRawStream(device.index)
                run(grid[0], grid[1], grid[2], stream, function, packed_metadata, None, None, None, *pointers,
                    *scalars)
                return
        # A variant this process has not loaded yet may be compiling in a background worker: wait for it rather
        # than compile it a second time beside it (a dict lookup where no worker was started).
        wait_for_background_compile(self.kernel, tensors, scalars, num_warps, num_stages)
        compiled = self.kernel[grid](*tensors, *scalars, num_warps=num_warps, num_stages=num_stages)
        if device.type == "cuda" and not triton_interpreter_enabled() and hasattr(compiled, "packed_metadata"):
            from triton import knobs  # kept, so that a direct launch runs no import statement
            self._runtime_knobs = knobs.runtime
            self._variants[variant] = (compiled.run, compiled.function, compiled.packed_metadata)


def warm_up_triton() -> None:
    """The host work that a process's first Triton launch does once, done now: hashing Triton's own sources and
    shared library (the compilation cache's key: ~0.35 s on an H200 host, mostly in ``hashlib``, which releases the
    GIL) and importing the modules that the compiler imports lazily (~0.1 s). Both are cached where the launch path
    finds them. Safe on any thread."""
    from triton.runtime.cache import triton_key
    triton_key()
    import triton.experimental.gluon.language  # noqa: F401  (the code generator imports it at a compile)


def next_power_of_2(n: int) -> int:
    # Plain Python: triton.next_power_of_2 is patched (and slow) under the interpreter, and this runs every call.
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
