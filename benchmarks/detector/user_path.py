"""Training speed along the user's path: the training scripts and mmengine's Runner, one child process per row.

A row is ``SIDE:MODE``:

    SIDE  ours   our ``tools/train.py`` (imports deform_plugin) on the config as given: pass configs/fast/... for
                 the fast variants
          stock  mmdet's own ``tools/train.py`` from the mmdet wheel, through :mod:`benchmarks.detector.stock_train`,
                 in a process that never imports deform_plugin; every deform_plugin piece of the config is stripped
    MODE  fp32 | fp16 | bf16   (mixed precision through each script's own switch: ``--amp-dtype`` for ours, ``--amp``
                 plus ``optim_wrapper.dtype`` for mmdet's)

Each row trains for ``iters`` iterations on an overlay config, written to a scratch folder, that inherits the
user's config (``_base_`` = its absolute path) and changes only what a benchmark must:

- the train dataset reads the synthetic COCO-like set (:mod:`benchmarks.detector.coco_source`) through the config's
  own pipeline; batch size and workers as asked; mmengine's ``InfiniteSampler`` (a 64-image set would otherwise end
  an epoch, and restart the loader, every few dozen iterations, which a real COCO epoch does not);
- an ``IterBasedTrainLoop`` of ``iters`` iterations; no validation, test or checkpoint; no pretrained download
  (every ``init_cfg`` of type ``Pretrained`` dropped); ``load_from=None``; seed 0;
- :class:`benchmarks.detector.iteration_timer.IterationTimerHook` added to the config's own custom hooks.

Rows run one after another on the same device; a row that fails is reported with the tail of its log.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import pprint
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from .coco_source import CocoSource, ensure_coco_source
from .configs import FAST_PATHS_HOOK, MERGED_CONSTRUCTOR, PLUGIN_PACKAGE, PLUGIN_TYPE_BASES
from .iteration_timer import validate_windows

REPO_ROOT = Path(__file__).resolve().parents[2]
OUR_TRAIN_SCRIPT = REPO_ROOT / "tools" / "train.py"
STOCK_LAUNCHER = "benchmarks.detector.stock_train"
TIMER_MODULE = "benchmarks.detector.iteration_timer"
TIMER_HOOK = "IterationTimerHook"
SUPPORTED_DATASET = "CocoDataset"
NEVER = 10 ** 9  # an interval no benchmark reaches
SIDES = ("stock", "ours")
MODES = ("fp32", "fp16", "bf16")
AMP_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}
DEFAULT_ROWS = ("stock:fp32", "ours:fp32", "ours:bf16")
LOG_TAIL_LINES = 40
DIST_PORT = 29517  # torch.distributed.run rendezvous of multi-GPU rows (one row runs at a time)


class UnsupportedConfig(ValueError):
    """The config cannot train on the synthetic COCO source."""


@dataclass(frozen=True)
class Row:
    side: str
    mode: str

    @property
    def label(self) -> str:
        return f"{self.side}:{self.mode}"

    @property
    def stock(self) -> bool:
        return self.side == "stock"


def parse_row(text: str) -> Row:
    side, _, mode = text.partition(":")
    problems = []
    if side not in SIDES:
        problems.append(f"side {side!r} is not one of {', '.join(SIDES)}")
    if mode not in MODES:
        problems.append(f"mode {mode!r} is not one of {', '.join(MODES)}")
    if problems:
        raise argparse.ArgumentTypeError(f"row {text!r} is not SIDE:MODE: " + "; ".join(problems))
    return Row(side, mode)


@dataclass(frozen=True)
class Settings:
    """What every row of a run shares."""

    iters: int = 100
    batch_size: int = 2
    workers: int = 4
    first_iters: int = 20
    steady_start: Optional[int] = None  # None: the second half, iters // 2 + 1
    logger_interval: int = 50
    timeout_s: float = 3600.0
    gpus: int = 1  # >1: each row runs under torch.distributed.run, one process per GPU (DDP)

    def windows(self) -> Dict[str, Tuple[int, int]]:
        """The timed windows by name: ``first`` (warm-up included), ``all`` and ``steady``."""
        steady_start = self.steady_start if self.steady_start is not None else self.iters // 2 + 1
        windows = {"first": (1, min(self.first_iters, self.iters)), "all": (1, self.iters),
                   "steady": (steady_start, self.iters)}
        validate_windows(list(windows.values()))
        return windows


# ---------------------------------------------------------------------------------------------------------------------
# The overlay config
# ---------------------------------------------------------------------------------------------------------------------

def read_base_config(path: Path):
    """The user's config as mmengine merges it, without importing its custom modules."""
    from mmengine.config import Config
    return Config.fromfile(str(path), import_custom_modules=False)


