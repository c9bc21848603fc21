"""Where the op tests run their Triton kernels (the GPU, else Triton's interpreter on the CPU), the marks that skip
what cannot run here, and the poisoning of fresh allocations that catches an element a kernel never writes.

tests/conftest.py sets ``TRITON_INTERPRET=1`` on a machine without CUDA before anything imports triton.
"""
import pytest
import torch

from deform_plugin.ops.backend import triton_unavailable_reason

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
TRITON_REASON = triton_unavailable_reason(DEVICE)
needs_triton = pytest.mark.skipif(TRITON_REASON is not None, reason=f"Triton cannot run: {TRITON_REASON}")

# An integer no index or count output holds: what a poisoned integer allocation starts as.
POISONED_INTEGER = -7777


def poison_fresh_allocations(monkeypatch) -> None:
    """Fill every ``torch.empty``/``empty_like`` and ``Tensor.new_empty`` with NaN, or with
    :data:`POISONED_INTEGER` for int32 and int64 (FLA's trick): an element a kernel forgets to write then fails the
    comparison. ``new_empty`` too: the launchers allocate their outputs and scratch buffers with it."""
    real_empty, real_empty_like, real_new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty

    def poison(tensor):
        if tensor.is_floating_point():
            tensor.fill_(float("nan"))
        elif tensor.dtype in (torch.int32, torch.int64):
            tensor.fill_(POISONED_INTEGER)
        return tensor

    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: poison(real_empty(*args, **kwargs)))
    monkeypatch.setattr(torch, "empty_like", lambda *args, **kwargs: poison(real_empty_like(*args, **kwargs)))
    monkeypatch.setattr(torch.Tensor, "new_empty",
                        lambda self, *args, **kwargs: poison(real_new_empty(self, *args, **kwargs)))
