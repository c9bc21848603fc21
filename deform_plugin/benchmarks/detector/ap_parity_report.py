"""The AP parity report: per config and row, bbox mAP over seeds against the baseline row, and the loss curves.

The statistics (:func:`summarize`):

- a run *counts* when it trained every planned iteration and was evaluated after the last one; a run that failed,
  was killed or stopped early (a time limit) is listed in the row's notes with what it reached, and left out of
  the statistics: rows compared at different iterations would not be a parity test;
- per row: the mean and the sample standard deviation (n - 1) of the final bbox mAP over the seeds that count, the
  same for mAP_50, and the paired difference to the baseline row (the plan's first row, normally ``stock:fp32``)
  over the seeds where both count: each seed's runs share their initial weights and their data order;
- the target: ``|mean - baseline mean| <= max(baseline std, 0.01)`` (one baseline standard deviation, or 0.01 where
  that is larger; with one baseline seed, 0.01).

The files (:func:`write_reports`): ``ap_parity.md`` (the tables, printed too), ``ap_parity.json`` (the summary and
every run's record), ``ap_parity.csv`` (one line per run) and ``ap_parity_<config>.png`` (per row the mean loss
curve over seeds with its min-max band, and each seed's mAP beside the baseline's target band).
"""
from __future__ import annotations

import datetime
import json
import math
import statistics
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from ..common import pyplot, save_figure, write_csv
from .train_report import machine_info, machine_line

REPORT_NAME = "ap_parity"
MIN_TOLERANCE = 0.01
MAP_KEY = "coco/bbox_mAP"
MAP50_KEY = "coco/bbox_mAP_50"
CSV_FIELDS = ("config", "row", "seed", "status", "counts", "iterations", "planned_iterations", "stopped_early",
              "bbox_mAP", "bbox_mAP_50", "final_loss", "nonfinite_losses", "train_seconds", "it_per_s",
              "peak_allocated_mib", "peak_reserved_mib", "padded_over_image_pixels", "batch_shapes",
              "graph_captures", "gpu", "init_mismatch", "log")


def mean_std(values: Sequence[float]) -> Tuple[Optional[float], Optional[float]]:
    """(mean, sample standard deviation); the deviation is None below two values, both None for none."""
    values = [float(v) for v in values]
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def tolerance(baseline_std: Optional[float]) -> float:
    """How far a row's mean may be from the baseline's: one baseline standard deviation, at least 0.01."""
    return max(baseline_std or 0.0, MIN_TOLERANCE)


def within_target(row_mean: float, baseline_mean: float, baseline_std: Optional[float]) -> bool:
    # Rounded to 1e-9: the metrics have three decimals, and a gap of exactly the tolerance is within it.
    return round(abs(row_mean - baseline_mean), 9) <= round(tolerance(baseline_std), 9)


def final_metrics(run: dict) -> Optional[dict]:
    """The metrics of the evaluation after the run's last iteration, or None."""
    evaluations = run.get("evaluations") or []
    if not evaluations or evaluations[-1]["iteration"] != run.get("iterations"):
        return None
    return evaluations[-1]["metrics"]


def counts(run: dict) -> bool:
    """Whether a run enters the statistics: ran and evaluated every planned iteration."""
    return (run.get("status") == "ok" and not run.get("stopped_early") and final_metrics(run) is not None
            and run.get("iterations") == run.get("planned_iterations"))


def run_map(run: dict, key: str = MAP_KEY) -> Optional[float]:
    metrics = final_metrics(run)
    return None if metrics is None or metrics.get(key) is None else float(metrics[key])


def _fmt(value, spec: str = ".3f") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:{spec}}"


def _mean_of(runs: Sequence[dict], key: str) -> Optional[float]:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.fmean(values) if values else None


def run_note(run: dict) -> str:
    """Why a run does not count, with what it reached."""
    reached = f"{run.get('iterations') or 0}/{run.get('planned_iterations') or '?'} it"
    value = run_map(run)
    got = f", mAP {value:.3f}" if value is not None else ""
    if run.get("status") == "ok" and run.get("stopped_early"):
        return f"seed {run['seed']} stopped early ({run['stopped_early']}) at {reached}{got}"
    return f"seed {run['seed']} {run.get('status', 'failed')} at {reached}{got}"


