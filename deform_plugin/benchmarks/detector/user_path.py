"""Training speed along the user's path: the training scripts and mmengine's Runner, one child process per row.

A row is ``SIDE:MODE``:

    SIDE  ours   our ``tools/train.py`` (imports deform_plugin) on the config as given: pass configs/fast/... for
                 the fast variants
          stock  mmdet's own ``tools/train.py`` from the mmdet wheel, through :mod:`.stock_train`,
                 in a process that never imports deform_plugin; every deform_plugin piece of the config is stripped
    MODE  fp32 | fp16 | bf16   (mixed precision through each script's own switch: ``--amp-dtype`` for ours, ``--amp``
                 plus ``optim_wrapper.dtype`` for mmdet's)

Each row trains for ``iters`` iterations on an overlay config, written to a scratch folder, that inherits the
user's config (``_base_`` = its absolute path) and changes only what a benchmark must:

- the train dataset reads a synthetic COCO-like set through the config's own pipeline: :mod:`.coco_source`'s
  for detection and instance segmentation, :mod:`.coco_panoptic_source`'s (panoptic PNGs) for panoptic
  segmentation; batch size and workers as asked; mmengine's ``InfiniteSampler`` (a 64-image set would otherwise end
  an epoch, and restart the loader, every few dozen iterations, which a real COCO epoch does not);
- an ``IterBasedTrainLoop`` of ``iters`` iterations; no validation, test or checkpoint; no pretrained download
  (every ``init_cfg`` of type ``Pretrained`` dropped); ``load_from=None``; seed 0;
- :class:`.iteration_timer.IterationTimerHook` added to the config's own custom hooks, and with
  ``--profile FIRST:STEPS`` :class:`.step_profiler.StepProfilerHook` (per-rank profiles of those
  iterations in ``OUT_DIR/profiles/<row>/``).

Rows run one after another on the same device; a row that fails is reported with the tail of its log. With
``--gpus 1 N``, every row runs on one GPU and then on N (each count in turn, every row), and the report adds the
scaling against one GPU and each rank's compute, all-reduce and wait (:mod:`.rank_steps`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from ..common import REPO_ROOT
from ..stock_process import stock_command
from .coco_panoptic_source import ensure_coco_panoptic_source
from .coco_source import CocoSource, ensure_coco_source
from .random_text_encoder import TEXT_ENCODER_CHOICES, TIMING_ONLY_LABEL, random_text_encoder_override
from .train_overlay import (NEVER, PANOPTIC, ROW_GRAMMAR, TIMER_HOOK, TIMER_MODULE, Row, Settings,  # noqa: F401
                            UnsupportedConfig, check_supported, overlay_settings, parse_row, plugin_references,
                            read_base_config, render_overlay)

OUR_TRAIN_SCRIPT = REPO_ROOT / "tools" / "train.py"
STOCK_TRAIN_MODULE = "deform_plugin.benchmarks.detector.stock_train"
AMP_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}
DEFAULT_ROWS = ("stock:fp32", "ours:fp32", "ours:bf16")
LOG_TAIL_LINES = 40


# ---------------------------------------------------------------------------------------------------------------------
# Running one row
# ---------------------------------------------------------------------------------------------------------------------

def free_port() -> int:
    """A TCP port of this host that nothing listens on now, for a multi-GPU row's rendezvous: a fixed port would
    still be held by the previous row's ranks while NCCL shuts down, or by another benchmark on the same host."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def row_command(row: Row, overlay_path: Path, work_dir: Path, gpus: int = 1,
                numa_binding: Optional[str] = None, port: Optional[int] = None) -> List[str]:
    """The training command line a user would type for this row (with ``gpus`` > 1: as tools/dist_train.sh runs
    it, one process per GPU under ``torch.distributed.run`` rendezvousing on ``port``, a free one when None;
    ``numa_binding`` is its ``--numa-binding`` mode, or None)."""
    launcher = [sys.executable]
    if gpus > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={gpus}",
                    f"--master_port={port or free_port()}"]
        if numa_binding:
            launcher.append(f"--numa-binding={numa_binding}")
    if row.stock:
        command = launcher + stock_command(STOCK_TRAIN_MODULE) + [str(overlay_path), "--work-dir", str(work_dir)]
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


def child_environment(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ, **(extra or {}))
    # Our rows import deform_plugin (and the timing hook in it) from this checkout, installed or not.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as error:
        return f"(no log: {error})"


