"""The report of the user-path training benchmark: a machine line, one table row per (config, row), files.

Per row: steady-state img/s (and ms/iter), img/s over the whole run and over the first iterations, the ratio of
whole-run to steady img/s (how much warm-up costs), our Triton kernels' compiled variants (and how many appeared
after the warm-up window), the graph captures of graphed training (and signatures that run eagerly), peak device
memory (allocated, and reserved: the memory CUDA graphs' pools hold shows there), and the steady-state speedup
against the config's first row. A second table splits the whole run's time by what each iteration did: the
first iteration (worker start-up, first compiles), and for graphed training the iterations that warmed a new
shape up eagerly, those that captured one, and those that replayed. Rows on several GPUs add two more
(:mod:`.rank_steps`): scaling against the same row on one GPU, and each rank's compute, all-reduce, wait for slower
ranks and the communication estimate.
"""
from __future__ import annotations

import csv
import datetime
import json
import platform
from importlib import metadata
from pathlib import Path
from typing import Dict, Optional, Sequence

from ..common import repo_commit
from .coco_source import CocoSource
from .long_run import long_run_figures, long_run_lines, plot_long_runs
from .random_text_encoder import TIMING_ONLY_LABEL
from .rank_steps import add_scaling, median_step_ms, multi_gpu_tables, rank_step_figures

REPORT_NAME = "train_benchmark"
CSV_FIELDS = ("timestamp", "commit", "device", "config", "gpus", "row", "status", "steady_img_s", "steady_ms_per_iter",
              "all_img_s", "first_img_s", "all_over_steady", "first_100_img_s", "first_100_over_steady",
              "compiled_total", "compiled_after_warmup",
              "batch_shapes", "batch_shapes_after_warmup", "padded_over_image_pixels", "peak_allocated_mib",
              "peak_reserved_mib", "graph_captures",
              "graph_first_call_captures", "graph_fallbacks", "speedup", "median_step_ms", "scaling_img_s",
              "scaling_per_step", "rank_compute_ms", "rank_all_reduce_ms", "rank_wait_ms", "communication_ms",
              "amp_dtype", "iters", "batch_size", "workers")


def package_version(*names: str) -> str:
    """``name version`` of the first of ``names`` installed (mmcv or mmcv-lite), or ``name ?``."""
    for name in names:
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            continue
    return f"{names[0]} ?"


def machine_info(results: Sequence[dict]) -> Dict[str, Optional[str]]:
    """The machine as the rows saw it (device and CUDA from the first row that ran) plus package versions."""
    timings = [r["timing"] for r in results if r.get("timing")]
    stock = [r["timing"] for r in results if r.get("timing") and r["row"].startswith("stock")]
    return dict(
        device=timings[0]["device_name"] if timings else "unknown (no row ran)",
        cuda=timings[0]["cuda"] if timings else None,
        stock_mmcv_ops=stock[0]["mmcv_ext"] if stock else None,
        torch=package_version("torch"),
        triton=package_version("triton"),
        mmcv=package_version("mmcv", "mmcv-lite"),
        mmengine=package_version("mmengine"),
        mmdet=package_version("mmdet"),
        python=platform.python_version(),
        commit=repo_commit(),
    )


def machine_line(info: Dict[str, Optional[str]]) -> str:
    device = info["device"] + (f" (CUDA {info['cuda']})" if info.get("cuda") else "")
    mmcv = info["mmcv"] + (f", stock ops: {info['stock_mmcv_ops']}" if info.get("stock_mmcv_ops") else "")
    return " | ".join([device, info["torch"], info["triton"], mmcv, info["mmengine"], info["mmdet"],
                       f"python {info['python']}", f"commit {info['commit']}"])


def _window(timing: dict, window) -> Optional[dict]:
    for entry in timing["windows"]:
        if (entry["first"], entry["last"]) == tuple(window):
            return entry
    return None


