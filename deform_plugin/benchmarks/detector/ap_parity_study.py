"""The AP parity study's runs (:mod:`.ap_parity` is its command line): the plan, the processes, pacing, the
schedule decided during the run, and each run's record.

:class:`Study` holds one invocation: it writes every run's config (:mod:`.ap_parity_config`), starts the stock
processes that build the initial weights (:mod:`.initial_weights`) and the Triton warm-up (:class:`TritonWarmup`)
beside the runs, starts the runs ``per_gpu`` at a time per device, keeps the pace file of each config (the runs'
:class:`.parity_hook.ParityRunHook` waits on it), decides each config's schedule with ``--iters auto``
(:func:`decide_schedule`), prints progress, ends what the deadline reaches, and collects each run's record
(:func:`collect_run`). :func:`run_study` is the whole sequence, report included.
"""
from __future__ import annotations

import json
import math
import signal
import subprocess
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from .ap_parity_config import (
    PARITY_CONFIGS,
    ParityConfig,
    RunFiles,
    Schedule,
    ShapesData,
    overlay_settings,
    prepare_data,
    shapes_module,
    write_overlay,
)
from .ap_parity_processes import (
    Interrupted,
    TritonWarmup,
    init_dir,
    kill,
    launch,
    raise_interrupted,
    start_initial_weights,
    thread_env,
)
from .loss_curves import read_losses
from .parity_hook import read_json, write_json_atomically
from .train_overlay import Row, read_base_config
from .user_path import log_tail, row_command, row_environment

PLAN_FILE = "plan.json"
# Seconds kept, before --deadline, for the evaluation after training stops, and for the report.
EVAL_RESERVE_S = 60.0
REPORT_RESERVE_S = 25.0
# A run with --time-limit is killed this long after its limit (start-up, evaluation and checkpoint included).
HARD_MARGIN_S = 300.0
# Pacing: a run may be this many iterations ahead of the slowest running run of its config.
PACE_SLACK = 10
# --iters auto: the speed is measured over at least this many seconds once every run of a config is past its
# warm-up; the schedule then takes this share of what the slowest run would reach by the end of training, less the
# halfway evaluation's time.
CALIBRATE_S = 30.0
AUTO_SAFETY = 0.9
MID_EVAL_S = 20.0
# Log lines of mmengine's load_from that say the initial weights did not load exactly.
MISMATCH_MARKERS = ("do not match exactly", "missing keys in source state_dict", "unexpected key in source")

# ---------------------------------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PlannedRun:
    config: ParityConfig
    row: Row
    seed: int
    gpu: Optional[int]  # None on the CPU

    @property
    def name(self) -> str:
        return f"{self.config.name}__{self.row.label.replace(':', '-')}__seed{self.seed}"

def plan_runs(configs: Sequence[ParityConfig], rows: Sequence[Row], seeds: Sequence[int],
              gpus: Optional[Sequence[int]]) -> List[PlannedRun]:
    """Every (config, row, seed), slowest rows first (stock, then the rows without buckets); on GPUs, dealt
    round-robin in that order so that each GPU gets as even a mix of rows as the counts allow."""
    def cost(row: Row) -> int:
        return 0 if row.stock else (1 if not row.buckets else 2)

    ordered = sorted(((c, r, s) for r in rows for c in configs for s in seeds), key=lambda item: cost(item[1]))
    return [PlannedRun(c, r, s, None if not gpus else gpus[index % len(gpus)])
            for index, (c, r, s) in enumerate(ordered)]

# ---------------------------------------------------------------------------------------------------------------------
# Initial weights, Triton cache
# ---------------------------------------------------------------------------------------------------------------------

@dataclass
class Child:
    run: PlannedRun
    process: subprocess.Popen
    started: float
    kill_at: Optional[float]

# ---------------------------------------------------------------------------------------------------------------------
# A run's record
# ---------------------------------------------------------------------------------------------------------------------

def run_files(work_dir: Path, run: PlannedRun) -> RunFiles:
    return RunFiles(Path(work_dir) / "runs" / run.name)