def run_child(command: Sequence[str], log_path: Path, timeout_s: float,
              env: Optional[Dict[str, str]] = None) -> Tuple[Optional[int], float]:
    """Run ``command`` (``env``: variables added to the child's environment) with its output in ``log_path``;
    returns (exit status or None on timeout, seconds)."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(command) + "\n")
        log.flush()
        # A session of its own, so a timeout also ends the dataloader workers the child started.
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=child_environment(env), stdout=log,
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
    name = f"{config_path.stem}__{row.label.replace(':', '-')}"
    if settings.gpus > 1:  # the same row may also run on one GPU (--gpus 1 N)
        name += f"__{settings.gpus}gpus"
    # In the out dir: a benchmark cut short keeps the timing of every row that finished.
    timing_file = out_dir / TIMING_FOLDER / f"{name}.json"
    work_dir = scratch / "work_dirs" / name
    overlay_path = scratch / "configs" / f"{name}.py"
    log_path = out_dir / "logs" / f"{name}.log"
    for folder in (timing_file.parent, work_dir, overlay_path.parent, log_path.parent, out_dir / "configs"):
        folder.mkdir(parents=True, exist_ok=True)
    profile_dir = out_dir / "profiles" / name
    overlay_path.write_text(render_overlay(config_path, overlay_settings(base_cfg, row, source, settings,
                                                                         timing_file, profile_dir), row))
    shutil.copy(overlay_path, out_dir / "configs" / overlay_path.name)  # kept for reruns by hand
    command = row_command(row, overlay_path, work_dir, settings.gpus, settings.numa_binding)
    result = dict(config=str(config_path), row=row.label, gpus=settings.gpus, command=command, log=str(log_path),
                  status="failed",
                  returncode=None, wall_s=None, timing=None, error=None,
                  text_encoder=TIMING_ONLY_LABEL if random_text_encoder_override(base_cfg, settings.text_encoder)
                  else None)
    if row.stock:
        leftovers = plugin_references(read_base_config(overlay_path).to_dict())
        if leftovers:
            result["error"] = "the stock overlay still names deform_plugin: " + ", ".join(leftovers)
            return result
    env = row_environment(row, scratch / "triton_cache" / name)
    returncode, wall_s = run_child(command, log_path, settings.timeout_s, env)
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


# Seconds a row is assumed to take (process start, Runner, a short run) before one has finished, under --deadline;
# and the seconds kept after the last row for the report.
FIRST_ROW_S = 60.0
REPORT_RESERVE_S = 5.0


def skipped_row(config_path: Path, row: Row, gpus: int, reason: str) -> dict:
    """The result of a row that did not run, shaped as :func:`run_row`'s."""
    return dict(config=str(config_path), row=row.label, gpus=gpus, command=None, log=None, status="skipped",
                returncode=None, wall_s=None, timing=None, error=reason, text_encoder=None)


def row_environment(row: Row, cold_cache_dir: Path) -> Optional[Dict[str, str]]:
    """The variables a row's process gets besides this one's (None: none): an empty Triton cache of its own for a
    cold row, as a first run on a new machine has; cuDNN's v7 API (read at the process's first convolution) for a
    ``cudnn-v7`` row."""
    env = {}
    if row.cold_cache:
        env["TRITON_CACHE_DIR"] = str(cold_cache_dir)
    if row.cudnn_v7:
        from deform_plugin.conv_planning import CUDNN_V8_API_DISABLED
        env[CUDNN_V8_API_DISABLED] = "1"
    return env or None


def synthetic_source(kind: str, cache_root: Optional[Path], num_images: int, seed: int) -> CocoSource:
    """The synthetic set a config of ``kind`` (:func:`check_supported`) trains on, generated first if need be."""
    ensure = ensure_coco_panoptic_source if kind == PANOPTIC else ensure_coco_source
    return ensure(cache_root, num_images, seed)


