"""Run mmdet's own ``tools/train.py`` (the copy in the mmdet wheel) in a process that never imports deform_plugin.

    python deform_plugin/benchmarks/stock_process.py deform_plugin.benchmarks.detector.stock_train CONFIG \
        [mmdet train.py arguments ...]

The one thing added before mmdet's script runs: on a machine without a GPU where mmcv has no compiled ops
(mmcv-lite), mmcv-lite's placeholder ``mmcv._ext`` is installed so that ``mmdet.models`` imports; it serves no op,
and mmcv's pure-PyTorch CPU paths never call one. On a GPU without compiled ops the launcher stops: a stock row
there would not be stock mmcv. ``deform_plugin/integration/mmcv_lite.py`` is run by path, which imports only the
standard library and torch; :mod:`deform_plugin.benchmarks.stock_process` keeps the deform_plugin package itself
uninstalled.
"""
from __future__ import annotations

import importlib.util
import runpy
import sys
from pathlib import Path
from typing import List, Sequence

import torch

from deform_plugin.benchmarks.common import MMCV_LITE_SCRIPT
from deform_plugin.benchmarks.stock_process import plugin_imported


def mmdet_train_script() -> Path:
    """``tools/train.py`` as shipped inside the installed mmdet wheel (``mmdet/.mim/tools/train.py``)."""
    spec = importlib.util.find_spec("mmdet")
    if spec is None or spec.origin is None:
        raise SystemExit("mmdet is not installed")
    script = Path(spec.origin).parent / ".mim" / "tools" / "train.py"
    if not script.is_file():
        raise SystemExit(f"mmdet's training script is not at {script}: is mmdet installed from a wheel?")
    return script


def prepare_mmcv() -> str:
    """Make mmdet importable as stock as this machine allows; returns what serves mmcv's ops."""
    mmcv_lite = runpy.run_path(str(MMCV_LITE_SCRIPT))
    if mmcv_lite["compiled_mmcv_ops_available"]():
        return "compiled"
    if torch.cuda.is_available():
        raise SystemExit("stock rows on a GPU need mmcv with its compiled ops, and this environment has mmcv-lite: "
                         "install mmcv 2.1.0 with ops (`pip uninstall mmcv-lite && MMCV_WITH_OPS=1 pip install "
                         "--no-build-isolation mmcv==2.1.0`)")
    mmcv_lite["install_placeholder_ext"]()
    return "placeholder"


def main(argv: Sequence[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    served_by = prepare_mmcv()
    script = mmdet_train_script()
    print(f"stock_train: mmdet {script} with mmcv ops: {served_by}", flush=True)
    saved_argv: List[str] = sys.argv
    sys.argv = [str(script), *argv]
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = saved_argv
    if plugin_imported():
        raise SystemExit("deform_plugin was imported during a stock run")


if __name__ == "__main__":
    main(sys.argv[1:])