def row_metrics(result: dict, windows: Dict[str, tuple]) -> dict:
    """The figures of one row (None where the row failed or a window was not reached)."""
    metrics = dict(config=Path(result["config"]).name, gpus=result.get("gpus", 1), row=result["row"],
                   status=result["status"],
                   steady_img_s=None, steady_ms_per_iter=None, all_img_s=None, first_img_s=None,
                   all_over_steady=None, first_100_img_s=None, first_100_over_steady=None, compiled_total=None,
                   compiled_after_warmup=None, batch_shapes=None,
                   batch_shapes_after_warmup=None, padded_over_image_pixels=None, peak_allocated_mib=None,
                   peak_reserved_mib=None, speedup=None, amp_dtype=None, graph_captures=None,
                   graph_capture_seconds=None, graph_capture_phase_seconds=None, graph_fallbacks=None,
                   graph_first_call_captures=None, median_step_ms=None, rank_steps=None, rank_compute_ms=None,
                   rank_all_reduce_ms=None, rank_wait_ms=None, communication_ms=None)
    timing = result.get("timing")
    if not timing:
        return metrics
    figures = {name: _window(timing, window) or {} for name, window in windows.items()}
    steady = figures["steady"].get("img_per_s")
    metrics.update(
        steady_img_s=steady,
        steady_ms_per_iter=figures["steady"].get("ms_per_iter"),
        all_img_s=figures["all"].get("img_per_s"),
        first_img_s=figures["first"].get("img_per_s"),
        first_100_img_s=figures.get("first_100", {}).get("img_per_s"),
        compiled_total=timing.get("compiled_total"),
        compiled_after_warmup=timing.get("compiled_after_warmup"),
        batch_shapes=timing.get("batch_shapes"),
        batch_shapes_after_warmup=timing.get("batch_shapes_after_warmup"),
        padded_over_image_pixels=timing.get("padded_over_image_pixels"),
        peak_allocated_mib=timing.get("peak_allocated_mib"),
        peak_reserved_mib=timing.get("peak_reserved_mib"),
        amp_dtype=timing.get("amp_dtype"),
    )
    graphed = timing.get("graphed_training")
    if graphed:
        metrics.update(graph_captures=graphed["captures"], graph_capture_seconds=graphed["capture_seconds"],
                       graph_capture_phase_seconds=graphed.get("capture_phase_seconds") or None,
                       graph_fallbacks=graphed.get("fallbacks"),
                       graph_first_call_captures=graphed.get("first_call_captures"))
    if steady and metrics["all_img_s"]:
        metrics["all_over_steady"] = metrics["all_img_s"] / steady
    if steady and metrics["first_100_img_s"]:
        metrics["first_100_over_steady"] = metrics["first_100_img_s"] / steady
    metrics["split"] = iteration_split(timing.get("per_iteration") or [], windows["all"])
    metrics["steady_replay_median_ms"] = replay_median_ms(timing.get("per_iteration") or [], windows["steady"])
    metrics["median_step_ms"] = median_step_ms(timing.get("per_iteration") or [], windows["steady"])
    metrics["long_run"] = long_run_figures(timing)
    rank_steps = rank_step_figures(timing.get("data_parallel_steps"), windows["steady"])
    if rank_steps:
        ranks = rank_steps["ranks"]
        metrics.update(rank_steps=rank_steps, communication_ms=rank_steps["communication_ms"],
                       **{f"rank_{name}": sum(r[name] for r in ranks) / len(ranks)
                          for name in ("compute_ms", "all_reduce_ms", "wait_ms")})
    return metrics


def replay_median_ms(per_iteration: Sequence[dict], window) -> Optional[float]:
    """The median milliseconds of a window's replayed iterations (graphed training), None where none replayed:
    what one more replayed step costs, without the captures that a window may still hold (comparisons of one and
    several GPUs, whose windows hold different numbers of captures, read this)."""
    first, last = window
    seconds = sorted(e["seconds"] for e in per_iteration
                     if first <= e["iteration"] <= last and e.get("kind") == "replay" and e.get("seconds") is not None)
    if not seconds:
        return None
    middle = len(seconds) // 2
    median = seconds[middle] if len(seconds) % 2 else (seconds[middle - 1] + seconds[middle]) / 2
    return 1000 * median


def iteration_split(per_iteration: Sequence[dict], window) -> Optional[dict]:
    """Seconds and iteration counts of a window by kind: ``first`` (iteration 1), then ``eager``, ``capture``,
    ``replay`` (graphed training) or ``other`` (stock and eager training); None without per-iteration times."""
    first, last = window
    entries = [e for e in per_iteration if first <= e["iteration"] <= last and e.get("seconds") is not None]
    if not entries:
        return None
    split: Dict[str, dict] = {}
    for entry in entries:
        kind = "first" if entry["iteration"] == 1 else (entry.get("kind") or "other")
        bucket = split.setdefault(kind, dict(iterations=0, seconds=0.0))
        bucket["iterations"] += 1
        bucket["seconds"] += entry["seconds"]
    return split


