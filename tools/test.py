"""Test (and evaluate) a detector with deform_plugin loaded: mmdet 3.3.0's ``tools/test.py`` arguments.

    python tools/test.py CONFIG CHECKPOINT [--work-dir DIR] [--out results.pkl] [--show] [--show-dir DIR]
                                           [--wait-time S] [--cfg-options KEY=VALUE ...] [--launcher ...]
                                           [--fast-inference [--size-divisor 32] [--canvas | --no-buckets]]
                                           [--amp-dtype {float16,bfloat16}]

``--fast-inference`` evaluates through graph inference (``FastInferenceHook``): inputs padded to buckets, each
bucket's forward replayed from a CUDA graph once it recurs.

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

from deform_plugin.cli import (AMP_DTYPES, build_runner, load_config, parse_with_common_arguments,
                               require_checkpoint)
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
    fast = parser.add_argument_group("graph inference (deform_plugin.engine.FastInferenceHook)")
    fast.add_argument("--fast-inference", action="store_true",
                      help="run the test forwards through graph inference: inputs padded to buckets, each bucket's "
                      "forward replayed from a CUDA graph once it recurs (on a CPU: padded, eager)")
    fast.add_argument("--size-divisor", type=int, default=32, help="bucket step in pixels (default: 32)")
    fast.add_argument("--no-buckets", action="store_true", help="graphs per exact input shape, mmdet's padding")
    fast.add_argument("--canvas", action="store_true", help="pad an input whose bucket has no graph into the test "
                      "pipeline's largest size (more padding: see docs/results.md)")
    parser.add_argument("--amp-dtype", choices=AMP_DTYPES, help="run the test forwards under autocast (CUDA)")
    args = parse_with_common_arguments(parser, argv)
    if (args.no_buckets or args.canvas or args.size_divisor != 32) and not args.fast_inference:
        parser.error("--no-buckets, --canvas and --size-divisor apply to --fast-inference")
    if args.no_buckets and args.canvas:
        parser.error("--canvas pads to buckets: it does not go with --no-buckets")
    if args.size_divisor < 1:
        parser.error(f"--size-divisor must be >= 1, got {args.size_divisor}")
    import torch
    if args.amp_dtype and not torch.cuda.is_available():
        parser.error(f"--amp-dtype {args.amp_dtype} needs a CUDA device")
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
    if args.fast_inference:
        cfg.custom_hooks = list(cfg.get("custom_hooks") or []) + [
            dict(type="FastInferenceHook", size_divisor=args.size_divisor, buckets=not args.no_buckets,
                 **(dict(canvases="auto", borrow_max_pixels=1.7) if args.canvas else {}))]
    runner = build_runner(cfg)
    if args.out is not None:
        runner.test_evaluator.metrics.append(DumpDetResults(out_file_path=args.out))
    import torch
    with torch.autocast("cuda", dtype=getattr(torch, args.amp_dtype or "float16"), enabled=bool(args.amp_dtype)):
        return runner.test()


if __name__ == "__main__":
    configure_cpu_threads()
    main(sys.argv[1:])
