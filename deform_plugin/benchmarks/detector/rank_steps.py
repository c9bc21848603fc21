"""Multi-GPU rows of the training benchmark: where each rank's step goes, and scaling against one GPU.

Each rank's ``FlatGradientsDataParallel`` times its steps (:class:`deform_plugin.engine.step_times.StepTimes`, CUDA
events on the compute stream): ``compute`` from the step's start to its gradients ready for reduction, ``all-reduce``
from then until the compute stream sees the reduction done, and the whole ``step`` (optimizer included; the
iteration's data loading and hooks are not). The timing hook turns the timing on before the first iteration and
gathers the ranks' figures to rank 0 (``data_parallel_steps`` in a row's timing JSON); the wrapper's step n is the
run's iteration n (one train step per iteration).

An all-reduce completes on every rank only once the last rank has joined it and the data has moved: on the rank
that arrived last, the all-reduce is (nearly) the transfer alone; on every other rank it is the transfer plus the
time that rank waited for the last one. So the smallest all-reduce of a step estimates its **communication**, and
each rank's excess over it is its **wait** for slower ranks (the ranks' imbalance: different images, matching and
losses of different sizes). An estimate: the ranks' completions are not exactly simultaneous, and the last rank's
all-reduce also holds its own launch.

Scaling compares a row on N GPUs with the same row of the same config on one GPU in the same run (``--gpus 1 N``):
by steady img/s, and per step, N times one GPU's median steady step over N GPUs' (replayed iterations where the
row replays graphs, since captures of new shapes fall unevenly into the windows of one and several GPUs).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple


def communication_and_waits(all_reduce_ms: Sequence[float]) -> Tuple[float, List[float]]:
    """One step's all-reduce milliseconds, one per rank: (the communication estimate, the smallest of them; each
    rank's wait for slower ranks, its excess over that)."""
    if not all_reduce_ms:
        raise ValueError("a step's all-reduce times need at least one rank's, got none")
    communication = min(all_reduce_ms)
    return communication, [ms - communication for ms in all_reduce_ms]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def rank_step_figures(data_parallel_steps: Optional[dict], window: Sequence[int]) -> Optional[dict]:
    """Means per step over the steps of ``window`` (first and last iteration, inclusive) that every rank timed with
    a reduction: ``steps`` (how many), ``communication_ms``, ``clock``, and per rank (``ranks``, in rank order)
    ``compute_ms``, ``all_reduce_ms``, ``wait_ms`` and ``step_ms``. None without figures or such steps."""
    if not data_parallel_steps or not data_parallel_steps.get("ranks"):
        return None
    first, last = window
    by_rank: List[Dict[int, dict]] = [
        {r["step"]: r for r in records if first <= r["step"] <= last and r.get("all_reduce_ms") is not None}
        for records in data_parallel_steps["ranks"]]
    steps = sorted(set.intersection(*(set(records) for records in by_rank)))
    if not steps:
        return None
    communication, waits = [], [[] for _ in by_rank]
    for step in steps:
        step_communication, step_waits = communication_and_waits([records[step]["all_reduce_ms"]
                                                                  for records in by_rank])
        communication.append(step_communication)
        for rank_waits, wait in zip(waits, step_waits):
            rank_waits.append(wait)
    ranks = [dict(rank=rank,
                  compute_ms=_mean([records[s]["compute_ms"] for s in steps]),
                  all_reduce_ms=_mean([records[s]["all_reduce_ms"] for s in steps]),
                  wait_ms=_mean(rank_waits),
                  step_ms=_mean([records[s]["step_ms"] for s in steps]))
             for rank, (records, rank_waits) in enumerate(zip(by_rank, waits))]
    return dict(steps=len(steps), communication_ms=_mean(communication), clock=data_parallel_steps.get("clock"),
                ranks=ranks)


def median_step_ms(per_iteration: Sequence[dict], window: Sequence[int]) -> Optional[float]:
    """The median milliseconds of the window's steady steps (host clock at each iteration's end): its replayed
    iterations where graphed training replayed any, else all of its iterations of no graphed kind (stock and eager
    training). None where there are none."""
    first, last = window
    entries = [e for e in per_iteration if first <= e["iteration"] <= last and e.get("seconds") is not None]
    replayed = any(e.get("kind") == "replay" for e in entries)
    seconds = sorted(e["seconds"] for e in entries
                     if (e.get("kind") == "replay" if replayed else e.get("kind") in (None, "other")))
    if not seconds:
        return None
    middle = len(seconds) // 2
    return 1000 * (seconds[middle] if len(seconds) % 2 else (seconds[middle - 1] + seconds[middle]) / 2)


