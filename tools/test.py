"""Test (and evaluate) a detector with deform_plugin loaded: mmdet 3.3.0's ``tools/test.py`` arguments.

    python tools/test.py CONFIG CHECKPOINT [--work-dir DIR] [--out results.pkl] [--show] [--show-dir DIR]
                                           [--wait-time S] [--cfg-options KEY=VALUE ...] [--launcher ...]

The checkpoint loads under torch >= 2.6 (``weights_only``) through deform_plugin's allow-list of the types that
mmengine writes. mmdet's ``--tta`` is not offered.
"""
from __future__ import annotations

import os

# Before anything loads torch's OpenMP runtime: idle threads sleep instead of spinning (deform_plugin/cpu_threads.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import sys
from typing import Optional, Sequence

import deform_plugin  # noqa: F401  (before mmdet: installs the mmcv-lite stand-in and the checkpoint fix)
from mmdet.engine.hooks.utils import trigger_visualization_hook
from mmdet.evaluation import DumpDetResults
from mmdet.utils import setup_cache_size_limit_of_dynamo

from deform_plugin.cli import build_runner, load_config, parse_with_common_arguments, require_checkpoint
from deform_plugin.cpu_threads import configure_cpu_threads


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Test (and evaluate) a detector (with deform_plugin)")
    parser.add_argument("config", help="test config file path")
    parser.add_argument("checkpoint", help="checkpoint file")
    parser.add_argument("--work-dir", help="the directory to save the file containing evaluation metrics")
    parser.add_argument("--out", type=str, help="dump predictions to a pickle file for offline evaluation")
    parser.add_argument("--show", action="store_true", help="show prediction results")
    parser.add_argument("--show-dir", help="directory where painted images will be saved "
                        "(under work_dir/timestamp/)")
    parser.add_argument("--wait-time", type=float, default=2, help="the interval of show (s)")
    args = parse_with_common_arguments(parser, argv)
    if args.out is not None and not args.out.endswith((".pkl", ".pickle")):
        parser.error(f"--out must name a .pkl or .pickle file, got {args.out!r}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Run the test loop and return its metrics (e.g. ``coco/bbox_mAP``)."""
    args = parse_args(argv)
    setup_cache_size_limit_of_dynamo()
    cfg = load_config(args.config, args.work_dir, args.cfg_options, args.launcher)
    require_checkpoint(args.checkpoint)
    cfg.load_from = args.checkpoint
    if args.show or args.show_dir:
        cfg = trigger_visualization_hook(cfg, args)
    runner = build_runner(cfg)
    if args.out is not None:
        runner.test_evaluator.metrics.append(DumpDetResults(out_file_path=args.out))
    return runner.test()


if __name__ == "__main__":
    configure_cpu_threads()
    main(sys.argv[1:])