def row_summary(runs: Sequence[dict], seeds: Sequence[int]) -> dict:
    counted = [r for r in runs if counts(r)]
    maps = {r["seed"]: run_map(r) for r in counted}
    mean, std = mean_std(list(maps.values()))
    mean50, std50 = mean_std([run_map(r, MAP50_KEY) for r in counted if run_map(r, MAP50_KEY) is not None])
    notes = [run_note(r) for r in runs if not counts(r)]
    missing = [s for s in seeds if s not in {r["seed"] for r in runs}]
    notes += [f"seed {s} has no record" for s in missing]
    nonfinite = sum(r.get("nonfinite_losses") or 0 for r in runs)
    if nonfinite:
        notes.append(f"{nonfinite} non-finite logged losses")
    mismatched = [r["seed"] for r in runs if r.get("init_mismatch")]
    if mismatched:
        notes.append(f"initial weights did not load exactly (seeds {mismatched})")
    return dict(n=len(counted), n_planned=len(seeds), maps=maps, mean=mean, std=std, map50_mean=mean50,
                map50_std=std50, final_loss=_mean_of(counted, "final_loss"), it_per_s=_mean_of(counted, "it_per_s"),
                peak_allocated_mib=_mean_of(counted, "peak_allocated_mib"),
                padded_over_image_pixels=_mean_of(counted, "padded_over_image_pixels"), nonfinite_losses=nonfinite,
                notes=notes)


def paired_delta(row: dict, baseline: dict) -> Tuple[Optional[float], Optional[float], int]:
    """Mean and sample std of (row - baseline) mAP over the seeds where both count, and how many."""
    seeds = sorted(set(row["maps"]) & set(baseline["maps"]))
    mean, std = mean_std([row["maps"][s] - baseline["maps"][s] for s in seeds])
    return mean, std, len(seeds)


def schedule_table(runs: Sequence[dict], rows: Sequence[str], eval_iterations: Sequence[int]) -> Dict[str, dict]:
    """row -> {iteration: (mean, std, n)} of bbox mAP at each planned evaluation, over every run that reached it
    (runs that stopped early count at the evaluations they reached)."""
    table = {}
    for label in rows:
        per_iteration = {}
        for iteration in eval_iterations:
            values = [e["metrics"][MAP_KEY] for r in runs if r["row"] == label
                      for e in r.get("evaluations") or [] if e["iteration"] == iteration and MAP_KEY in e["metrics"]]
            mean, std = mean_std(values)
            per_iteration[iteration] = (mean, std, len(values))
        table[label] = per_iteration
    return table


def summarize(plan: dict, runs: Sequence[dict]) -> dict:
    """The report: per config, per row, the statistics above and the verdict against the baseline row."""
    rows, seeds = plan["rows"], plan["seeds"]
    baseline_label = rows[0]
    configs = []
    for config in plan["configs"]:
        config_runs = [r for r in runs if r["config"] == config["name"]]
        summaries = {label: row_summary([r for r in config_runs if r["row"] == label], seeds) for label in rows}
        baseline = summaries[baseline_label]
        for label, summary in summaries.items():
            summary["row"] = label
            summary["delta_mean"], summary["delta_std"], summary["delta_n"] = paired_delta(summary, baseline)
            summary["tolerance"] = tolerance(baseline["std"])
            if label == baseline_label:
                summary["within_target"] = None
            elif summary["n"] and baseline["n"]:
                summary["within_target"] = within_target(summary["mean"], baseline["mean"], baseline["std"])
            else:
                summary["within_target"] = None
        evaluations = config.get("eval_iterations") or plan["eval_iterations"]
        configs.append(dict(name=config["name"], title=config["title"], rows=[summaries[label] for label in rows],
                            decided=config.get("schedule"), eval_iterations=evaluations,
                            schedule=schedule_table(config_runs, rows, evaluations)))
    timings = [dict(row=r["row"], timing=r["timing"]) for r in runs if r.get("timing")]
    return dict(timestamp=datetime.datetime.now().isoformat(timespec="seconds"), machine=machine_info(timings),
                plan=plan, baseline=baseline_label, configs=configs, runs=list(runs))


def verdict(summary: dict, baseline: dict) -> str:
    if summary["within_target"] is None:
        return "baseline" if summary is baseline else "n/a (no run counts)"
    gap = abs(summary["mean"] - baseline["mean"])
    partial = "".join(f"; {s['row']} on {s['n']} of {s['n_planned']} seeds" for s in (summary, baseline)
                      if s["n"] < s["n_planned"])
    return (f"**yes** (gap {gap:.3f} <= {summary['tolerance']:.3f}{partial})" if summary["within_target"]
            else f"**no** (gap {gap:.3f} > {summary['tolerance']:.3f}{partial})")


