"""Subprocesses that run this checkout's tools: they import deform_plugin from this checkout, whichever copy the
environment has installed (an editable install of another clone, a wheel)."""
import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def checkout_environment(**variables) -> dict:
    """``os.environ`` with this checkout first on ``PYTHONPATH``, and ``variables`` set."""
    path = os.pathsep.join(filter(None, (str(REPO_ROOT), os.environ.get("PYTHONPATH"))))
    return dict(os.environ, PYTHONPATH=path, **variables)