def run_benchmark(config_paths: Sequence[Path], rows: Sequence[Row], settings: Settings, source, out_dir: Path,
                  keep_work_dirs: bool = False, progress=print,
                  gpu_counts: Optional[Sequence[int]] = None, deadline: Optional[float] = None,
                  clock=time.monotonic) -> List[dict]:
    """Every row on every config, on each of ``gpu_counts`` (default: ``settings.gpus``), one child process (or one
    torch.distributed.run) at a time; the results in that order (config, then GPU count, then row). ``source``: the
    :class:`CocoSource` of every config, or a function from a config's dataset kind (:func:`check_supported`) to
    its set. ``deadline`` (a ``clock()`` time): a row runs only while what is left of it is at least the longest
    finished row took (:data:`FIRST_ROW_S` before any), and at most until it; the rows left are ``skipped``."""
    gpu_counts = list(gpu_counts or [settings.gpus])
    config_paths = [Path(p).resolve() for p in config_paths]
    base_cfgs, sources = {}, {}
    for path in config_paths:
        base_cfgs[path] = read_base_config(path)
        kind = check_supported(base_cfgs[path], path)  # every config before any training
        sources[path] = source(kind) if callable(source) else source
    scratch = Path(tempfile.mkdtemp(prefix="train_benchmark_"))
    results = []
    try:
        total = len(config_paths) * len(gpu_counts) * len(rows)
        for path in config_paths:
            for gpus in gpu_counts:
                on_gpus = dataclasses.replace(settings, gpus=gpus)
                for row in rows:
                    where = "" if gpu_counts == [1] else f" on {gpus} GPU" + ("s" if gpus > 1 else "")
                    progress(f"[{len(results) + 1}/{total}] {path.name} {row.label}{where} ...")
                    limited = on_gpus
                    if deadline is not None:
                        left = deadline - clock()
                        needed = max([r["wall_s"] or 0.0 for r in results if r["status"] == "ok"] or [FIRST_ROW_S])
                        if left < needed:
                            results.append(skipped_row(path, row, gpus, f"not started: {max(left, 0):.0f} s were left "
                                                       f"before --deadline, and a row takes about {needed:.0f} s"))
                            progress(f"    skipped: {results[-1]['error']}")
                            continue
                        limited = dataclasses.replace(on_gpus, timeout_s=min(on_gpus.timeout_s, left))
                    result = run_row(path, base_cfgs[path], row, sources[path], limited, scratch, out_dir)
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
    parser.add_argument("configs", nargs="*", type=Path,
                        help="config files (detection, instance or panoptic segmentation)")
    parser.add_argument("--rows", nargs="+", type=parse_row, default=[parse_row(r) for r in DEFAULT_ROWS],
                        help=f"{ROW_GRAMMAR} rows, SIDE in stock|ours, MODE in "
                             "fp32|fp16|bf16; no-buckets removes the config's ShapeBucketsHook, cold gives the row an "
                             "empty Triton cache, cudnn-v7 selects cuDNN's v7 convolution API, own-shapes lets each "
                             "rank of a multi-GPU row pad to its own bucket; the first row is the "
                             f"speedup baseline (default: {' '.join(DEFAULT_ROWS)})")
    parser.add_argument("--iters", type=int, default=Settings.iters, help="training iterations per row")
    parser.add_argument("--batch-size", type=int, default=Settings.batch_size, help="images per iteration")
    parser.add_argument("--workers", type=int, default=Settings.workers, help="dataloader workers")
    parser.add_argument("--first-iters", type=int, default=Settings.first_iters,
                        help="the warm-up window 1..N, and the iteration after which new kernel compiles count")
    parser.add_argument("--steady-start", type=int, default=None,
                        help="first iteration of the steady-state window (default: the second half of --iters)")
    parser.add_argument("--logger-interval", type=int, default=Settings.logger_interval)
    parser.add_argument("--images", type=int, default=64, help="images in the synthetic COCO-like sets")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic set")
    parser.add_argument("--data-cache", type=Path, default=None,
                        help="where the synthetic set is generated (default: $DEFORM_PLUGIN_DATA or "
                             "~/.cache/deform_plugin)")
    parser.add_argument("--timeout", type=float, default=Settings.timeout_s, help="seconds allowed per row")
    parser.add_argument("--deadline", type=float, default=None, metavar="S",
                        help="seconds from the start by which the report is written: a row starts only while what is "
                             "left is at least what the longest finished row took, and stops by then; the rows that do "
                             "not fit are reported as skipped (for calls with a time limit)")
    parser.add_argument("--out-dir", type=Path, default=Path("bench_results/train"),
                        help="JSON, CSV and Markdown results, row logs and overlay configs")
    parser.add_argument("--keep-work-dirs", action="store_true", help="keep the rows' mmengine work dirs")
    parser.add_argument("--gpus", type=parse_gpu_count, nargs="+", default=[1], metavar="N",
                        help="GPUs per row: >1 runs each row data-parallel, one process per GPU (--batch-size per "
                             "GPU); several counts (--gpus 1 4) run every row on each, and the report adds the "
                             "scaling against one GPU and, under FlatGradientsDataParallel, each rank's compute, "
                             "all-reduce, wait for slower ranks and the communication estimate")
    parser.add_argument("--numa-binding", default=None, metavar="MODE",
                        help="with --gpus > 1: bind each rank to the CPUs near its GPU (torch.distributed.run's "
                             "--numa-binding: node, socket, exclusive or core-complex)")
    parser.add_argument("--text-encoder", choices=TEXT_ENCODER_CHOICES, default=Settings.text_encoder,
                        help="Grounding-DINO's BERT: random (a random text encoder of its shape, for timing only), "
                             "real (bert-base-uncased's files, from the Hugging Face cache), or auto (random where "
                             "those files are missing); every row of a config uses the same")
    parser.add_argument("--profile", type=parse_profile_window, default=None, metavar="FIRST:STEPS",
                        help="profile STEPS iterations from iteration FIRST on every rank (torch.profiler tables "
                             "and a Chrome trace per rank in OUT_DIR/profiles/; profiled iterations run slower)")
    parser.add_argument("--report-only", type=Path, default=None, metavar="DIR",
                        help="train nothing: the report of the rows whose timing files an earlier run left in "
                             "DIR/timing (a run cut short keeps its finished rows there), in the order they finished; "
                             "pass that run's --iters, --steady-start, --batch-size and --images; the report goes to "
                             "--out-dir")
    return parser