def _mean_pm(mean, std) -> str:
    if mean is None:
        return "-"
    return f"{mean:.3f} ± {std:.3f}" if std is not None else f"{mean:.3f}"


def settings_line(plan: dict) -> str:
    s = plan["schedule"]
    devices = (f"GPUs {','.join(map(str, plan['gpus']))}, {plan['per_gpu']} runs at a time per GPU"
               if plan["device"] == "cuda" else f"CPU, {plan['per_gpu']} runs at a time")
    val = (f"{plan['val_images']} of the val split's images" if plan["val_images"] < plan["val_split_images"]
           else f"the whole val split ({plan['val_split_images']} images)")
    length = (f"as many iterations as fit before the deadline, decided per config during the run (at most "
              f"{s['iters']}), of batch {s['batch_size']}" if plan.get("auto") else
              f"{s['iters']} iterations of batch {s['batch_size']}")
    step = "at 80%" if plan.get("auto") else f"at iteration {plan['decay_iteration']}"
    paced = (f"; the runs of a config paced to within {plan['pace_slack']} iterations of each other"
             if plan.get("pacing") else "")
    return (f"**Run:** {length} per run (learning rate {s['lr']:g}, backbone lr_mult {s['backbone_lr_mult']:g}, "
            f"linear warm-up over {s['warmup_iters']}, /10 {step}), square random-resize scales "
            f"{', '.join(map(str, s['scales']))}, test scale {s['test_scale']}, backbone {s['backbone']}; evaluated "
            f"on {val}; seeds {', '.join(map(str, plan['seeds']))}, each seed's rows from the same initial weights; "
            f"{devices}{paced}.")


def markdown(report: dict) -> str:
    plan = report["plan"]
    lines = [f"**Machine:** {machine_line(report['machine'])}", "", settings_line(plan), "",
             f"Final bbox mAP on the shapes val split, mean ± sample std over the seeds whose run trained every "
             f"iteration. Target: a row's mean within max(std of {report['baseline']}, {MIN_TOLERANCE}) of "
             f"{report['baseline']}'s mean. Paired: each seed's mAP minus {report['baseline']}'s of that seed."]
    for config in report["configs"]:
        baseline = config["rows"][0]
        lines += ["", f"### {config['title']} (`{config['name']}`)", ""]
        decided = config.get("decided")
        if decided:
            lines += [f"Schedule decided during the run: {decided['iters']} iterations (learning rate /10 at "
                      f"{decided['milestone']}), from its slowest run's {decided['rate']:.2f} it/s.", ""]
        lines += ["| row | bbox mAP | per seed | mAP_50 | paired gap to baseline | within target | final loss "
                  "| it/s | peak MiB | padded / image px | notes |",
                  "|---|--:|---|--:|--:|---|--:|--:|--:|--:|---|"]
        for summary in config["rows"]:
            per_seed = ", ".join(f"{seed}: {value:.3f}" for seed, value in sorted(summary["maps"].items())) or "-"
            delta = ("-" if summary is baseline or summary["delta_mean"] is None else
                     f"{summary['delta_mean']:+.3f}" + (f" ± {summary['delta_std']:.3f}"
                                                         if summary["delta_std"] is not None else ""))
            count = "" if summary["n"] == summary["n_planned"] else f" (n={summary['n']} of {summary['n_planned']})"
            lines.append(
                f"| {summary['row']} | {_mean_pm(summary['mean'], summary['std'])}{count} | {per_seed} "
                f"| {_mean_pm(summary['map50_mean'], summary['map50_std'])} | {delta} | {verdict(summary, baseline)} "
                f"| {_fmt(summary['final_loss'])} | {_fmt(summary['it_per_s'], '.2f')} "
                f"| {_fmt(summary['peak_allocated_mib'], '.0f')} | {_fmt(summary['padded_over_image_pixels'], '.2f')} "
                f"| {'; '.join(summary['notes']) or '-'} |")
        iterations = config["eval_iterations"]
        if len(iterations) > 1:
            lines += ["", "bbox mAP at each evaluation (mean ± std over the runs that reached it, n):", "",
                      "| row | " + " | ".join(f"it {i}" for i in iterations) + " |",
                      "|---|" + "--:|" * len(iterations)]
            for label, cells in config["schedule"].items():
                lines.append(f"| {label} | " + " | ".join(
                    f"{_mean_pm(mean, std)} ({n})" if n else "-" for mean, std, n in cells.values()) + " |")
        lines += ["", f"![{config['name']}](ap_parity_{config['name']}.png)"]
    failed = [r for r in report["runs"] if r.get("status") not in ("ok",) and r.get("error")]
    for run in failed:
        lines += ["", f"**{run['name']} {run['status']}** (log: {run.get('log')}):", "", "```",
                  run["error"], "```"]
    return "\n".join(lines) + "\n"


