"""The commit that benchmark tables name in their machine line."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def repo_commit() -> str:
    """Short hash of this checkout's HEAD (``+dirty`` with uncommitted changes to tracked files).

    A copy of the tree without ``.git`` (a remote GPU host gets one) names its commit through the environment
    variable ``DEFORM_PLUGIN_COMMIT``; without either, ``'unknown'``.
    """
    named = os.environ.get("DEFORM_PLUGIN_COMMIT")
    if named:
        return named

    def git(*argv: str) -> str:
        try:
            return subprocess.run(["git", *argv], cwd=REPO_ROOT, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return "unknown"
    return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