TIMING_FOLDER = "timing"


def results_from_timing_files(run_dir: Path) -> List[dict]:
    """The rows of an earlier run from the timing files it left in ``run_dir/timing`` (named
    ``CONFIG__ROW[__NgpuS].json``), in the order they were written: each config's first row is its baseline, as in
    the run. A ValueError names a missing folder or a file of another shape."""
    folder = run_dir / TIMING_FOLDER
    files = sorted(folder.glob("*.json"), key=lambda path: (path.stat().st_mtime, path.name))
    if not files:
        raise ValueError(f"{folder} holds no timing files (*.json) of a training benchmark")
    results = []
    for path in files:
        config_stem, separator, rest = path.stem.partition("__")
        timing = json.loads(path.read_text())
        if not separator or not isinstance(timing, dict) or "label" not in timing or "windows" not in timing:
            raise ValueError(f"{path} is not a timing file of this benchmark (CONFIG__ROW.json with a label and "
                             "windows)")
        _, _, gpu_count = rest.partition("__")  # run_row's name: CONFIG__ROW, then __Ngpus on several GPUs
        gpus = int(gpu_count[:-len("gpus")]) if gpu_count.endswith("gpus") else 1
        results.append(dict(config=f"{config_stem}.py", row=timing["label"], gpus=gpus, status="ok", timing=timing,
                            log=None, error=None, wall_s=None, text_encoder=None))
    return results


def parse_gpu_count(text: str) -> int:
    """A GPU count >= 1; an argparse error names the bad text."""
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"--gpus {text!r} is not a whole number >= 1")
    return count


def parse_profile_window(text: str) -> Tuple[int, int]:
    """``FIRST:STEPS`` as two positive ints; an argparse error names the bad text."""
    try:
        first, steps = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--profile {text!r} is not FIRST:STEPS (two ints)")
    if first < 1 or steps < 1:
        raise argparse.ArgumentTypeError(f"--profile {text!r}: FIRST and STEPS must be >= 1")
    return first, steps


def main(argv: Optional[Sequence[str]] = None) -> int:
    from .train_report import summarize, write_reports
    started = time.monotonic()
    args = build_parser().parse_args(argv)
    if args.deadline is not None and not args.deadline > REPORT_RESERVE_S:
        raise SystemExit(f"--deadline {args.deadline:g}: give more than the {REPORT_RESERVE_S:g} s kept for the report")
    settings = Settings(iters=args.iters, batch_size=args.batch_size, workers=args.workers,
                        first_iters=args.first_iters, steady_start=args.steady_start,
                        logger_interval=args.logger_interval, timeout_s=args.timeout, gpus=args.gpus[0],
                        numa_binding=args.numa_binding,
                        profile_first=args.profile[0] if args.profile else None,
                        profile_steps=args.profile[1] if args.profile else 3, text_encoder=args.text_encoder)
    try:
        settings.windows()
    except ValueError as error:
        raise SystemExit(f"--iters/--first-iters/--steady-start: {error}")
    if args.profile and sum(args.profile) - 1 > args.iters:
        raise SystemExit(f"--profile {args.profile[0]}:{args.profile[1]} ends after --iters {args.iters}")
    out_dir = args.out_dir.resolve()
    if args.report_only is not None:
        try:
            results = results_from_timing_files(args.report_only)
        except ValueError as error:
            raise SystemExit(f"--report-only: {error}")
        out_dir.mkdir(parents=True, exist_ok=True)
        source = CocoSource(Path("(not regenerated)"), args.images, args.seed)
        print(write_reports(summarize(results, settings, source), out_dir))
        return 0
    if not args.configs:
        raise SystemExit("give one or more config files (or --report-only DIR)")
    out_dir.mkdir(parents=True, exist_ok=True)
    used: Dict[str, CocoSource] = {}

    def source_of(kind: str) -> CocoSource:
        if kind not in used:
            used[kind] = synthetic_source(kind, args.data_cache, args.images, args.seed)
        return used[kind]
    try:
        deadline = None if args.deadline is None else started + args.deadline - REPORT_RESERVE_S
        results = run_benchmark(args.configs, args.rows, settings, source_of, out_dir, args.keep_work_dirs,
                                gpu_counts=list(dict.fromkeys(args.gpus)), deadline=deadline)
    except UnsupportedConfig as error:
        raise SystemExit(str(error))
    report = summarize(results, settings, next(iter(used.values())))
    print(write_reports(report, out_dir))
    return 0 if all(r["status"] == "ok" for r in results) else 1
