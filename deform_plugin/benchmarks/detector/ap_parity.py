"""AP parity: do deform_plugin's fast configs learn what stock mmdet learns? Many short trainings at once, then
bbox mAP over seeds per row against stock.

    python tools/ap_parity.py --rows stock:fp32 ours:fp32 ours:bf16 ours:bf16:no-buckets --iters auto \\
        --deadline 520 --work-dir /tmp/ap_parity --out-dir results

For each config (:data:`.ap_parity_config.PARITY_CONFIGS`), row and seed, one training run in a process of its own:
stock rows through mmdet's own ``tools/train.py`` in a process that never imports deform_plugin (mmcv's compiled
MSDA on a GPU, its pure-PyTorch path on a CPU); ``ours`` rows through our ``tools/train.py`` on the
``configs/fast/`` file as shipped (``--amp-dtype bfloat16`` for bf16; ``:no-buckets`` drops ``ShapeBucketsHook``).
Every run trains the same schedule on the embedded shapes set with a random-resize pipeline, from the same initial
weights per seed, and is evaluated on the val split (:mod:`.ap_parity_config` says exactly what each run's config
changes; :mod:`.ap_parity_study` runs them). Then :mod:`.ap_parity_report` aggregates.

Steps:

1. the shapes set (generated if missing) and, with ``--val-images N``, a val annotation file of its first N images;
2. at once: per config, a stock process that builds the initial weights of every seed (:mod:`.initial_weights`);
   on a GPU, ``python -m deform_plugin warmup`` filling Triton's cache for the ``ours`` rows; and the runs,
   ``--per-gpu`` processes at a time on each GPU of ``--gpus`` (default: every run at once, spread over every
   visible GPU), slowest rows first. A run starts while its initial weights are built and waits for them before
   loading them. Each run's files are in ``WORK_DIR/runs/<config>__<row>__seed<seed>/`` (``config.py``,
   ``train.log``, mmengine's files, ``run.json``); a progress line per config every ``--progress-every`` seconds;
3. the report: ``ap_parity.{md,json,csv}`` and ``ap_parity_<config>.png`` in ``--out-dir``.

Pacing: where every run runs at once (the default), no run trains more than 10 iterations (``PACE_SLACK``) ahead
of the slowest running run of its config (:class:`.parity_hook.ParityRunHook` waits on a file the tool updates):
the fast rows leave the GPU to stock's, so that the rows finish together instead of stock alone at the end.

Time: ``--iters N`` trains N iterations; ``--iters auto`` (with ``--deadline``) trains as many as fit: once every
run of a config is past its warm-up, the tool measures its slowest run's paced speed for ``CALIBRATE_S`` seconds
and sets the config's iterations (``AUTO_SAFETY`` of what that run would reach before training stops), learning
rate step and halfway validation, the same for every row (:func:`.ap_parity_study.decide_schedule`).
``--time-limit S`` ends each run's training after S seconds (it is then still evaluated, and the report flags it);
``--deadline S`` is the whole tool's budget from its start: training stops by ``S - EVAL_RESERVE_S -
REPORT_RESERVE_S``, runs still going at ``S - REPORT_RESERVE_S`` are killed, and the report is written by ``S``.
Rows compared at different iterations would not test parity: a run that stopped early is named in the report and
left out of its statistics.
``--report-only WORK_DIR [WORK_DIR ...]`` aggregates finished runs again; several work dirs that trained the same
schedule make one report (stock in one device call, the fast rows in another: the first dir's first row is the
baseline, and a run in two dirs is refused); ``--dry-run`` prints the plan and each derived config's key fields and
runs nothing.
"""
from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import warnings
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from ..common import REPO_ROOT
from . import ap_parity_study as study_module
from .ap_parity_config import (
    BACKBONE_MODES,
    PARITY_CONFIGS,
    Schedule,
    ToolError,
    key_fields,
    prepare_data,
    scale_problems,
)
from .ap_parity_processes import init_dir
from .ap_parity_study import PLAN_FILE, Study, report, run_study
from .parity_hook import read_json
from .train_overlay import ROW_OPTIONS, parse_row, read_base_config

PARITY_ROW_GRAMMAR = "SIDE:MODE" + "".join(f"[:{option}]" for option in ROW_OPTIONS if option != "own-shapes")


def parse_parity_row(text: str):
    """A row as the training benchmark parses it, less ``own-shapes``: each parity run trains on one GPU, where that
    option would change nothing but the label."""
    row = parse_row(text)
    if row.own_shapes:
        raise argparse.ArgumentTypeError(f"row {text!r}: own-shapes pads per rank under several GPUs, and every AP "
                                         f"parity run trains on one ({PARITY_ROW_GRAMMAR})")
    return row

