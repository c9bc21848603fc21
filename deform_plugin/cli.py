"""What the command lines in tools/ share: mmdet 3.3.0's train/test conventions, with deform_plugin's AMP wrapper.

``tools/train.py``, ``tools/test.py`` and ``tools/demo.py`` parse their own options and call these; the training
benchmark runs ``tools/train.py`` itself, so that what it times is what users run.
"""
from __future__ import annotations

import argparse
import os
import os.path as osp
from typing import Optional, Sequence

import torch
from mmengine.config import Config, DictAction
from mmengine.registry import RUNNERS
from mmengine.runner import Runner

AMP_DTYPES = ("float16", "bfloat16")


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
