"""deform_plugin.integration.mmengine_checkpoint: mmengine's checkpoints load under torch's weights-only default, and
nothing else gets through."""
from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from mmengine.logging import HistoryBuffer, MessageHub
from mmengine.runner.checkpoint import CheckpointLoader, _load_checkpoint

from deform_plugin.integration import mmengine_checkpoint as checkpoint_fix


def _mmengine_like_checkpoint() -> dict:
    """The non-tensor contents a Runner checkpoint holds: a message hub with history buffers, numpy scalars."""
    hub = MessageHub("deform_plugin_test_checkpoint")
    for loss in (3.0, 2.5, 2.0):
        hub.update_scalar("train/loss", loss)
    hub.update_info("eta", np.float64(12.5))
    return dict(
        meta=dict(iter=3, dataset_meta=dict(classes=("circle", "square"))),
        state_dict={"weight": torch.arange(4.0)},
        message_hub=hub.state_dict(),
    )


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "iter_3.pth"
    torch.save(_mmengine_like_checkpoint(), path)
    return path


@pytest.mark.skipif(not hasattr(torch.serialization, "safe_globals"), reason="torch without weights-only allow-lists")
def test_bare_weights_only_load_refuses_it(saved):
    """The problem being fixed, and proof that the fix is scoped: torch.load itself is unchanged."""
    with pytest.raises(pickle.UnpicklingError):
        torch.load(saved, weights_only=True)


def test_mmengine_loader_reads_it(saved):
    loaded = _load_checkpoint(str(saved), map_location="cpu")
    torch.testing.assert_close(loaded["state_dict"]["weight"], torch.arange(4.0))
    buffer = loaded["message_hub"]["log_scalars"]["train/loss"]
    assert isinstance(buffer, HistoryBuffer)
    assert buffer.mean() == pytest.approx(2.5)
    assert buffer.min() == pytest.approx(2.0)
    assert loaded["message_hub"]["runtime_info"]["eta"] == pytest.approx(12.5)


def test_install_is_idempotent():
    checkpoint_fix.install_checkpoint_allowlist()
    wrapped = CheckpointLoader.__dict__["load_checkpoint"]
    checkpoint_fix.install_checkpoint_allowlist()
    assert CheckpointLoader.__dict__["load_checkpoint"] is wrapped


class _GetattrPayload:
    """Pickles as getattr(HistoryBuffer, '__init__'): a getattr outside the statistics methods."""

    def __reduce__(self):
        return getattr, (HistoryBuffer, "__init__")


@pytest.mark.skipif(not hasattr(torch.serialization, "safe_globals"), reason="torch without weights-only allow-lists")
def test_only_history_buffer_statistics_pass_through_getattr(tmp_path):
    path = tmp_path / "crafted.pth"
    torch.save({"payload": _GetattrPayload()}, path)
    with pytest.raises(pickle.UnpicklingError, match="TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"):
        _load_checkpoint(str(path), map_location="cpu")


class _Unlisted:
    pass


@pytest.mark.skipif(not hasattr(torch.serialization, "safe_globals"), reason="torch without weights-only allow-lists")
def test_other_objects_still_refused_with_a_way_out(tmp_path):
    path = tmp_path / "other.pth"
    torch.save({"obj": _Unlisted()}, path)
    with pytest.raises(pickle.UnpicklingError, match="TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"):
        _load_checkpoint(str(path), map_location="cpu")
