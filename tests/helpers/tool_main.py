"""Run a tools/ script's command line in the test process, as ``python tools/SCRIPT ARGS`` runs it (its
``__main__`` block included), for the cases that end before any model is built: usage errors and ``--help``.

A fresh interpreter costs seconds of imports per case; what these cases check (the exit status, the lines on stdout
and stderr) is the same in this process. What the script changes of this process is put back: ``sys.argv``, the
OpenMP wait policy it sets in ``os.environ``, and the torch thread count that ``configure_cpu_threads`` may lower.
The help is wrapped at 80 columns, as for a script whose output goes to a pipe.
"""
from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

import pytest
import torch

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def run_tool_main(script, args, monkeypatch, capsys):
    """``(exit status, stdout, stderr)`` of ``tools/script`` run as ``__main__`` with ``args``; it must end with
    ``SystemExit`` (``sys.exit``, argparse's exits or a usage error)."""
    path = TOOLS / script
    monkeypatch.setattr(sys, "argv", [str(path), *map(str, args)])
    monkeypatch.setenv("OMP_WAIT_POLICY", os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
    # argparse wraps help to the terminal's width; a script whose output goes to a pipe gets 80 columns.
    monkeypatch.setenv("COLUMNS", "80")
    threads = torch.get_num_threads()
    capsys.readouterr()  # only this run's output
    try:
        with pytest.raises(SystemExit) as ended:
            runpy.run_path(str(path), run_name="__main__")
    finally:
        torch.set_num_threads(threads)
    out, err = capsys.readouterr()
    return ended.value.code, out, err