def check_supported(base_cfg, path: Path) -> None:
    """Raise :class:`UnsupportedConfig` unless the config trains a plain ``CocoDataset``."""
    loader = base_cfg.get("train_dataloader")
    if not loader or "dataset" not in loader:
        raise UnsupportedConfig(f"{path} has no train_dataloader.dataset to time")
    dataset_type = str(loader["dataset"].get("type"))
    if "Panoptic" in dataset_type:
        raise UnsupportedConfig(
            f"{path} trains {dataset_type}: panoptic training needs panoptic PNG annotations, which the synthetic "
            "COCO source does not generate. Time the instance-segmentation config instead "
            "(configs/fast/mask2former_r50_8xb2-lsj-50e_coco_deform-plugin-fast.py).")
    if dataset_type.rpartition(".")[2] != SUPPORTED_DATASET:
        raise UnsupportedConfig(
            f"{path} trains {dataset_type}: the synthetic COCO source serves configs whose train dataset is mmdet's "
            f"{SUPPORTED_DATASET} (detection or instance segmentation), not dataset wrappers or other formats")


def is_pretrained(init_cfg) -> bool:
    return isinstance(init_cfg, dict) and init_cfg.get("type") == "Pretrained"


def without_pretrained(node):
    """A copy of ``node`` with every ``init_cfg`` of type ``Pretrained`` removed (a list loses those entries)."""
    if isinstance(node, dict):
        copied = {}
        for key, value in node.items():
            if key == "init_cfg" and is_pretrained(value):
                copied[key] = None
            elif key == "init_cfg" and isinstance(value, (list, tuple)):
                kept = [without_pretrained(v) for v in value if not is_pretrained(v)]
                copied[key] = kept or None
            else:
                copied[key] = without_pretrained(value)
        return copied
    if isinstance(node, (list, tuple)):
        return type(node)(without_pretrained(v) for v in node)
    return node


def pretrained_overrides(node: dict) -> dict:
    """The smallest override that mmengine merges into ``node`` to drop its pretrained ``init_cfg`` entries.

    Dicts merge key by key and lists are replaced whole, so a changed list is written out in full.
    """
    stripped = without_pretrained(node)
    overrides = {}
    for key, value in node.items():
        if stripped[key] == value:
            continue
        recurse = isinstance(value, dict) and key != "init_cfg"
        overrides[key] = pretrained_overrides(value) if recurse else stripped[key]
    return overrides


