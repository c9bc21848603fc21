"""mmengine checkpoints under torch >= 2.6, where ``torch.load`` defaults to ``weights_only=True``.

mmengine 0.10.7 calls ``torch.load(filename, map_location=...)`` without ``weights_only``, and the checkpoints its
``Runner`` writes hold more than tensors: the message hub's ``HistoryBuffer`` objects (numpy arrays inside, and
their statistics methods, pickled as ``getattr(HistoryBuffer, 'min')``) and numpy scalars (the ETA). The
weights-only unpickler refuses those, so ``resume``, ``load_from`` and ``tools/test.py`` fail on our own
checkpoints.

The fix keeps the weights-only unpickler and widens its allow-list, only while mmengine's ``CheckpointLoader``
runs, by exactly the globals that mmengine writes:

* ``HistoryBuffer`` and the numpy pieces that rebuild arrays, dtypes and scalars (``_reconstruct``, ``ndarray``,
  ``dtype``, ``scalar``) under their numpy 2 and numpy 1 names, so files written with either numpy load;
* ``builtins.getattr`` mapped to a function that returns only ``HistoryBuffer``'s own statistics methods. The real
  ``getattr`` is never allow-listed: with it a crafted file could walk from any allowed object to ``os.system``.

Why not ``weights_only=False`` for files the user chose: a checkpoint from the internet is a file the user chose
too, and the weights-only unpickler is what keeps such a file from running code. Anything outside this list still
fails with torch's message, to which we add the opt-out torch itself offers
(``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``) for files the user trusts.

``torch.load`` elsewhere in the process is unchanged: the list applies only inside ``CheckpointLoader``.
"""
from __future__ import annotations

import contextlib
import pickle
from typing import Any, Callable, Iterator, List

import torch

_WRAPPED_FLAG = "__deform_plugin_weights_only_allowlist__"
_HISTORY_BUFFER_STATISTICS = ("min", "max", "current", "mean")


def install_checkpoint_allowlist() -> None:
    """Make mmengine's checkpoint loading accept mmengine's own checkpoints under ``weights_only``. Idempotent."""
    if not hasattr(torch.serialization, "safe_globals"):
        # torch < 2.5 has no allow-list, and before 2.6 torch.load is not weights-only by default anyway.
        return
    from mmengine.runner.checkpoint import CheckpointLoader

    current = CheckpointLoader.__dict__["load_checkpoint"].__func__
    if getattr(current, _WRAPPED_FLAG, False):
        return

    def load_checkpoint(cls, filename: str, map_location: Any = None, logger: Any = "current") -> Any:
        with mmengine_checkpoint_globals():
            try:
                return current(cls, filename, map_location, logger)
            except pickle.UnpicklingError as error:
                raise pickle.UnpicklingError(
                    f"{error}\n\ndeform_plugin: {filename!r} holds objects outside the types that mmengine writes "
                    "(tensors, numpy arrays and scalars, HistoryBuffer). If you trust this file, load it with "
                    "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 set in the environment.") from error

    setattr(load_checkpoint, _WRAPPED_FLAG, True)
    load_checkpoint.__doc__ = current.__doc__
    CheckpointLoader.load_checkpoint = classmethod(load_checkpoint)


@contextlib.contextmanager
def mmengine_checkpoint_globals() -> Iterator[None]:
    """Within this context, ``torch.load(..., weights_only=True)`` accepts what mmengine's Runner saves."""
    with torch.serialization.safe_globals(_allowed_globals()):
        yield


def _allowed_globals() -> List[Any]:
    import numpy as np
    from mmengine.logging import HistoryBuffer

    def history_buffer_statistic(owner: Any, name: str) -> Callable:
        if owner is HistoryBuffer and name in _HISTORY_BUFFER_STATISTICS:
            return getattr(HistoryBuffer, name)
        raise pickle.UnpicklingError(
            f"weights-only load refused getattr({owner!r}, {name!r}): only HistoryBuffer statistics are allowed")

    multiarray = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray
    allowed: List[Any] = [HistoryBuffer, np.ndarray, np.dtype, (history_buffer_statistic, "builtins.getattr")]
    for module_name in ("numpy._core.multiarray", "numpy.core.multiarray"):
        allowed.append((multiarray._reconstruct, f"{module_name}._reconstruct"))
        allowed.append((multiarray.scalar, f"{module_name}.scalar"))
    # numpy 2 may name a dtype by its class (numpy.dtypes.Float64DType) when pickling dtypes directly.
    allowed.extend(type(np.dtype(code)) for code in "?bBhHiIlLqQefdgFDG")
    return allowed