def failure(fate: Optional[str], returncode: Optional[int], log: Path) -> str:
    """What ended a run that is not ok, with its log's last lines."""
    if fate == "not started":
        return "never started"
    return f"{fate or f'exit status {returncode}'}\n{log_tail(log)}"

def collect_run(run: PlannedRun, files: RunFiles, schedule: Schedule, returncode: Optional[int],
                wall_s: Optional[float], fate: Optional[str] = None, error: Optional[str] = None) -> dict:
    """One run's record from its files (``fate``: 'killed', 'not started' or 'failed' where the tool ended it, with
    ``error`` saying why where given); written to the run's ``run.json`` and returned."""
    parity = read_json(files.result) or {}
    progress = read_json(files.status) or {}  # where a run that ended without its result got to
    timing = read_json(files.timing)
    try:
        loss_curve = [[i, v] for i, v in read_losses(str(files.work_dir))]
    except (OSError, ValueError):
        loss_curve = []
    log = files.log.read_text(errors="replace") if files.log.is_file() else ""
    evaluations = parity.get("evaluations") or []
    iterations = parity.get("iterations") or progress.get("iteration") or 0
    status = fate or ("ok" if returncode == 0 and evaluations and evaluations[-1]["iteration"] == iterations
                      else "failed")
    train_seconds = parity["train_seconds"] if "train_seconds" in parity else progress.get("seconds")
    graphed = (timing or {}).get("graphed_training") or {}
    tail = [v for _, v in loss_curve[-3:]]
    record = dict(
        name=run.name, config=run.config.name, row=run.row.label, seed=run.seed, gpu=run.gpu, status=status,
        returncode=returncode, wall_s=wall_s, log=str(files.log),
        planned_iterations=parity.get("planned_iterations") or progress.get("planned_iterations") or schedule.iters,
        iterations=iterations, stopped_early=parity.get("stopped_early", progress.get("stopped_early")),
        train_seconds=train_seconds,
        it_per_s=iterations / train_seconds if iterations and train_seconds else None, evaluations=evaluations,
        loss_curve=loss_curve, final_loss=sum(tail) / len(tail) if tail else None,
        nonfinite_losses=sum(1 for _, v in loss_curve if not math.isfinite(v)),
        init_loaded="Load checkpoint from" in log,
        init_mismatch=any(marker in log for marker in MISMATCH_MARKERS),
        peak_allocated_mib=(timing or {}).get("peak_allocated_mib"),
        peak_reserved_mib=(timing or {}).get("peak_reserved_mib"),
        padded_over_image_pixels=(timing or {}).get("padded_over_image_pixels"),
        batch_shapes=(timing or {}).get("batch_shapes"), graph_captures=graphed.get("captures"),
        timing={k: v for k, v in (timing or {}).items() if k != "per_iteration"} or None,
        error=None if status == "ok" else error or failure(fate, returncode, files.log))
    files.run.parent.mkdir(parents=True, exist_ok=True)
    files.run.write_text(json.dumps(record, indent=1))
    return record

# ---------------------------------------------------------------------------------------------------------------------
# Pacing and the schedule decided during the run
# ---------------------------------------------------------------------------------------------------------------------

def decide_schedule(slowest: int, fastest: int, rate: float, seconds_left: float, schedule: Schedule) -> dict:
    """A config's iterations (a multiple of 10), learning rate step and validation interval, decided while its
    runs train: ``AUTO_SAFETY`` of what the slowest run reaches at ``rate`` iterations per second in
    ``seconds_left`` (less the halfway evaluation's time). At least twice the fastest run's iteration (so that every
    run still meets the halfway evaluation and the step ahead) and past the warm-up; at most ``schedule.iters``."""
    projected = slowest + rate * max(seconds_left - MID_EVAL_S, 0.0)
    iters = int(projected * AUTO_SAFETY) // 10 * 10
    floor = max(2 * fastest + 10, schedule.warmup_iters + 20)
    iters = min(max(iters, floor), schedule.iters)
    val_interval = iters if schedule.val_every == 0 else iters // 2
    return dict(iters=iters, milestone=max(1, int(round(0.8 * iters))), val_interval=val_interval,
                projected=round(projected, 1), rate=round(rate, 4), floor=floor)

