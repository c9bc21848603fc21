"""Train a detector with deform_plugin loaded: mmdet 3.3.0's ``tools/train.py`` arguments and behaviour.

    python tools/train.py CONFIG [--work-dir DIR] [--amp | --amp-dtype {float16,bfloat16}] [--auto-scale-lr]
                                 [--resume [CHECKPOINT]] [--no-shape-buckets] [--cudnn-api {v7,v8}]
                                 [--cfg-options KEY=VALUE ...] [--launcher none|pytorch|slurm|mpi]

Differences from mmdet's script: ``deform_plugin`` is imported first (so mmdet imports with mmcv-lite and configs
may name our modules without ``custom_imports``), checkpoints load under torch >= 2.6, and ``--amp-dtype`` picks
bfloat16 as well as mmdet's float16; mixed precision runs through ``SyncFreeAmpOptimWrapper`` (bf16 without a loss
scaler, which it does not need; fp16 with mmdet's dynamic loss scaling). Every run gets ``OptimizerStateByNameHook``,
so ``--resume`` takes a checkpoint of a plain config under a ``configs/fast/`` one and the other way round (stock
mmdet checkpoints included), optimizer and LR-scheduler state carried over by parameter name. Where the config's
``FastPathsHook`` compiles the Triton kernels ahead, they start compiling as soon as the Runner is built.
``--no-shape-buckets`` trains a ``configs/fast/`` config with stock's padding: its ``ShapeBucketsHook``, the one
inexact fast path, is dropped (docs/results.md gives what it did to mAP). ``--cudnn-api`` picks cuDNN's convolution
API for the run (``FastPathsHook`` otherwise selects v7 where batch shapes do not recur and keeps PyTorch's v8 where
they do: ``ShapeBucketsHook``, or one padded size): v7 plans a new input shape for a fraction of v8's host time, so
short runs and first hours start faster, while v8's kernels replay faster at shapes seen before (in bf16 v7 runs
PyTorch's own convolution kernels; docs/results.md measures both).
"""
from __future__ import annotations

import os

# Before anything loads torch's OpenMP runtime: idle threads sleep instead of spinning (deform_plugin/cpu_threads.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import logging
import sys
from typing import Optional, Sequence

import deform_plugin  # noqa: F401  (before mmdet: installs the mmcv-lite stand-in and the checkpoint fix)
from mmdet.utils import setup_cache_size_limit_of_dynamo
from mmengine.config import Config
from mmengine.logging import print_log
from mmengine.runner import Runner

from deform_plugin.cli import (AMP_DTYPES, apply_resume, build_runner, enable_amp, enable_auto_scale_lr,
                               enable_resume_by_parameter_name, load_config, parse_with_common_arguments,
                               remove_shape_buckets)
from deform_plugin.conv_planning import select_cudnn_api
from deform_plugin.cpu_threads import configure_cpu_threads
from deform_plugin.engine.fast_paths_hook import set_cudnn_api_in_config
from deform_plugin.engine.triton_precompile import precompile_config_kernels, precompile_runner_kernels


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train a detector (with deform_plugin)")
    parser.add_argument("config", help="train config file path")
    parser.add_argument("--work-dir", help="the dir to save logs and models")
    parser.add_argument("--amp", action="store_true", default=False,
                        help="enable automatic mixed precision training (needs a GPU)")
    parser.add_argument("--amp-dtype", choices=AMP_DTYPES,
                        help="the low-precision dtype of mixed precision (implies --amp; --amp alone is float16, "
                        "as in mmdet)")
    parser.add_argument("--auto-scale-lr", action="store_true", help="enable automatically scaling LR")
    parser.add_argument("--resume", nargs="?", type=str, const="auto",
                        help="resume from this checkpoint; without a path, from the latest checkpoint in the work dir")
    parser.add_argument("--no-shape-buckets", action="store_true",
                        help="drop the config's ShapeBucketsHook: stock's padding of training batches (exact) instead "
                        "of padding them further to shared shapes (faster, not exact)")
    parser.add_argument("--cudnn-api", choices=("v7", "v8"),
                        help="cuDNN's convolution API for this run (default: the config's FastPathsHook chooses: v7 "
                        "where batch shapes do not recur, v8 with ShapeBucketsHook or one padded size); v7 plans new "
                        "input shapes faster, v8 runs seen ones faster")
    args = parse_with_common_arguments(parser, argv)
    if args.cudnn_api:
        # PyTorch reads the choice at the process's first convolution: set before anything can run one.
        problem = select_cudnn_api(args.cudnn_api)
        if problem:
            parser.error(problem)
    return args


def build_train_config(args: argparse.Namespace) -> Config:
    cfg = load_config(args.config, args.work_dir, args.cfg_options, args.launcher)
    if args.amp or args.amp_dtype:
        enable_amp(cfg, args.amp_dtype or "float16")
    if args.auto_scale_lr:
        enable_auto_scale_lr(cfg)
    apply_resume(cfg, args.resume)
    enable_resume_by_parameter_name(cfg)
    if args.no_shape_buckets and not remove_shape_buckets(cfg):
        print_log(f"--no-shape-buckets: {args.config} has no ShapeBucketsHook; its padding is stock's already",
                  logger="current", level=logging.WARNING)
    if args.cudnn_api:
        set_cudnn_api_in_config(cfg, args.cudnn_api == "v7")
    return cfg


def main(argv: Optional[Sequence[str]] = None) -> Runner:
    args = parse_args(argv)
    # Fewer recompilations under torch.compile, as in mmdet's script.
    setup_cache_size_limit_of_dynamo()
    cfg = build_train_config(args)
    # FastPathsHook's kernel compiles, started before the Runner is built rather than at before_run: they overlap
    # the Runner's building and train()'s datasets, data loaders and optimizer. The Runner's model starts any that
    # the config's could not name.
    precompile_config_kernels(cfg)
    runner = build_runner(cfg)
    precompile_runner_kernels(runner)
    runner.train()
    return runner


if __name__ == "__main__":
    configure_cpu_threads()
    main(sys.argv[1:])
