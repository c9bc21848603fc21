"""Train a detector with deform_plugin loaded: mmdet 3.3.0's ``tools/train.py`` arguments and behaviour.

    python tools/train.py CONFIG [--work-dir DIR] [--amp | --amp-dtype {float16,bfloat16}] [--auto-scale-lr]
                                 [--resume [CHECKPOINT]] [--cfg-options KEY=VALUE ...]
                                 [--launcher none|pytorch|slurm|mpi]

Differences from mmdet's script: ``deform_plugin`` is imported first (so mmdet imports with mmcv-lite and configs
may name our modules without ``custom_imports``), checkpoints load under torch >= 2.6, and ``--amp-dtype`` picks
bfloat16 as well as mmdet's float16.
"""
from __future__ import annotations

import argparse
import os
import os.path as osp
import sys
from typing import Optional, Sequence

# A checkout's tools run that checkout's plugin, installed or not.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import deform_plugin  # noqa: E402,F401  (before mmdet: installs the mmcv-lite stand-in and the checkpoint fix)
import torch
from mmengine.config import Config, DictAction
from mmengine.registry import RUNNERS
from mmengine.runner import Runner

from mmdet.utils import setup_cache_size_limit_of_dynamo

AMP_DTYPES = ("float16", "bfloat16")


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
    return parse_with_common_arguments(parser, argv)


def parse_with_common_arguments(parser: argparse.ArgumentParser,
                                argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Add the options mmdet's train and test tools share (config overrides, launcher, local rank) and parse."""
    parser.add_argument("--cfg-options", nargs="+", action=DictAction,
                        help="override settings of the config, as key=value pairs (mmengine's DictAction syntax: "
                        'key="[a,b]" or key=a,b for lists; no white space)')
    parser.add_argument("--launcher", choices=["none", "pytorch", "slurm", "mpi"], default="none",
                        help="job launcher")
    # torch.distributed.launch passes --local-rank (torch >= 2.0) or --local_rank (older).
    parser.add_argument("--local_rank", "--local-rank", type=int, default=0)
    args = parser.parse_args(argv)
    if "LOCAL_RANK" not in os.environ:
        os.environ["LOCAL_RANK"] = str(args.local_rank)
    return args


def load_config(config_path: str, work_dir: Optional[str], cfg_options: Optional[dict], launcher: str) -> Config:
    """The config as mmdet's tools see it: options merged, launcher set, work dir resolved (CLI > config > name)."""
    cfg = Config.fromfile(config_path)
    cfg.launcher = launcher
    if cfg_options is not None:
        cfg.merge_from_dict(cfg_options)
    if work_dir is not None:
        cfg.work_dir = work_dir
    elif cfg.get("work_dir", None) is None:
        cfg.work_dir = osp.join("./work_dirs", osp.splitext(osp.basename(config_path))[0])
    # mmdet's configs all set it; a config that does not still builds mmdet's registries, as in mmdet's tools.
    if cfg.get("default_scope", None) is None:
        cfg.default_scope = "mmdet"
    return cfg


def enable_amp(cfg: Config, dtype: str) -> None:
    """Mixed precision as mmdet's ``--amp`` sets it, through ``SyncFreeAmpOptimWrapper``: the same fp16 dynamic loss
    scaling, no loss scaler for bf16 (it needs none), and a gradient-norm log that does not sync the host."""
    if not torch.cuda.is_available():
        raise SystemExit("--amp needs a GPU: mmengine's AmpOptimWrapper runs on CUDA (or NPU/MLU/MUSA) only")
    cfg.optim_wrapper.type = "SyncFreeAmpOptimWrapper"
    cfg.optim_wrapper.loss_scale = "dynamic"
    cfg.optim_wrapper.dtype = dtype


def enable_auto_scale_lr(cfg: Config) -> None:
    auto_scale_lr = cfg.get("auto_scale_lr", None)
    if not auto_scale_lr or "enable" not in auto_scale_lr or "base_batch_size" not in auto_scale_lr:
        raise RuntimeError('Can not find "auto_scale_lr" or "auto_scale_lr.enable" or '
                           '"auto_scale_lr.base_batch_size" in your configuration file.')
    cfg.auto_scale_lr.enable = True


def apply_resume(cfg: Config, resume: Optional[str]) -> None:
    """``--resume`` alone resumes from the work dir's latest checkpoint; ``--resume PATH`` from that file."""
    if resume == "auto":
        cfg.resume = True
        cfg.load_from = None
    elif resume is not None:
        cfg.resume = True
        cfg.load_from = resume


def build_runner(cfg: Config) -> Runner:
    return Runner.from_cfg(cfg) if "runner_type" not in cfg else RUNNERS.build(cfg)


def build_train_config(args: argparse.Namespace) -> Config:
    cfg = load_config(args.config, args.work_dir, args.cfg_options, args.launcher)
    if args.amp or args.amp_dtype:
        enable_amp(cfg, args.amp_dtype or "float16")
    if args.auto_scale_lr:
        enable_auto_scale_lr(cfg)
    apply_resume(cfg, args.resume)
    return cfg


def main(argv: Optional[Sequence[str]] = None) -> Runner:
    args = parse_args(argv)
    # Fewer recompilations under torch.compile, as in mmdet's script.
    setup_cache_size_limit_of_dynamo()
    runner = build_runner(build_train_config(args))
    runner.train()
    return runner


if __name__ == "__main__":
    main(sys.argv[1:])