def summarize(results: Sequence[dict], settings, source: CocoSource) -> dict:
    """Metrics per row with speedups against the first row of the same config on as many GPUs, scaling against
    the same row on one GPU, plus machine and settings."""
    windows = settings.windows()
    rows = [row_metrics(r, windows) for r in results]
    baselines: Dict[tuple, Optional[float]] = {}
    for metrics in rows:
        baseline = baselines.setdefault((metrics["config"], metrics["gpus"]), metrics["steady_img_s"])
        if baseline and metrics["steady_img_s"]:
            metrics["speedup"] = metrics["steady_img_s"] / baseline
    add_scaling(rows)
    return dict(
        timestamp=datetime.datetime.now().isoformat(timespec="seconds"),
        machine=machine_info(results),
        settings=dict(iters=settings.iters, batch_size=settings.batch_size, workers=settings.workers,
                      gpus=sorted({r.get("gpus", settings.gpus) for r in results}) or [settings.gpus],
                      windows={name: list(w) for name, w in windows.items()}),
        source=dict(root=str(source.root), images=source.num_images, seed=source.seed),
        rows=rows,
        results=list(results),
    )


def _random_text_encoder_configs(report: dict) -> list:
    return sorted({r["config"] for r in report["results"] if r.get("text_encoder")})