DEFAULT_CONFIGS = ("ddetr", "dino")
DEFAULT_ROWS = ("stock:fp32", "ours:fp32", "ours:bf16")
DEFAULT_SEEDS = (0, 1, 2)


def usage_error(message: str):
    """End the tool as the project's tools end a bad option: ``error: MESSAGE`` on stderr, exit status 2."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)

def parse_gpus(text: str) -> List[int]:
    try:
        gpus = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpus {text!r} is not a comma-separated list of GPU indices")
    if not gpus or any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
        raise argparse.ArgumentTypeError(f"--gpus {text!r} must name distinct GPU indices >= 0")
    return gpus

def parse_iters(text: str):
    """``--iters``: a positive int, or ``auto``."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--iters {text!r} is neither a number of iterations nor 'auto'")

def build_parser() -> argparse.ArgumentParser:
    d = Schedule()
    parser = argparse.ArgumentParser(
        prog="tools/ap_parity.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="The tool's module docstring (deform_plugin/benchmarks/detector/ap_parity.py) explains the steps.")
    parser.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), metavar="NAME",
                        help=f"model families: {', '.join(PARITY_CONFIGS)} (default: {' '.join(DEFAULT_CONFIGS)})")
    parser.add_argument("--rows", nargs="+", type=parse_parity_row,
                        default=[parse_parity_row(r) for r in DEFAULT_ROWS], metavar=PARITY_ROW_GRAMMAR,
                        help="rows as tools/benchmark_train.py names them; the first is the baseline the target is "
                             f"checked against (default: {' '.join(DEFAULT_ROWS)})")
    parser.add_argument("--seeds", nargs="+", type=int, default=list(DEFAULT_SEEDS))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--gpus", type=parse_gpus, default=None, metavar="0,1",
                        help="GPU indices to spread the runs over (default: every visible GPU)")
    parser.add_argument("--per-gpu", type=int, default=None, metavar="N",
                        help="runs at a time per GPU (on the CPU: in all); default: every run at once")
    parser.add_argument("--iters", type=parse_iters, default=d.iters, metavar="N|auto",
                        help=f"training iterations per run (default {d.iters}); auto: as many as fit before the "
                             "deadline, decided per config during the run from its slowest run's paced speed (needs "
                             "--deadline)")
    parser.add_argument("--max-iters", type=int, default=3000, help="with --iters auto: at most this many")
    parser.add_argument("--batch-size", type=int, default=d.batch_size)
    parser.add_argument("--scales", type=int, nargs="+", default=list(d.scales), metavar="SIDE",
                        help="square training sizes, one picked at random per image (keep_ratio resize)")
    parser.add_argument("--test-scale", type=int, default=d.test_scale, metavar="SIDE")
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--backbone-lr-mult", type=float, default=d.backbone_lr_mult)
    parser.add_argument("--warmup-iters", type=int, default=d.warmup_iters)
    parser.add_argument("--backbone", choices=BACKBONE_MODES, default=d.backbone,
                        help="trainable: the ResNet trains from scratch (no frozen stages, BatchNorm learning); "
                             "as-config: the config's frozen stem and BatchNorm")
    parser.add_argument("--workers", type=int, default=d.workers, help="dataloader workers per run")
    parser.add_argument("--threads", type=int, default=1, help="OMP/MKL threads per run")
    parser.add_argument("--val-images", type=int, default=None, metavar="N",
                        help="evaluate on the val split's first N images (default: all)")
    parser.add_argument("--val-batch-size", type=int, default=d.val_batch_size,
                        help="images per evaluation batch (the test images all have one size: no padding)")
    parser.add_argument("--val-every", type=int, default=d.val_every, metavar="ITERS",
                        help="also validate every ITERS iterations (default: halfway; 0: at the end only)")
    parser.add_argument("--logger-interval", type=int, default=d.logger_interval,
                        help="iterations per logged (mean) loss")
    parser.add_argument("--time-limit", type=float, default=None, metavar="S",
                        help="stop each run's training after S seconds (then evaluate; flagged in the report)")
    parser.add_argument("--deadline", type=float, default=None, metavar="S",
                        help="the whole tool's wall-clock budget in seconds; the report is written before it ends")
    parser.add_argument("--no-pace", action="store_true",
                        help="do not pace the runs of a config (by default none runs more than "
                             f"{study_module.PACE_SLACK} iterations ahead of its slowest run, so that fast rows "
                             "leave the GPU to slow ones)")
    parser.add_argument("--no-warmup", action="store_true",
                        help="do not fill Triton's cache with `python -m deform_plugin warmup` before the runs")
    parser.add_argument("--data-cache", type=Path, default=None,
                        help="the shapes set's cache folder (default: $DEFORM_PLUGIN_DATA or ~/.cache/deform_plugin)")
    parser.add_argument("--work-dir", type=Path, default=Path("work_dirs/ap_parity"),
                        help="runs, logs, initial weights and checkpoints (large: keep it off a results folder)")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="the report's files (default: WORK_DIR/report)")
    parser.add_argument("--progress-every", type=float, default=30.0, metavar="S")
    parser.add_argument("--report-only", type=Path, nargs="+", default=None, metavar="WORK_DIR",
                        help="aggregate the finished runs of WORK_DIR again, or of several work dirs that trained "
                        "the same schedule into one report (the first one's first row is the baseline); runs nothing")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the plan and each derived config's key fields; runs nothing")
    return parser