# ---------------------------------------------------------------------------------------------------------------------
# Running everything
# ---------------------------------------------------------------------------------------------------------------------

class Study:
    """One invocation: the plan, its files, and the clock."""

    def __init__(self, args, schedule: Schedule, visible_gpus: int, started: Optional[float] = None):
        self.args = args
        self.started = time.time() if started is None else started
        self.schedule = schedule
        self.configs = [PARITY_CONFIGS[name] for name in args.configs]
        self.gpus = None if args.device == "cpu" else (args.gpus or list(range(max(visible_gpus, 1))))
        self.runs = plan_runs(self.configs, args.rows, args.seeds, self.gpus)
        per_device = math.ceil(len(self.runs) / (len(self.gpus) if self.gpus else 1))
        self.per_gpu = args.per_gpu or per_device
        self.work_dir = Path(args.work_dir).resolve()
        self.out_dir = Path(args.out_dir).resolve() if args.out_dir else self.work_dir / "report"
        deadline = args.deadline
        self.stop_at = None if deadline is None else self.started + deadline - EVAL_RESERVE_S - REPORT_RESERVE_S
        self.kill_at = None if deadline is None else self.started + deadline - REPORT_RESERVE_S
        self._base_configs: Dict[Path, object] = {}
        # Pacing needs every run of a config running: a run left in the queue would hold the others back forever.
        busiest = max(sum(1 for r in self.runs if r.gpu == gpu) for gpu in {r.gpu for r in self.runs})
        self.pacing = not args.no_pace and busiest <= self.per_gpu
        self.plan: Optional[dict] = None
        self._limits: Dict[str, int] = {}
        self._samples: Dict[str, List[tuple]] = {c.name: [] for c in self.configs}
        self.decided: Dict[str, dict] = {}

    def pace_file(self, config: ParityConfig) -> Optional[Path]:
        return self.work_dir / "pace" / f"{config.name}.json" if self.pacing else None

    def schedule_file(self, config: ParityConfig) -> Optional[Path]:
        return self.work_dir / "pace" / f"{config.name}_schedule.json" if self.schedule.auto else None

    def elapsed(self) -> str:
        return f"[{time.time() - self.started:5.0f} s]"

    def say(self, message: str) -> None:
        print(f"{self.elapsed()} {message}", flush=True)

    def plan_record(self, data: ShapesData, split_images: int) -> dict:
        return dict(
            configs=[dict(name=c.name, title=c.title, stock=str(c.stock), fast=str(c.fast)) for c in self.configs],
            rows=[r.label for r in self.args.rows], seeds=list(self.args.seeds), device=self.args.device,
            gpus=self.gpus, per_gpu=self.per_gpu, schedule=asdict(self.schedule),
            eval_iterations=self.schedule.eval_iterations(), decay_iteration=self.schedule.decay_iteration,
            auto=self.schedule.auto, pacing=self.pacing, pace_slack=PACE_SLACK,
            time_limit_s=self.args.time_limit, deadline_s=self.args.deadline, val_images=data.val_images,
            val_split_images=split_images, data_root=str(data.root), val_ann_file=str(data.val_ann_file),
            work_dir=str(self.work_dir), started=self.started,
            runs=[dict(name=r.name, config=r.config.name, row=r.row.label, seed=r.seed, gpu=r.gpu) for r in self.runs])

    def base_config(self, path: Path):
        """A shipped config as mmengine merges it (read once per path: mmdet's bases take a while)."""
        if path not in self._base_configs:
            self._base_configs[path] = read_base_config(path)
        return self._base_configs[path]

    def write_run_config(self, run: PlannedRun, data: ShapesData, init_weights: Optional[Path]) -> RunFiles:
        files = run_files(self.work_dir, run)
        base = run.config.base_for(run.row)
        overlay = overlay_settings(self.base_config(base), run.row, run.seed, self.schedule, data, files,
                                   init_weights, self.args.time_limit, self.stop_at, self.pace_file(run.config),
                                   self.schedule_file(run.config))
        write_overlay(files.overlay, base, overlay, f"{run.config.name} {run.row.label} seed {run.seed}",
                      stock=run.row.stock)
        return files

    def command(self, run: PlannedRun, files: RunFiles) -> List[str]:
        return row_command(run.row, files.overlay, files.work_dir)

    def run_env(self, run: PlannedRun) -> Dict[str, str]:
        env = dict(CUDA_VISIBLE_DEVICES="" if run.gpu is None else str(run.gpu), **thread_env(self.args.threads))
        env.update(row_environment(run.row, self.work_dir / "triton_cache" / run.name) or {})
        return env

    # -- the runs ------------------------------------------------------------------------------------------------

    def train_all(self, files: Dict[str, RunFiles], initial: Dict[str, subprocess.Popen]) -> List[dict]:
        """Run every planned run, ``per_gpu`` at a time per device, while ``initial`` (config name -> the process
        building its initial weights, which the runs wait for) finishes; returns the runs' records in plan order."""
        pending = deque(self.runs)
        running: List[Child] = []
        records: Dict[str, dict] = {}
        building = dict(initial)
        last_progress = time.time()
        try:
            while pending or running:
                now = time.time()
                for name, process in list(building.items()):
                    if process.poll() is None:
                        continue
                    del building[name]
                    if process.returncode == 0:
                        self.say(f"{name}: initial weights built for seeds {', '.join(map(str, self.args.seeds))}")
                        continue
                    log = init_dir(self.work_dir, PARITY_CONFIGS[name]) / "init.log"
                    self.say(f"{name}: building the initial weights failed (log: {log}); its runs are stopped")
                    error = f"the initial weights were not built (log: {log}):\n{log_tail(log, 15)}"
                    self._end([c for c in running if c.run.config.name == name],
                              [r for r in pending if r.config.name == name], files, records, "failed", error)
                    running = [c for c in running if c.run.config.name != name]
                    pending = deque(r for r in pending if r.config.name != name)
                for child in list(running):
                    returncode, fate = child.process.poll(), None
                    if returncode is None and child.kill_at is not None and now >= child.kill_at:
                        kill(child.process)
                        fate = "killed"
                    elif returncode is None:
                        continue
                    running.remove(child)
                    record = collect_run(child.run, files[child.run.name], self.schedule, returncode,
                                         now - child.started, fate)
                    records[child.run.name] = record
                    self.say(done_line(record))
                if self.kill_at is not None and now >= self.kill_at and (running or pending):
                    self.say(f"deadline: killing {len(running)} runs; {len(pending)} never started")
                    self._end(running, pending, files, records, "killed")
                    break
                if self.stop_at is not None and now >= self.stop_at and pending:
                    self.say(f"{len(pending)} runs not started: too late to train before the deadline")
                    self._end([], pending, files, records, "not started")
                    pending.clear()
                self._start(pending, running, files, now)
                if self.pacing:
                    self._pace(running, files, now)
                if now - last_progress >= self.args.progress_every and running:
                    last_progress = now
                    for line in progress_lines(self.runs, files, records):
                        self.say(line)
                time.sleep(0.5)
        except (Interrupted, KeyboardInterrupt):
            self.say("interrupted: stopping the runs and writing the report of what finished")
            self._end(running, pending, files, records, "killed")
        return [records[run.name] for run in self.runs if run.name in records]

    def _pace(self, running: List[Child], files: Dict[str, RunFiles], now: float) -> None:
        """Per config: let its runs go at most PACE_SLACK iterations past its slowest running run; with
        ``--iters auto``, decide its schedule once the slowest run's paced speed is known."""
        for config in self.configs:
            iterations = []
            for child in running:
                if child.run.config is config:
                    status = read_json(files[child.run.name].status) or {}
                    iterations.append(int(status.get("iteration") or 0))
            if not iterations:
                continue
            slowest, fastest = min(iterations), max(iterations)
            limit = slowest + PACE_SLACK
            if self._limits.get(config.name) != limit:
                write_json_atomically(self.pace_file(config), dict(limit=limit, time=now))
                self._limits[config.name] = limit
            samples = self._samples[config.name]
            samples.append((now, slowest))
            if self.schedule.auto and config.name not in self.decided:
                self._maybe_decide(config, slowest, fastest, samples, now)

    def _maybe_decide(self, config: ParityConfig, slowest: int, fastest: int, samples: List[tuple],
                      now: float) -> None:
        """Decide the config's schedule once its slowest run has been past its warm-up for CALIBRATE_S."""
        past_warmup = [(t, it) for t, it in samples if it >= self.schedule.warmup_iters + 5]
        if not past_warmup or now - past_warmup[0][0] < CALIBRATE_S or slowest <= past_warmup[0][1]:
            return
        started, at = past_warmup[0]
        rate = (slowest - at) / (now - started)
        decided = decide_schedule(slowest, fastest, rate, self.stop_at - now, self.schedule)
        write_json_atomically(self.schedule_file(config), decided)
        self.decided[config.name] = decided
        for entry in self.plan["configs"]:
            if entry["name"] == config.name:
                entry.update(schedule=decided, eval_iterations=sorted({decided["val_interval"], decided["iters"]}))
        (self.work_dir / PLAN_FILE).write_text(json.dumps(self.plan, indent=1))
        self.say(f"{config.name}: schedule: {decided['iters']} iterations (learning rate /10 at "
                 f"{decided['milestone']}, evaluations at {decided['val_interval']} and {decided['iters']}), from "
                 f"{rate:.2f} it/s of its slowest run over {now - started:.0f} s, at iteration {slowest}")

    def _start(self, pending, running: List[Child], files: Dict[str, RunFiles], now: float) -> None:
        """Start the pending runs that have a free slot on their device."""
        started: Dict[Optional[int], int] = {}
        for run in list(pending):
            if sum(1 for c in running if c.run.gpu == run.gpu) >= self.per_gpu:
                continue
            pending.remove(run)
            process = launch(self.command(run, files[run.name]), files[run.name].log, self.run_env(run))
            kill_at = None if self.args.time_limit is None else now + self.args.time_limit + HARD_MARGIN_S
            if self.kill_at is not None:
                kill_at = self.kill_at if kill_at is None else min(kill_at, self.kill_at)
            running.append(Child(run, process, now, kill_at))
            started[run.gpu] = started.get(run.gpu, 0) + 1
        if started:
            where = ", ".join(f"{'CPU' if gpu is None else f'GPU {gpu}'}: {count}" for gpu, count in started.items())
            self.say(f"started {sum(started.values())} runs ({where}); {len(pending)} waiting; logs in "
                     f"{self.work_dir / 'runs'}")

    def _end(self, running: List[Child], pending, files, records, fate: str, error: Optional[str] = None) -> None:
        """Kill ``running`` and record them and ``pending`` with ``fate`` (and ``error``, where given)."""
        for child in running:
            kill(child.process)
            records[child.run.name] = collect_run(child.run, files[child.run.name], self.schedule, None,
                                                  time.time() - child.started, fate, error)
        for run in pending:
            records[run.name] = collect_run(run, files[run.name], self.schedule, None, None,
                                            "not started" if fate == "killed" else fate, error)
        running.clear()
        pending.clear()

