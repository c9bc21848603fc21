"""What the command lines in tools/ share: mmdet 3.3.0's train/test conventions, with deform_plugin's AMP wrapper,
and the checks of what users pass.

``tools/train.py``, ``tools/test.py`` and ``tools/demo.py`` parse their own options and call these; the training
benchmark runs ``tools/train.py`` itself, so that what it times is what users run.

A mistake in a command line (a config, checkpoint or image folder that does not exist or cannot be read) ends the
tool with one ``error:`` line naming the path and exit status 2, as argparse does, before anything is built. A
``--cfg-options`` key whose top-level key is in neither the config nor mmengine's Runner gets a warning that names
the closest key: mmengine would add it silently and run the config unchanged.

``--launcher`` (:func:`prepare_launcher`, run by :func:`build_runner`): ``pytorch`` outside torchrun is a usage error
that names the missing variables; on a machine without CUDA devices the ranks of ``tools/dist_train.sh`` and
``tools/dist_test.sh`` run on the CPU over gloo.
"""
from __future__ import annotations

import argparse
import difflib
import inspect
import os
import os.path as osp
import sys
from typing import Iterable, List, NoReturn, Optional, Sequence

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


def usage_error(message: str) -> NoReturn:
    """End the tool as argparse ends it for a bad option: ``error: MESSAGE`` on stderr, exit status 2."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def is_remote(path: str) -> bool:
    """Whether mmengine fetches ``path`` (``https://...``, ``torchvision://...``) rather than reading a local file."""
    return "://" in path


def path_problem(kind: str, path: str, folder: bool = False, hint: str = "") -> Optional[str]:
    """Why ``path`` cannot be read as the ``kind`` file (or folder, with ``folder=True``), or None when it can.

    ``kind`` names the path in the message (``config``, ``checkpoint``, ...); ``hint`` is appended where the path
    does not exist.
    """
    if not os.path.exists(path):
        return f"{kind} {path!r} does not exist{hint}"
    if folder:
        if not os.path.isdir(path):
            return f"{kind} {path!r} is not a folder"
        try:
            os.listdir(path)
        except OSError as error:
            return f"{kind} {path!r} cannot be read: {error.strerror}"
        return None
    if os.path.isdir(path):
        return f"{kind} {path!r} is a folder, not a file"
    try:
        with open(path, "rb"):
            pass
    except OSError as error:
        return f"{kind} {path!r} cannot be read: {error.strerror}"
    return None


def require_path(kind: str, path: str, folder: bool = False, hint: str = "") -> None:
    """:func:`usage_error` where :func:`path_problem` finds one."""
    problem = path_problem(kind, path, folder, hint)
    if problem is not None:
        usage_error(problem)


def require_checkpoint(path: Optional[str]) -> None:
    """A local checkpoint must be a readable file; remote ones (URLs, ``torchvision://``) are mmengine's to fetch."""
    if path is not None and not is_remote(path):
        require_path("checkpoint", path)


def read_config(config_path: str, **fromfile_options) -> Config:
    """``Config.fromfile``, with a missing, unreadable or broken config (a syntax error, a missing ``_base_``, a
    failing custom import) reported as one :func:`usage_error` line instead of mmengine's traceback."""
    require_path("config", config_path)
    try:
        return Config.fromfile(config_path, **fromfile_options)
    except Exception as error:  # the config's own code: whatever it raises is the user's to fix, in one line
        usage_error(f"config {config_path!r} cannot be loaded: {type(error).__name__}: {error}")


def runner_keys() -> List[str]:
    """Top-level keys that mmengine's Runner reads besides the config's own: its constructor's arguments, and the
    keys that mmengine's config handling and mmdet's tools read."""
    arguments = [name for name in inspect.signature(Runner.__init__).parameters if name != "self"]
    return arguments + ["runner_type", "custom_imports", "default_scope", "launcher"]


def unknown_cfg_option_warnings(cfg: Config, keys: Iterable[str]) -> List[str]:
    """A warning for each ``--cfg-options`` key whose top-level key is in neither ``cfg`` nor :func:`runner_keys`,
    naming the closest known key where one is close (a misspelt key would otherwise be added silently, and the
    config would run unchanged)."""
    known = sorted(set(cfg.keys()) | set(runner_keys()))
    warnings = []
    for key in keys:
        top = key.split(".", 1)[0]
        if top in known:
            continue
        close = difflib.get_close_matches(top, known, n=1)
        guess = f" (did you mean {close[0]!r}?)" if close else ""
        warnings.append(f"--cfg-options {key}: the config has no key {top!r}{guess}; it is added as a new key")
    return warnings


def warn_about_unknown_cfg_options(cfg: Config, keys: Optional[Iterable[str]]) -> None:
    for warning in unknown_cfg_option_warnings(cfg, keys or ()):
        print(f"warning: {warning}", file=sys.stderr, flush=True)


def check_cfg_options_of(config_paths: Sequence[str], keys: Optional[Iterable[str]]) -> None:
    """:func:`warn_about_unknown_cfg_options` for each config, read without its custom imports (for tools that load
    the configs later themselves and report a broken one there)."""
    keys = list(keys or ())
    if not keys:
        return
    for path in config_paths:
        try:
            cfg = Config.fromfile(path, import_custom_modules=False)
        except Exception:  # the tool reports a config it cannot load when it loads it
            continue
        warn_about_unknown_cfg_options(cfg, keys)


def load_config(config_path: str, work_dir: Optional[str], cfg_options: Optional[dict], launcher: str) -> Config:
    """The config as mmdet's tools see it: options merged, launcher set, work dir resolved (CLI > config > name)."""
    cfg = read_config(config_path)
    warn_about_unknown_cfg_options(cfg, cfg_options)
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


def remove_shape_buckets(cfg: Config) -> bool:
    """Drop the config's ``ShapeBucketsHook`` (``--no-shape-buckets``): training batches keep stock's padding, which
    is exact; ``FastPathsHook`` then pads Deformable-DETR's and DINO's feature maps to buckets before the
    transformer's graphs instead (also exact). Returns whether the config had the hook."""
    hooks = list(cfg.get("custom_hooks") or [])
    kept = [hook for hook in hooks if not (isinstance(hook, dict) and hook.get("type") == "ShapeBucketsHook")]
    cfg.custom_hooks = kept
    return len(kept) != len(hooks)


def apply_resume(cfg: Config, resume: Optional[str]) -> None:
    """``--resume`` alone resumes from the work dir's latest checkpoint; ``--resume PATH`` from that file."""
    if resume == "auto":
        cfg.resume = True
        cfg.load_from = None
    elif resume is not None:
        require_checkpoint(resume)
        cfg.resume = True
        cfg.load_from = resume


def enable_resume_by_parameter_name(cfg: Config) -> None:
    """Add ``OptimizerStateByNameHook`` (unless the config lists it): checkpoints then record which parameter each
    optimizer state belongs to, and resume under any param-group layout, plain or ``configs/fast/``, stock ones
    included."""
    hooks = list(cfg.get("custom_hooks", None) or [])
    listed = {hook["type"] if isinstance(hook["type"], str) else hook["type"].__name__ for hook in hooks
              if isinstance(hook, dict) and "type" in hook}
    if "OptimizerStateByNameHook" not in listed:
        hooks.append(dict(type="OptimizerStateByNameHook"))
    cfg.custom_hooks = hooks


# What torchrun (tools/dist_train.sh, tools/dist_test.sh) sets for each rank and mmengine's pytorch launcher reads.
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def prepare_launcher(cfg: Config) -> None:
    """Check what ``cfg.launcher`` needs from the environment; without CUDA devices, start the ranks on the CPU.

    ``--launcher pytorch`` without torchrun's variables ends with a usage error that names the missing ones (mmengine
    would stop with ``KeyError: 'RANK'``). On a machine without CUDA devices, mmengine's pytorch launcher would bind
    each rank to ``cuda:LOCAL_RANK`` before joining the process group, and its default model wrapper would pass
    ``device_ids=[LOCAL_RANK]``, which DistributedDataParallel refuses for a CPU model; so here the rank joins the
    process group itself (gloo where the config's ``env_cfg.dist_cfg`` asks for nccl, which needs GPUs; the config's
    timeout kept), mmengine then uses that group, and a DistributedDataParallel wrapper gets ``device_ids=None``.
    ``--launcher slurm`` and ``mpi`` bind GPUs the same way and have no CPU fallback: without CUDA they end with a
    usage error.
    """
    launcher = cfg.get("launcher", "none")
    if launcher == "none":
        return
    if launcher == "pytorch":
        missing = [name for name in TORCHRUN_VARIABLES if not os.environ.get(name)]
        if missing:
            usage_error(f"--launcher pytorch reads {', '.join(missing)} from the environment, which torchrun sets "
                        "for each rank: start the tool with tools/dist_train.sh or tools/dist_test.sh (or torchrun)")
    if torch.cuda.is_available():
        return
    if launcher != "pytorch":
        usage_error(f"--launcher {launcher} binds each task to a CUDA device and this machine has none: on the CPU, "
                    "start the ranks with tools/dist_train.sh or tools/dist_test.sh (--launcher pytorch, gloo)")
    join_cpu_process_group(cfg)
    wrap_model_on_cpu(cfg)


def join_cpu_process_group(cfg: Config) -> None:
    """Join torchrun's process group (``env://``) on the CPU, with the config's backend unless it is nccl (then
    gloo), and record the backend used in ``cfg.env_cfg.dist_cfg``."""
    import datetime

    import torch.distributed as dist
    if dist.is_initialized():
        return
    env_cfg = cfg.get("env_cfg", None) or {}
    dist_cfg = dict(env_cfg.get("dist_cfg", None) or {})
    backend = dist_cfg.pop("backend", "nccl")
    dist_cfg.pop("init_backend", None)  # mmengine's choice of initialiser (deepspeed, colossalai): torch's here
    if backend == "nccl":
        backend = "gloo"
        if os.environ["RANK"] == "0":
            print("note: no CUDA device: the ranks join a gloo process group (the config's env_cfg.dist_cfg asks "
                  "for nccl, which needs GPUs)", file=sys.stderr, flush=True)
    if "timeout" in dist_cfg:  # seconds in mmengine's configs
        dist_cfg["timeout"] = datetime.timedelta(seconds=dist_cfg["timeout"])
    dist.init_process_group(backend=backend, init_method="env://", **dist_cfg)
    cfg.env_cfg = dict(env_cfg, dist_cfg=dict(env_cfg.get("dist_cfg", None) or {}, backend=backend))


def wrap_model_on_cpu(cfg: Config) -> None:
    """``device_ids=None`` for a DistributedDataParallel model wrapper (mmengine's default one included, with its
    defaults: ``broadcast_buffers=False`` and the config's ``find_unused_parameters``); other wrappers take no
    devices."""
    from mmengine.registry import MODEL_WRAPPERS
    from torch.nn.parallel import DistributedDataParallel
    wrapper = cfg.get("model_wrapper_cfg", None)
    if wrapper is None:
        cfg.model_wrapper_cfg = dict(type="MMDistributedDataParallel", broadcast_buffers=False,
                                     find_unused_parameters=cfg.get("find_unused_parameters", False), device_ids=None)
        return
    wrapper_type = wrapper.get("type", "MMDistributedDataParallel")
    if isinstance(wrapper_type, str):
        wrapper_type = MODEL_WRAPPERS.get(wrapper_type)
    if isinstance(wrapper_type, type) and issubclass(wrapper_type, DistributedDataParallel):
        wrapper.setdefault("device_ids", None)


def build_runner(cfg: Config) -> Runner:
    """The Runner of ``cfg``, after :func:`prepare_launcher`."""
    prepare_launcher(cfg)
    return Runner.from_cfg(cfg) if "runner_type" not in cfg else RUNNERS.build(cfg)