def _fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def markdown(report: dict) -> str:
    """The Markdown report: machine line, settings, the table, and the log tail of every failed row."""
    windows = report["settings"]["windows"]
    first, whole, steady = (windows[n] for n in ("first", "all", "steady"))
    # The ramp-up column: the first 100 iterations where the run has that window (the issue's measure), else all.
    ramp, ramp_key = (windows["first_100"], "first_100") if "first_100" in windows else (whole, "all")
    settings = report["settings"]
    lines = [
        f"**Machine:** {machine_line(report['machine'])}",
        "",
        f"**Run:** {settings['iters']} iterations per row, batch {settings['batch_size']}, "
        f"{settings['workers']} dataloader workers; synthetic COCO-like set of {report['source']['images']} "
        f"images (seed {report['source']['seed']}) through each config's own train pipeline. Steady state: "
        f"iterations {steady[0]}-{steady[1]}.",
        "",
        *[f"**Text encoder:** {Path(config).name} ran on a {TIMING_ONLY_LABEL} (BERT-base's shape, random weights, "
          "a generated vocabulary): its losses mean nothing.\n" for config in _random_text_encoder_configs(report)],
        f"| config | GPUs | row | status | steady img/s (it {steady[0]}-{steady[1]}) | steady ms/iter "
        f"| img/s it {ramp[0]}-{ramp[1]} | img/s it {first[0]}-{first[1]} | {ramp[0]}-{ramp[1]} / steady "
        f"| compiled kernels (new after it {first[1]}) | batch shapes (new after it {first[1]}) "
        f"| graph captures (host s: under capture, instantiating; at a shape's first call; signatures run eagerly) "
        f"| padded px / image px "
        f"| peak MiB allocated (reserved) "
        f"| speedup |",
        "|---|--:|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for m in report["rows"]:
        compiled = "-" if m["compiled_total"] is None else (
            f"{m['compiled_total']} ({_fmt(m['compiled_after_warmup'], 'd')})")
        shapes = "-" if m["batch_shapes"] is None else (
            f"{m['batch_shapes']} ({_fmt(m['batch_shapes_after_warmup'], 'd')})")
        phases = m.get("graph_capture_phase_seconds")
        captures = "-" if m["graph_captures"] is None else (
            f"{m['graph_captures']} ({_fmt(m['graph_capture_seconds'], '.1f')} s"
            + (f": forward {phases.get('forward', 0.0):.1f}, backward {phases.get('backward', 0.0):.1f}, of which "
               f"instantiation {phases.get('instantiate', 0.0):.1f}" if phases else "")
            + (f"; {m['graph_first_call_captures']} at first call" if m.get("graph_first_call_captures") else "")
            + (f"; {m['graph_fallbacks']} eager)" if m.get("graph_fallbacks") else ")"))
        memory = "-" if m["peak_allocated_mib"] is None else (
            f"{m['peak_allocated_mib']:.0f} ({_fmt(m.get('peak_reserved_mib'), '.0f')})")
        lines.append(
            f"| {m['config']} | {m.get('gpus', 1)} | {m['row']} | {m['status']} | {_fmt(m['steady_img_s'])} "
            f"| {_fmt(m['steady_ms_per_iter'], '.1f')} | {_fmt(m[ramp_key + '_img_s'])} | {_fmt(m['first_img_s'])} "
            f"| {_fmt(m[ramp_key + '_over_steady'])} | {compiled} | {shapes} | {captures} "
            f"| {_fmt(m['padded_over_image_pixels'])} "
            f"| {memory} "
            f"| {_fmt(m['speedup'], '.2f', 'x')} |")
    lines += split_table(report["rows"], whole, steady)
    lines += multi_gpu_tables(report["rows"], steady)
    lines += long_run_lines(report["rows"])
    failed = [r for r in report["results"] if r["status"] != "ok"]
    for result in failed:
        heading = f"**{Path(result['config']).name} {result['row']} {result['status']}** (log: {result['log']}):"
        lines += ["", heading, "", "```", result["error"] or "", "```"]
    return "\n".join(lines) + "\n"


SPLIT_KINDS = (("first", "iteration 1"), ("eager", "new shape, eager warm-up"), ("capture", "capture"),
               ("replay", "replay"), ("other", "other"))


def split_table(rows: Sequence[dict], whole, steady) -> list:
    """Markdown lines: each row's whole-run seconds by iteration kind (iterations, seconds, ms per iteration), and
    the median replayed iteration of the steady window."""
    split_rows = [m for m in rows if m.get("split")]
    if not split_rows:
        return []
    lines = ["", f"Where iterations {whole[0]}-{whole[1]} go (host clock at each iteration's end; iterations, "
                 "seconds, ms per iteration):", "",
             "| config | GPUs | row | " + " | ".join(title for _, title in SPLIT_KINDS)
             + f" | replay median, it {steady[0]}-{steady[1]} |",
             "|---|--:|---|" + "--:|" * (len(SPLIT_KINDS) + 1)]
    for m in split_rows:
        cells = []
        for kind, _ in SPLIT_KINDS:
            part = m["split"].get(kind)
            cells.append("-" if part is None else
                         f"{part['iterations']}, {part['seconds']:.2f} s, "
                         f"{1000 * part['seconds'] / part['iterations']:.0f}")
        cells.append(_fmt(m.get("steady_replay_median_ms"), ".1f", " ms"))
        lines.append(f"| {m['config']} | {m.get('gpus', 1)} | {m['row']} | " + " | ".join(cells) + " |")
    return lines


def write_reports(report: dict, out_dir: Path) -> str:
    """Write ``train_benchmark.{json,md}`` (this run) and append to ``train_benchmark.csv``; return the Markdown."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{REPORT_NAME}.json").write_text(json.dumps(report, indent=2, default=str))
    text = markdown(report)
    plot = plot_long_runs(report["results"], out_dir / f"{REPORT_NAME}_long_runs.png")
    if plot is not None:
        text += f"\n![long runs]({Path(plot).name})\n"
    (out_dir / f"{REPORT_NAME}.md").write_text(text)
    csv_path = out_dir / f"{REPORT_NAME}.csv"
    if csv_path.exists():
        with open(csv_path, newline="") as handle:
            header = next(csv.reader(handle), None)
        if header != list(CSV_FIELDS):  # written by another version: keep it aside rather than misalign columns
            csv_path.replace(out_dir / f"{REPORT_NAME}.{datetime.datetime.now():%Y%m%d-%H%M%S}.older-columns.csv")
    new_file = not csv_path.exists()
    common = dict(timestamp=report["timestamp"], commit=report["machine"]["commit"],
                  device=report["machine"]["device"], **{k: report["settings"][k]
                                                         for k in ("iters", "batch_size", "workers")})
    with open(csv_path, "a", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS, extrasaction="ignore")
        if new_file:
            writer.writeheader()
        for metrics in report["rows"]:
            writer.writerow({**common, **{k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()}})
    return text