def done_line(record: dict) -> str:
    final = [e for e in record["evaluations"] if e["iteration"] == record["iterations"]]
    value = final[-1]["metrics"].get("coco/bbox_mAP") if final else None
    speed = f", {record['it_per_s']:.2f} it/s" if record.get("it_per_s") else ""
    early = f", STOPPED EARLY ({record['stopped_early']})" if record.get("stopped_early") else ""
    got = f", bbox mAP {value:.3f}" if value is not None else ""
    return (f"{record['status']}: {record['config']} {record['row']} seed {record['seed']}: "
            f"{record['iterations']}/{record['planned_iterations']} it in {record['train_seconds'] or 0:.0f} s"
            f"{speed}{early}{got}")

def progress_lines(runs: Sequence[PlannedRun], files: Dict[str, RunFiles], records: Dict[str, dict]) -> List[str]:
    """One line per config: per row, each seed's iteration (or 'done') and the row's mean it/s."""
    lines = []
    for config in dict.fromkeys(run.config.name for run in runs):
        parts = []
        for row in dict.fromkeys(run.row.label for run in runs):
            cells, rates, left = [], [], []
            for run in (r for r in runs if r.config.name == config and r.row.label == row):
                if run.name in records:
                    status = records[run.name]["status"]
                    cells.append("done" if status == "ok" else status.upper())
                    continue
                status = read_json(files[run.name].status)
                if not status:
                    cells.append("-")
                    continue
                cells.append(str(status["iteration"]))
                if status["iteration"] and status["seconds"]:
                    rates.append(status["iteration"] / status["seconds"])
                    left.append((status["max_iterations"] - status["iteration"]) / rates[-1])
            rate = f" {sum(rates) / len(rates):.2f} it/s, eta {max(left):.0f} s" if rates else ""
            parts.append(f"{row} {'/'.join(cells)}{rate}")
        lines.append(f"{config}: " + " | ".join(parts))
    return lines

