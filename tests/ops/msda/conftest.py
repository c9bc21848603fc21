"""Fixtures of the MSDA op tests."""
import pytest
import torch


@pytest.fixture
def poisoned_allocations(monkeypatch):
    """Fill every torch.empty/empty_like and Tensor.new_empty with NaN (FLA's trick): an element a kernel forgets to
    write fails. ``new_empty`` too: the launchers allocate their outputs and scratch buffers with it."""
    real_empty, real_empty_like, real_new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty

    def poison(tensor):
        if tensor.is_floating_point():
            tensor.fill_(float("nan"))
        return tensor

    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: poison(real_empty(*args, **kwargs)))
    monkeypatch.setattr(torch, "empty_like", lambda *args, **kwargs: poison(real_empty_like(*args, **kwargs)))
    monkeypatch.setattr(torch.Tensor, "new_empty",
                        lambda self, *args, **kwargs: poison(real_new_empty(self, *args, **kwargs)))
    yield
