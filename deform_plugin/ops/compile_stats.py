"""How many variants of our Triton kernels this process has compiled (or, under the interpreter, would compile).

Triton compiles one binary per *specialisation key* of a launch: the constexpr values, each argument's dtype, and
for every integer and pointer argument not marked ``do_not_specialize`` its value class (divisible by 16, equal to
1) and alignment. A kernel whose key follows the image size recompiles on new sizes; ours must not.

- :func:`compiled_variants` reads the JIT caches of the compiled kernels (on a GPU);
- :func:`launch_key` computes the key a launch would compile under, with Triton's own specialisation code and no
  GPU, so CPU tests can count the variants the interpreter's launches would have compiled.
"""
from __future__ import annotations

import inspect
from typing import Dict

import torch

__all__ = ["compiled_variants", "launch_key", "triton_kernels"]


def triton_kernels() -> Dict[str, object]:
    """Every Triton kernel of deform_plugin's ops, by name (the JIT functions, not their autotuned wrappers)."""
    from .deform_sdpa import triton_kernels as sdpa_kernels
    from .msda import triton_kernels as msda_kernels
    return {
        "msda_forward": msda_kernels.msda_forward_kernel,
        "msda_backward": msda_kernels.msda_backward_kernel,
        "msda_grad_value_segments": msda_kernels.msda_grad_value_segments_kernel,
        "deform_sdpa_forward": sdpa_kernels.deform_sdpa_forward_kernel,
        "deform_sdpa_backward": sdpa_kernels.deform_sdpa_backward_kernel,
    }


def compiled_variants() -> Dict[str, int]:
    """Compiled binaries per kernel in this process, over all devices (0 for every kernel under the interpreter)."""
    counts = {}
    for name, kernel in triton_kernels().items():
        caches = getattr(kernel, "device_caches", None) or {}
        counts[name] = sum(len(entry[0]) for entry in caches.values())
    return counts


def launch_key(kernel, *args, **kwargs) -> str:
    """The specialisation key under which Triton would compile ``kernel[grid](*args, **kwargs)``.

    Computed with Triton's own binder and specialisation code for a generic backend, so it needs no GPU; launch
    options (``num_warps``, ...) are part of the key, as they are in Triton's cache.
    """
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    fn = getattr(kernel, "fn", kernel)
    while not inspect.isfunction(fn):
        fn = fn.fn
    options = getattr(kernel, "kwargs", None) or {}  # an InterpretedFunction keeps its decorator options here
    jit = kernel if isinstance(kernel, JITFunction) else JITFunction(
        fn, do_not_specialize=options.get("do_not_specialize"),
        do_not_specialize_on_alignment=options.get("do_not_specialize_on_alignment"))
    binder = create_function_from_signature(jit.signature, jit.params, BaseBackend)
    host_args = [_as_specializable(a) for a in args]
    host_kwargs = {k: _as_specializable(v) for k, v in kwargs.items()}
    _, specialization, launch_options = binder(*host_args, **host_kwargs)
    return str(specialization) + str(sorted(launch_options.items()))


def _as_specializable(arg):
    # Triton reads a tensor's dtype and data_ptr() alignment; a CPU tensor answers both like a CUDA one.
    return arg if not isinstance(arg, torch.Tensor) else arg.detach()