def schedule_from(args) -> Schedule:
    auto = args.iters == "auto"
    return Schedule(iters=args.max_iters if auto else args.iters, auto=auto, batch_size=args.batch_size,
                    scales=tuple(args.scales),
                    test_scale=args.test_scale, lr=args.lr, backbone_lr_mult=args.backbone_lr_mult,
                    warmup_iters=args.warmup_iters, workers=args.workers, val_batch_size=args.val_batch_size,
                    logger_interval=args.logger_interval, val_every=args.val_every, backbone=args.backbone)

def argument_problems(args, visible_gpus: int, check_device: bool = True) -> List[str]:
    """Every bad value of the command line, one message each (empty when all are good)."""
    problems = [f"--configs: unknown config {name!r} (known: {', '.join(PARITY_CONFIGS)})"
                for name in args.configs if name not in PARITY_CONFIGS]
    for option, values in (("--configs", args.configs), ("--rows", [r.label for r in args.rows]),
                           ("--seeds", args.seeds)):
        repeated = sorted({str(v) for v in values if list(values).count(v) > 1})
        if repeated:
            problems.append(f"{option}: {', '.join(repeated)} given more than once")
    problems += schedule_from(args).problems()
    if args.threads < 1:
        problems.append(f"--threads {args.threads} must be at least 1")
    if args.per_gpu is not None and args.per_gpu < 1:
        problems.append(f"--per-gpu {args.per_gpu} must be at least 1")
    if args.val_images is not None and args.val_images < 1:
        problems.append(f"--val-images {args.val_images} must be at least 1")
    if args.iters == "auto" and args.deadline is None:
        problems.append("--iters auto needs --deadline: the schedule is what fits before it")
    if args.iters == "auto" and args.no_pace:
        problems.append("--iters auto needs the runs paced (drop --no-pace): the slowest run's speed sets it")
    if args.time_limit is not None and not args.time_limit > 0:
        problems.append(f"--time-limit {args.time_limit} must be positive")
    reserved = study_module.EVAL_RESERVE_S + study_module.REPORT_RESERVE_S  # read here: tests shorten them
    if args.deadline is not None and args.deadline <= reserved:
        problems.append(f"--deadline {args.deadline:g} leaves no time to train: it must exceed the {reserved:g} s "
                        "kept for evaluation and the report")
    if args.device == "cpu":
        problems += [f"--rows {row.label}: mixed precision ({row.mode}) needs --device cuda (the training scripts' "
                     "AMP runs on CUDA)" for row in args.rows if row.mode != "fp32"]
        if args.gpus is not None:
            problems.append(f"--gpus {','.join(map(str, args.gpus))} with --device cpu: drop one of them")
    elif check_device:
        if visible_gpus == 0:
            problems.append("--device cuda, but no CUDA device is visible here (use --device cpu for a CPU run)")
        else:
            problems += [f"--gpus: GPU {g} is not available ({visible_gpus} visible: 0-{visible_gpus - 1})"
                         for g in args.gpus or [] if g >= visible_gpus]
    return problems

# What the work dirs of one report must share: the same training and evaluation of every run.
SHARED_PLAN_KEYS = ("device", "schedule", "eval_iterations", "decay_iteration", "auto", "val_images",
                    "val_split_images")


def _read_plan(work_dir: Path) -> dict:
    plan = read_json(Path(work_dir) / PLAN_FILE)
    if plan is None:
        raise ToolError(f"--report-only {str(work_dir)!r}: no {PLAN_FILE} there (is it an ap_parity --work-dir?)")
    return plan


