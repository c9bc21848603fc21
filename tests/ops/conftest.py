"""Fixtures of the op tests."""
import pytest
from op_devices import poison_fresh_allocations


@pytest.fixture
def poisoned_allocations(monkeypatch):
    """Fresh allocations poisoned for the test (:func:`op_devices.poison_fresh_allocations`)."""
    poison_fresh_allocations(monkeypatch)
    yield