def plugin_references(node, path: str = "") -> List[str]:
    """Where a config still names deform_plugin: its modules, its hook or its optimizer constructor (paths that merely
    contain the name, such as a cache folder, do not count)."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            found.extend(plugin_references(value, f"{path}.{key}" if path else str(key)))
    elif isinstance(node, (list, tuple)):
        for index, value in enumerate(node):
            found.extend(plugin_references(value, f"{path}[{index}]"))
    elif isinstance(node, str) and (node.split(".")[0] == PLUGIN_PACKAGE or node in (FAST_PATHS_HOOK,
                                                                                     MERGED_CONSTRUCTOR)
                                    or node in PLUGIN_TYPE_BASES):
        found.append(f"{path}={node!r}")
    return found


def timer_hook(row: Row, settings: Settings, timing_file: Path) -> dict:
    return dict(type=TIMER_HOOK, windows=[list(w) for w in settings.windows().values()],
                warmup_iters=settings.windows()["first"][1], out_file=str(timing_file),
                expect_plugin=not row.stock, label=row.label)


def overlay_settings(base_cfg, row: Row, source: CocoSource, settings: Settings, timing_file: Path) -> dict:
    """The top-level keys the overlay config sets on top of ``base_cfg`` (the user's config) for ``row``."""
    base = base_cfg.to_dict()

    def replacing(key_exists: bool, value: dict) -> dict:
        # `_delete_` replaces the base dict instead of merging; mmengine only removes the flag when the key exists.
        return dict(_delete_=True, **value) if key_exists else value

    loader = base["train_dataloader"]
    overlay: Dict[str, object] = {}
    overlay["train_dataloader"] = dict(
        batch_size=settings.batch_size,
        num_workers=settings.workers,
        persistent_workers=settings.workers > 0,
        sampler=replacing("sampler" in loader, dict(type="InfiniteSampler", shuffle=True)),
        dataset=dict(data_root=source.data_root, ann_file=source.ann_file, data_prefix=dict(img=source.image_dir)))
    overlay["train_cfg"] = replacing("train_cfg" in base,
                                     dict(type="IterBasedTrainLoop", max_iters=settings.iters, val_interval=NEVER))
    for stage in ("val", "test"):
        for part in ("dataloader", "evaluator", "cfg"):
            overlay[f"{stage}_{part}"] = None
    default_hooks = base.get("default_hooks") or {}
    overlay["default_hooks"] = dict(
        logger=dict(interval=settings.logger_interval),
        checkpoint=replacing("checkpoint" in default_hooks,
                             dict(type="CheckpointHook", by_epoch=False, interval=NEVER, save_last=False)))
    overlay["log_processor"] = dict(by_epoch=False)
    overlay["randomness"] = dict(seed=0)
    overlay["load_from"] = None
    overlay["resume"] = False
    model_overrides = pretrained_overrides(base.get("model") or {})
    if model_overrides:
        overlay["model"] = model_overrides

    custom_imports = base.get("custom_imports") or {}
    imports = custom_imports.get("imports", [])
    imports = [imports] if isinstance(imports, str) else list(imports)
    hooks = copy.deepcopy(list(base.get("custom_hooks") or []))
    if row.stock:
        imports = [name for name in imports if name.split(".")[0] != PLUGIN_PACKAGE]
        hooks = [hook for hook in hooks if hook.get("type") != FAST_PATHS_HOOK]
        optim_wrapper = base.get("optim_wrapper") or {}
        if (optim_wrapper.get("constructor") == MERGED_CONSTRUCTOR
                or optim_wrapper.get("type") in PLUGIN_TYPE_BASES):
            stripped = {k: v for k, v in optim_wrapper.items() if k != "constructor"}
            stripped["type"] = PLUGIN_TYPE_BASES.get(stripped.get("type"), stripped.get("type", "OptimWrapper"))
            overlay["optim_wrapper"] = dict(_delete_=True, **stripped)
        runtime_info = default_hooks.get("runtime_info") or {}
        if runtime_info.get("type") in PLUGIN_TYPE_BASES:
            overlay["default_hooks"]["runtime_info"] = dict(
                _delete_=True, **dict(runtime_info, type=PLUGIN_TYPE_BASES[runtime_info["type"]]))
    overlay["custom_imports"] = dict(imports=imports + [TIMER_MODULE], allow_failed_imports=False)
    overlay["custom_hooks"] = hooks + [timer_hook(row, settings, timing_file)]
    return overlay


def render_overlay(base_path: Path, overlay: dict, row: Row) -> str:
    lines = [f"# Benchmark overlay ({row.label}) written by benchmarks/detector/user_path.py: the config below, "
             "timed on the synthetic COCO source.",
             f"_base_ = {str(base_path)!r}", ""]
    for key, value in overlay.items():
        lines.append(f"{key} = {pprint.pformat(value, width=110, sort_dicts=False)}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------------
# Running one row
# ---------------------------------------------------------------------------------------------------------------------

def row_command(row: Row, overlay_path: Path, work_dir: Path, gpus: int = 1) -> List[str]:
    """The training command line a user would type for this row (with ``gpus`` > 1: as tools/dist_train.sh runs
    it, one process per GPU under ``torch.distributed.run``)."""
    launcher = [sys.executable]
    if gpus > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={gpus}",
                    f"--master_port={DIST_PORT}"]
    if row.stock:
        command = launcher + ["-m", STOCK_LAUNCHER, str(overlay_path), "--work-dir", str(work_dir)]
        if row.mode in AMP_DTYPES:
            # mmdet's script has --amp (float16) only; the dtype is the AmpOptimWrapper's own option.
            command += ["--amp", "--cfg-options", f"optim_wrapper.dtype={AMP_DTYPES[row.mode]}"]
    else:
        command = launcher + [str(OUR_TRAIN_SCRIPT), str(overlay_path), "--work-dir", str(work_dir)]
        if row.mode in AMP_DTYPES:
            command += ["--amp-dtype", AMP_DTYPES[row.mode]]
    if gpus > 1:
        command += ["--launcher", "pytorch"]
    return command


def child_environment() -> Dict[str, str]:
    env = dict(os.environ)
    # The timing hook and the stock launcher are imported from this checkout, installed or not.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as error:
        return f"(no log: {error})"


def run_child(command: Sequence[str], log_path: Path, timeout_s: float) -> Tuple[Optional[int], float]:
    """Run ``command`` with its output in ``log_path``; returns (exit status or None on timeout, seconds)."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(command) + "\n")
        log.flush()
        # A session of its own, so a timeout also ends the dataloader workers the child started.
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=child_environment(), stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            returncode = None
    return returncode, time.perf_counter() - start


def run_row(config_path: Path, base_cfg, row: Row, source: CocoSource, settings: Settings, scratch: Path,
            out_dir: Path) -> dict:
    """Write the row's overlay, train it in a child process, and return its result (``status`` ok or failed)."""
    name = f"{config_path.stem}__{row.side}-{row.mode}"
    timing_file = scratch / "timing" / f"{name}.json"
    work_dir = scratch / "work_dirs" / name
    overlay_path = scratch / "configs" / f"{name}.py"
    log_path = out_dir / "logs" / f"{name}.log"
    for folder in (timing_file.parent, work_dir, overlay_path.parent, log_path.parent, out_dir / "configs"):
        folder.mkdir(parents=True, exist_ok=True)
    overlay_path.write_text(render_overlay(config_path, overlay_settings(base_cfg, row, source, settings,
                                                                         timing_file), row))
    shutil.copy(overlay_path, out_dir / "configs" / overlay_path.name)  # kept for reruns by hand
    command = row_command(row, overlay_path, work_dir, settings.gpus)
    result = dict(config=str(config_path), row=row.label, command=command, log=str(log_path), status="failed",
                  returncode=None, wall_s=None, timing=None, error=None)
    if row.stock:
        leftovers = plugin_references(read_base_config(overlay_path).to_dict())
        if leftovers:
            result["error"] = "the stock overlay still names deform_plugin: " + ", ".join(leftovers)
            return result
    returncode, wall_s = run_child(command, log_path, settings.timeout_s)
    result.update(returncode=returncode, wall_s=wall_s)
    if returncode is None:
        result["error"] = f"timed out after {settings.timeout_s:.0f} s\n{log_tail(log_path)}"
    elif returncode != 0:
        result["error"] = f"exit status {returncode}\n{log_tail(log_path)}"
    elif not timing_file.is_file():
        result["error"] = f"training ended without writing {timing_file}\n{log_tail(log_path)}"
    else:
        result.update(status="ok", timing=json.loads(timing_file.read_text()))
    return result


def run_benchmark(config_paths: Sequence[Path], rows: Sequence[Row], settings: Settings, source: CocoSource,
                  out_dir: Path, keep_work_dirs: bool = False, progress=print) -> List[dict]:
    """Every row on every config, one child process at a time; the results in that order."""
    config_paths = [Path(p).resolve() for p in config_paths]
    base_cfgs = {}
    for path in config_paths:
        base_cfgs[path] = read_base_config(path)
        check_supported(base_cfgs[path], path)  # every config before any training
    scratch = Path(tempfile.mkdtemp(prefix="train_benchmark_"))
    results = []
    try:
        for path in config_paths:
            for row in rows:
                progress(f"[{len(results) + 1}/{len(config_paths) * len(rows)}] {path.name} {row.label} ...")
                result = run_row(path, base_cfgs[path], row, source, settings, scratch, out_dir)
                progress(f"    {result['status']} in {result['wall_s'] or 0:.0f} s (log: {result['log']})")
                results.append(result)
    finally:
        if keep_work_dirs:
            progress(f"work dirs kept in {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    return results


# ---------------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Training speed of mmdet configs along the user's path (training scripts + mmengine Runner + "
                    "the config's data pipeline on a synthetic COCO-like set), stock mmdet/mmcv and deform_plugin "
                    "rows each in its own process.")
    parser.add_argument("configs", nargs="+", type=Path, help="config files (detection or instance segmentation)")
    parser.add_argument("--rows", nargs="+", type=parse_row, default=[parse_row(r) for r in DEFAULT_ROWS],
                        help="SIDE:MODE rows, SIDE in stock|ours, MODE in fp32|fp16|bf16; the first row is the "
                             "speedup baseline (default: %(default)s)")
    parser.add_argument("--iters", type=int, default=Settings.iters, help="training iterations per row")
    parser.add_argument("--batch-size", type=int, default=Settings.batch_size, help="images per iteration")
    parser.add_argument("--workers", type=int, default=Settings.workers, help="dataloader workers")
    parser.add_argument("--first-iters", type=int, default=Settings.first_iters,
                        help="the warm-up window 1..N, and the iteration after which new kernel compiles count")
    parser.add_argument("--steady-start", type=int, default=None,
                        help="first iteration of the steady-state window (default: the second half of --iters)")
    parser.add_argument("--logger-interval", type=int, default=Settings.logger_interval)
    parser.add_argument("--images", type=int, default=64, help="images in the synthetic COCO-like set")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic set")
    parser.add_argument("--data-cache", type=Path, default=None,
                        help="where the synthetic set is generated (default: $DEFORM_PLUGIN_DATA or "
                             "~/.cache/deform_plugin)")
    parser.add_argument("--timeout", type=float, default=Settings.timeout_s, help="seconds allowed per row")
    parser.add_argument("--out-dir", type=Path, default=Path("bench_results/train"),
                        help="JSON, CSV and Markdown results, row logs and overlay configs")
    parser.add_argument("--keep-work-dirs", action="store_true", help="keep the rows' mmengine work dirs")
    parser.add_argument("--gpus", type=int, default=1,
                        help="GPUs per row: >1 runs each row with DDP, one process per GPU (--batch-size per GPU)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    from .train_report import summarize, write_reports
    args = build_parser().parse_args(argv)
    settings = Settings(iters=args.iters, batch_size=args.batch_size, workers=args.workers,
                        first_iters=args.first_iters, steady_start=args.steady_start,
                        logger_interval=args.logger_interval, timeout_s=args.timeout, gpus=args.gpus)
    try:
        settings.windows()
    except ValueError as error:
        raise SystemExit(f"--iters/--first-iters/--steady-start: {error}")
    source = ensure_coco_source(args.data_cache, args.images, args.seed)
    out_dir = args.out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        results = run_benchmark(args.configs, args.rows, settings, source, out_dir, args.keep_work_dirs)
    except UnsupportedConfig as error:
        raise SystemExit(str(error))
    report = summarize(results, settings, source)
    print(write_reports(report, out_dir))
    return 0 if all(r["status"] == "ok" for r in results) else 1