def add_scaling(rows: Sequence[dict]) -> None:
    """Give each row on more than one GPU its one-GPU counterpart's figures and the scaling against them (None where
    the run has no one-GPU row of that config and row, or a figure is missing): ``one_gpu_img_s`` and
    ``scaling_img_s`` (steady img/s over one GPU's), ``one_gpu_step_ms`` and ``scaling_per_step`` (GPUs times one
    GPU's median steady step over this row's)."""
    one_gpu = {(m["config"], m["row"]): m for m in rows if m.get("gpus", 1) == 1}
    for metrics in rows:
        gpus = metrics.get("gpus", 1)
        if gpus == 1:
            continue
        single = one_gpu.get((metrics["config"], metrics["row"]), {})
        metrics.update(one_gpu_img_s=single.get("steady_img_s"), one_gpu_step_ms=single.get("median_step_ms"),
                       scaling_img_s=None, scaling_per_step=None)
        if metrics["one_gpu_img_s"] and metrics.get("steady_img_s"):
            metrics["scaling_img_s"] = metrics["steady_img_s"] / metrics["one_gpu_img_s"]
        if metrics["one_gpu_step_ms"] and metrics.get("median_step_ms"):
            metrics["scaling_per_step"] = gpus * metrics["one_gpu_step_ms"] / metrics["median_step_ms"]


def _fmt(value, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


CLOCKS = {"cuda events": "CUDA events on each rank's compute stream", "host": "the host clock"}


def multi_gpu_tables(rows: Sequence[dict], steady: Sequence[int]) -> List[str]:
    """Markdown lines: scaling against one GPU, then each rank's step, for the rows on more than one GPU (none
    where there are none)."""
    multi = [m for m in rows if m.get("gpus", 1) > 1]
    if not multi:
        return []
    lines = ["", f"Scaling against the same row on one GPU (steady window, iterations {steady[0]}-{steady[1]}; per "
                 "step: GPUs x one GPU's median steady step / this row's, of replayed iterations where graphs "
                 "replay):", "",
             "| config | row | GPUs | steady img/s | one GPU's | scaling by img/s | median step | one GPU's "
             "| scaling per step |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|"]
    for m in multi:
        cells = [_fmt(m.get("steady_img_s"), ".2f"), _fmt(m.get("one_gpu_img_s"), ".2f"),
                 _fmt(m.get("scaling_img_s"), ".2f", "x"), _fmt(m.get("median_step_ms"), ".1f", " ms"),
                 _fmt(m.get("one_gpu_step_ms"), ".1f", " ms"), _fmt(m.get("scaling_per_step"), ".2f", "x")]
        lines.append(f"| {m['config']} | {m['row']} | {m['gpus']} | " + " | ".join(cells) + " |")
    timed = [m for m in multi if m.get("rank_steps")]
    if not timed:
        lines += ["", "No per-rank step times: FlatGradientsDataParallel (model_wrapper_cfg) keeps them, and these "
                      "rows train under another model wrapper."]
        return lines
    clocks = sorted({CLOCKS.get(m["rank_steps"].get("clock"), "an unknown clock") for m in timed})
    lines += ["", f"Each rank's step over iterations {steady[0]}-{steady[1]} ({' and '.join(clocks)}; ms, mean per "
                  "step): compute = the train step's start to its gradients ready for reduction; all-reduce = from "
                  "then until the compute stream sees it done; wait = a rank's all-reduce minus the step's smallest "
                  "(the rank waiting for slower ones); communication = the step's smallest all-reduce (the last rank "
                  "to arrive waits for no one); step = the train step, optimizer included (not data loading or "
                  "hooks):", "",
              "| config | row | GPUs | rank | steps | compute | all-reduce | wait for slower ranks "
              "| communication (est.) | step |",
              "|---|---|--:|---|--:|--:|--:|--:|--:|--:|"]
    for m in timed:
        figures, ranks = m["rank_steps"], m["rank_steps"]["ranks"]
        prefix = f"| {m['config']} | {m['row']} | {m['gpus']} "
        for rank in ranks:
            lines.append(prefix + f"| {rank['rank']} | {figures['steps']} | {rank['compute_ms']:.2f} "
                         f"| {rank['all_reduce_ms']:.2f} | {rank['wait_ms']:.2f} | | {rank['step_ms']:.2f} |")
        means = [_mean([r[name] for r in ranks]) for name in ("compute_ms", "all_reduce_ms", "wait_ms")]
        lines.append(prefix + f"| mean | {figures['steps']} | " + " | ".join(f"{v:.2f}" for v in means)
                     + f" | {figures['communication_ms']:.2f} | {_mean([r['step_ms'] for r in ranks]):.2f} |")
    return lines