def merged_plan(work_dirs: Sequence[Path]) -> Tuple[dict, List[Path]]:
    """The plans of ``work_dirs`` as one (rows and configs in the order first met, seeds and GPUs joined) and the
    work dir of each of its runs. A ToolError where a dir trained or evaluated otherwise than the first, or holds a
    run that another holds too."""
    first = Path(work_dirs[0])
    plan = copy.deepcopy(_read_plan(first))
    run_dirs = [first] * len(plan["runs"])
    where = {run["name"]: first for run in plan["runs"]}
    for work_dir in map(Path, work_dirs[1:]):
        other = _read_plan(work_dir)
        for key in SHARED_PLAN_KEYS:
            if other.get(key) != plan.get(key):
                raise ToolError(f"--report-only: {str(work_dir)!r} has another {key} than {str(first)!r} "
                                f"({other.get(key)!r} against {plan.get(key)!r}): its runs cannot share a report")
        for config in other["configs"]:
            known = next((c for c in plan["configs"] if c["name"] == config["name"]), None)
            if known is None:
                plan["configs"].append(config)
            elif (known.get("eval_iterations"), known.get("schedule")) != (config.get("eval_iterations"),
                                                                            config.get("schedule")):
                raise ToolError(f"--report-only: {config['name']} trained another schedule in {str(work_dir)!r} "
                                f"than in {str(first)!r}: its runs cannot share a report")
        plan["rows"] += [row for row in other["rows"] if row not in plan["rows"]]
        plan["seeds"] = sorted(set(plan["seeds"]) | set(other["seeds"]))
        plan["gpus"] = sorted(set(plan.get("gpus") or []) | set(other.get("gpus") or [])) or plan.get("gpus")
        for run in other["runs"]:
            if run["name"] in where:
                raise ToolError(f"--report-only: run {run['name']} is in {str(where[run['name']])!r} and in "
                                f"{str(work_dir)!r}; pass one of them")
            where[run["name"]] = work_dir
            plan["runs"].append(run)
            run_dirs.append(work_dir)
    return plan, run_dirs


def report_only(work_dirs: Sequence[Path], out_dir: Optional[Path]) -> int:
    plan, run_dirs = merged_plan(work_dirs)
    records = []
    for entry, work_dir in zip(plan["runs"], run_dirs):
        record = read_json(work_dir / "runs" / entry["name"] / "run.json")
        records.append(record if record is not None else dict(entry, status="no record", iterations=0,
                                                              planned_iterations=plan["schedule"]["iters"]))
    report(plan, records, Path(out_dir) if out_dir else Path(work_dirs[0]) / "report")
    return 0

def dry_run(study: Study) -> int:
    print(f"{len(study.runs)} runs: {len(study.configs)} configs x {len(study.args.rows)} rows x "
          f"{len(study.args.seeds)} seeds, {study.per_gpu} at a time per "
          f"{'GPU of ' + ','.join(map(str, study.gpus)) if study.gpus else 'CPU'}; baseline row "
          f"{study.args.rows[0].label}; " + (
              f"iterations decided during the run (at most {study.schedule.iters})" if study.schedule.auto else
              f"evaluations after iterations {study.schedule.eval_iterations()}")
          + f"; {'paced' if study.pacing else 'not paced'}; time limit per run: {study.args.time_limit or 'none'}; "
          f"deadline: {study.args.deadline or 'none'}")
    with tempfile.TemporaryDirectory() as scratch:
        data = prepare_data(study.args.data_cache, study.args.val_images, Path(scratch), generate=False)
        study.work_dir = Path(scratch)
        shown = set()
        for run in study.runs:
            files = study.write_run_config(run, data, init_dir(study.work_dir, run.config) / f"seed{run.seed}.pth")
            print(f"  {run.name}: {'CPU' if run.gpu is None else f'GPU {run.gpu}'}: "
                  + " ".join(study.command(run, files)[1:]).replace(scratch, "WORK_DIR"))
            if (run.config.name, run.row) in shown:
                continue
            shown.add((run.config.name, run.row))
            print(f"    derived from {run.config.base_for(run.row).relative_to(REPO_ROOT)}:")
            for key, value in key_fields(read_base_config(files.overlay)).items():
                print(f"      {key}: {str(value).replace(scratch, 'WORK_DIR')}")
    return 0

def visible_gpu_count() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0

def main(argv: Optional[Sequence[str]] = None, started: Optional[float] = None) -> int:
    """The command line; ``started`` (``time.time()``) is when the tool started, from which ``--deadline``
    counts (default: now)."""
    # mmengine's reading of mmdet:: bases warns on every config about setuptools' pkg_resources.
    warnings.filterwarnings("ignore", message="pkg_resources is deprecated")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.report_only is not None:
            return report_only(args.report_only, args.out_dir)
        visible = visible_gpu_count() if args.device == "cuda" else 0
        problems = argument_problems(args, visible, check_device=not args.dry_run)
        if problems:
            usage_error("; ".join(problems))
        study = Study(args, schedule_from(args), visible, started)
        if study.schedule.auto and not study.pacing:
            usage_error(f"--iters auto needs every run at once: --per-gpu {study.per_gpu} leaves runs waiting for "
                        "a slot (drop --per-gpu, or give --iters N)")
        problems = [problem for config in study.configs for path in (config.stock, config.fast)
                    for problem in scale_problems(config.name, study.base_config(path), study.schedule)]
        if problems:
            usage_error("; ".join(dict.fromkeys(problems)))
        return dry_run(study) if args.dry_run else run_study(study)
    except ToolError as error:
        usage_error(str(error))