def run_study(study: Study) -> int:
    args = study.args
    study.work_dir.mkdir(parents=True, exist_ok=True)
    data = prepare_data(args.data_cache, args.val_images, study.work_dir)
    split_images = shapes_module()["SPLIT_SIZES"]["val"]
    plan = study.plan = study.plan_record(data, split_images)
    (study.work_dir / PLAN_FILE).write_text(json.dumps(plan, indent=1))
    for config in study.configs if study.pacing else ():
        write_json_atomically(study.pace_file(config), dict(limit=PACE_SLACK, time=time.time()))
    stops = ("" if study.stop_at is None else
             f"; training stops by {study.stop_at - study.started:.0f} s, the report by {args.deadline:.0f} s")
    study.say(f"{len(study.runs)} runs ({', '.join(plan['rows'])}; seeds {plan['seeds']}; {args.iters} iterations "
              f"of batch {args.batch_size}){stops}; shapes set at {data.root}; work dir {study.work_dir}")
    previous = signal.signal(signal.SIGTERM, raise_interrupted)
    initial: Dict[str, subprocess.Popen] = {}
    warmup: Optional[TritonWarmup] = None
    try:
        initial = {config.name: start_initial_weights(config, study.base_config(config.stock), args.seeds,
                                                      study.schedule, data, study.work_dir, args.threads)
                   for config in study.configs}
        ours = [run for run in study.runs if not run.row.stock]
        if ours and args.device == "cuda" and not args.no_warmup:
            warmup = TritonWarmup(list(dict.fromkeys(run.config for run in ours)), study.gpus[0],
                                  any(run.row.mode == "bf16" for run in ours), study.work_dir, args.threads)
        files = {run.name: study.write_run_config(run, data, init_dir(study.work_dir, run.config)
                                                  / f"seed{run.seed}.pth") for run in study.runs}
        records = study.train_all(files, initial)
    except Interrupted:
        study.say("interrupted before the runs started")
        records = []
    finally:
        signal.signal(signal.SIGTERM, previous)
        for process in initial.values():
            kill(process)
        if warmup is not None:
            warmup.stop()
    report(plan, records, study.out_dir)
    return 0 if records and all(r["status"] == "ok" and not r["stopped_early"] for r in records) else 1

def report(plan: dict, records: List[dict], out_dir: Path) -> str:
    from .ap_parity_report import summarize, write_reports
    text, paths = write_reports(summarize(plan, records), out_dir)
    print(text, flush=True)
    print("wrote " + ", ".join(str(p) for p in paths), flush=True)
    return text