def _common_curve(curves: Sequence[Sequence[Sequence[float]]]):
    """(iterations logged by every curve, their mean, min, max) of several runs' loss curves."""
    maps = [{int(i): float(v) for i, v in curve} for curve in curves if curve]
    if not maps:
        return [], [], [], []
    iterations = sorted(set.intersection(*(set(m) for m in maps)))
    values = [[m[i] for m in maps] for i in iterations]
    return (iterations, [statistics.fmean(v) for v in values], [min(v) for v in values], [max(v) for v in values])


def plot_config(report: dict, config: dict, path: Path) -> str:
    """Loss curves (mean over seeds, min-max band) and each seed's final mAP per row, for one config."""
    plt = pyplot()
    fig, (loss_ax, map_ax) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw=dict(width_ratios=[2, 1]))
    labels = [summary["row"] for summary in config["rows"]]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, label in enumerate(labels):
        # The runs that count (a run cut short would cut every seed's curve at its last iteration); where none
        # does, every run that logged a loss, labelled so.
        runs = [r for r in report["runs"] if r["config"] == config["name"] and r["row"] == label]
        counted = [r for r in runs if counts(r)]
        shown = counted or [r for r in runs if r.get("loss_curve")]
        iterations, mean, low, high = _common_curve([r.get("loss_curve") or [] for r in shown])
        if iterations:
            color = colors[index % len(colors)]
            seeds = f"{len(shown)} seeds" + ("" if counted else ", cut short")
            loss_ax.plot(iterations, mean, color=color, label=f"{label} ({seeds})")
            loss_ax.fill_between(iterations, low, high, color=color, alpha=0.2, linewidth=0)
    loss_ax.set_xlabel("iteration")
    loss_ax.set_ylabel("training loss (logged mean)")
    loss_ax.set_title(f"{config['title']}: loss, mean and min-max over seeds")
    loss_ax.grid(alpha=0.3)
    if loss_ax.lines:
        loss_ax.legend()
    baseline = config["rows"][0]
    if baseline["mean"] is not None:
        map_ax.axhspan(baseline["mean"] - baseline["tolerance"], baseline["mean"] + baseline["tolerance"],
                       color="0.85", label=f"target around {baseline['row']}")
    for index, summary in enumerate(config["rows"]):
        color = colors[index % len(colors)]
        seeds = sorted(summary["maps"])
        map_ax.scatter([index] * len(seeds), [summary["maps"][s] for s in seeds], color=color, zorder=3)
        if summary["mean"] is not None:
            map_ax.errorbar([index + 0.15], [summary["mean"]], yerr=[summary["std"] or 0.0], color=color, fmt="D",
                            capsize=4, zorder=3)
    map_ax.set_xticks(range(len(labels)))
    map_ax.set_xticklabels(labels, rotation=20, ha="right")
    map_ax.set_ylabel("final bbox mAP (val)")
    map_ax.set_title("mAP per seed, mean ± std")
    map_ax.grid(alpha=0.3, axis="y")
    if baseline["mean"] is not None:
        map_ax.legend(loc="lower right", fontsize="small")
    return save_figure(fig, path)


def csv_rows(report: dict) -> List[dict]:
    rows = []
    for run in report["runs"]:
        row = {key: run.get(key) for key in CSV_FIELDS}
        row.update(counts=counts(run), bbox_mAP=run_map(run), bbox_mAP_50=run_map(run, MAP50_KEY))
        rows.append({k: round(v, 5) if isinstance(v, float) else v for k, v in row.items()})
    return rows


def write_reports(report: dict, out_dir: Path) -> Tuple[str, List[Path]]:
    """Write the Markdown, JSON, CSV and one PNG per config into ``out_dir``; returns (Markdown, paths)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    text = markdown(report)
    paths = [out_dir / f"{REPORT_NAME}.md", out_dir / f"{REPORT_NAME}.json", out_dir / f"{REPORT_NAME}.csv"]
    paths[0].write_text(text)
    paths[1].write_text(json.dumps(report, indent=1, default=str))
    write_csv(paths[2], csv_rows(report), CSV_FIELDS)
    for config in report["configs"]:
        paths.append(Path(plot_config(report, config, out_dir / f"{REPORT_NAME}_{config['name']}.png")))
    return text, paths
