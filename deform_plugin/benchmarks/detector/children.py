"""Stock rows in a child process that never imports deform_plugin.

A stock row measures mmdet and mmcv as they are, so its process must not import deform_plugin (which rebinds
mmdet's MSDA construction sites and, with mmcv-lite, installs a stand-in for mmcv's compiled ops). The parent runs
``python deform_plugin/benchmarks/stock_process.py deform_plugin.benchmarks.detector.run CONFIG --rows stock:...
--child-json OUT`` (:mod:`deform_plugin.benchmarks.stock_process`) with the same settings and reads OUT back.
"""
from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import tempfile
from typing import List, Tuple

import torch

from deform_plugin.benchmarks.common import MMCV_LITE_SCRIPT
from deform_plugin.benchmarks.detector.rows import Row, row_result
from deform_plugin.benchmarks.stock_process import plugin_imported, stock_command


def prepare_stock_process(device: torch.device) -> None:
    """On a CPU with mmcv-lite, let mmdet import: mmcv_lite.py's placeholder ``mmcv._ext``, whose every op raises
    when called (mmcv's MSDA has a pure-PyTorch CPU path, so a stock CPU result is never served by our code).

    The file is run by path, so this process still never imports the deform_plugin package.
    """
    if device.type != "cpu":
        return
    runpy.run_path(str(MMCV_LITE_SCRIPT))["install_placeholder_ext"]()


def check_still_stock() -> None:
    if plugin_imported():
        raise RuntimeError("a stock row imported deform_plugin: its numbers would not be stock mmdet/mmcv")


def child_passthrough_args(args, shape: Tuple[int, int]) -> List[str]:
    passthrough = ["--device", args.device, "--shape", str(shape[0]), str(shape[1]),
                   "--batch-size", str(args.batch_size), "--num-gts", str(args.num_gts), "--warmup", str(args.warmup),
                   "--steps", str(args.steps), "--variable-sizes", str(args.variable_sizes),
                   "--inference-warmup", str(args.inference_warmup),
                   "--inference-steps", str(args.inference_steps), "--seed", str(args.seed),
                   "--profile-steps", str(args.profile_steps), "--msda-kernel-regex", args.msda_kernel_regex]
    for flag in ("profile", "profile_only", "trace", "no_progress", "tf32"):
        if getattr(args, flag):
            passthrough.append("--" + flag.replace("_", "-"))
    if args.out_dir:
        passthrough += ["--out-dir", args.out_dir]
    if args.cfg_options:
        passthrough += ["--cfg-options"] + [f"{k}={json.dumps(v) if not isinstance(v, str) else v}"
                                            for k, v in args.cfg_options.items()]
    return passthrough


def run_row_in_child(config_path: str, row: Row, args, shape: Tuple[int, int]) -> dict:
    """Run one row in a fresh interpreter; a failed child gives a failed row."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        command = [sys.executable, *stock_command("deform_plugin.benchmarks.detector.run"), config_path,
                   "--rows", row.label, "--child-json", out] + child_passthrough_args(args, shape)
        completed = subprocess.run(command, cwd=os.getcwd())
        if completed.returncode != 0 or not os.path.exists(out):
            return row_result(config_path, row, "failed", error=f"child process exited with {completed.returncode}")
        with open(out) as f:
            return json.load(f)
