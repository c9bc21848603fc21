"""The detector benchmark's report: speedups against the baseline row, the Markdown tables, JSON, CSV and PNG."""
from __future__ import annotations

import json
import os
from collections import defaultdict
from typing import Dict, List, Optional

from deform_plugin.benchmarks.common import machine_line, markdown_table, pyplot, save_figure, write_csv
from deform_plugin.benchmarks.detector.configs import short_config_name
from deform_plugin.benchmarks.detector.profiling import PROFILE_COMPONENTS


def _by_config(results: List[dict]) -> Dict[str, List[dict]]:
    by_config = defaultdict(list)
    for r in results:
        by_config[r["config"]].append(r)
    return by_config


def add_speedups(results: List[dict]) -> None:
    """Speedups and memory ratios of every row against the first row of the same config."""
    for rows in _by_config(results).values():
        base = rows[0]
        for r in rows:
            r["baseline_row"] = base["row"]
            if r.get("train") and base.get("train"):
                r["train"]["speedup"] = r["train"]["img_per_s"] / base["train"]["img_per_s"]
                mem, base_mem = r["train"].get("memory"), base["train"].get("memory")
                if mem and base_mem:
                    r["train"]["memory_ratio"] = mem["allocated_mb"] / base_mem["allocated_mb"]
            if r.get("variable") and base.get("variable"):
                for name in ("new_sizes", "seen_sizes"):
                    r["variable"][name]["speedup"] = (r["variable"][name]["img_per_s"] /
                                                      base["variable"][name]["img_per_s"])
            if r.get("inference") and base.get("inference"):
                r["inference"]["speedup"] = r["inference"]["fps"] / base["inference"]["fps"]


def _fmt(value, spec: str) -> str:
    return format(value, spec) if value is not None else "-"


def _fmt_percent(fraction) -> str:
    return "-" if fraction is None else f"{100 * fraction:.0f}%"


def _status(r: dict) -> str:
    status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r.get('error', '')}"
    if (r.get("train") or {}).get("losses_finite") is False:
        status += " (non-finite loss)"
    return status


def _timing_table(rows: List[dict]) -> str:
    header = ["row", "train ms/step median (p20-p80)", "img/s", "speedup", "peak MiB", "mem ratio",
              "infer ms (bs1)", "FPS", "speedup", "first loss", "status"]
    lines = []
    for r in rows:
        t, i = r.get("train") or {}, r.get("inference") or {}
        timing = f"{t['median_ms']:.1f} ({t['p20_ms']:.1f}-{t['p80_ms']:.1f})" if t else "-"
        lines.append([r["row"], timing, _fmt(t.get("img_per_s"), ".2f"), _fmt(t.get("speedup"), ".2f") + "x",
                      _fmt((t.get("memory") or {}).get("allocated_mb"), ".0f"), _fmt(t.get("memory_ratio"), ".2f"),
                      _fmt(i.get("median_ms"), ".1f"), _fmt(i.get("fps"), ".2f"),
                      _fmt(i.get("speedup"), ".2f") + "x",
                      _fmt((t.get("first_step_losses") or {}).get("loss"), ".4f"), _status(r)])
    return markdown_table(header, lines)


def _variable_table(rows: List[dict]) -> Optional[str]:
    timed = [r for r in rows if r.get("variable")]
    if not timed:
        return None
    header = ["row", "new sizes img/s", "speedup", "seen sizes img/s", "speedup", "new size costs ms/step",
              "batch shapes"]
    lines = []
    for r in timed:
        v = r["variable"]
        new, seen = v["new_sizes"], v["seen_sizes"]
        lines.append([r["row"], f"{new['img_per_s']:.2f}", _fmt(new.get("speedup"), ".2f") + "x",
                      f"{seen['img_per_s']:.2f}", _fmt(seen.get("speedup"), ".2f") + "x",
                      f"{v['new_size_cost_ms']:.0f}", str(v["distinct_batch_shapes"])])
    return ("training at random-resize sizes: each batch first at a size not seen before, then the same batches "
            "again\n" + markdown_table(header, lines))


def _profile_table(rows: List[dict]) -> Optional[str]:
    profiled = [r for r in rows if r.get("profile")]
    if not profiled:
        return None
    header = ["row", "time", "step wall ms", "busy", "unprofiled step wall ms", "busy (unprofiled wall)",
              "kernels (ops)/step", "host syncs/step", "host reads/step",
              *PROFILE_COMPONENTS]
    lines = []
    for r in profiled:
        p = r["profile"]
        cuda = p["time_kind"] == "CUDA"
        busy = p.get("busy_fraction")
        components = [f"{p['components_ms_per_step'][c]:.1f}" +
                      (f" ({p['host_components_ms_per_step'][c]:.1f})" if cuda else "") for c in PROFILE_COMPONENTS]
        lines.append([r["row"], p["time_kind"], _fmt(p.get("step_wall_ms"), ".1f"),
                      f"{100 * busy:.0f}%" if busy is not None else "-",
                      _fmt(p.get("unprofiled_step_wall_ms"), ".1f"),
                      _fmt_percent(p.get("busy_fraction_unprofiled")),
                      _fmt(p.get("kernels_per_step", p.get("ops_per_step")), ".0f"),
                      _fmt(p.get("host_syncs_per_step"), ".0f"), _fmt(p.get("host_reads_per_step"), ".0f"),
                      *components])
    return ("profile, ms per step by component: device time (CUDA kernels, or CPU op self-time on a CPU), with "
            "the host time that issued it in parentheses on CUDA rows; busy = union of kernel time over the step's "
            "wall time, under the profiler (whose overhead falls on the host) and over the same steps' wall time "
            "without it; host syncs = synchronising CUDA runtime "
            "calls, host reads = aten::_local_scalar_dense (.item() and friends)\n" + markdown_table(header, lines))


def format_table(results: List[dict], info: dict) -> str:
    lines = [machine_line(info)]
    for config, rows in _by_config(results).items():
        shape = rows[0].get("shape")
        shape_text = f", shape {shape[0]}x{shape[1]}" if shape else ""
        text_encoder = next((r["text_encoder"] for r in rows if r.get("text_encoder")), None)
        text_encoder_text = f"; language model: {text_encoder}" if text_encoder else ""
        lines += ["", f"config: {config} (baseline: {rows[0]['row']}{shape_text}{text_encoder_text})",
                  _timing_table(rows)]
        variable = _variable_table(rows)
        if variable:
            lines += ["", variable]
        profile = _profile_table(rows)
        if profile:
            lines += ["", profile]
    return "\n".join(lines)


CSV_FIELDS = ("config", "row", "backend", "mode", "fast", "shape", "status", "error", "param_groups",
              "train_median_ms", "train_p20_ms", "train_p80_ms", "train_std_ms", "img_per_s", "train_speedup",
              "peak_allocated_mb", "peak_reserved_mb", "memory_ratio", "first_loss", "infer_median_ms", "infer_fps",
              "infer_speedup", "new_sizes_img_per_s", "seen_sizes_img_per_s", "new_size_cost_ms",
              "profile_step_wall_ms", "profile_busy_fraction", "profile_unprofiled_step_wall_ms",
              "profile_busy_fraction_unprofiled", "profile_kernels_per_step",
              "profile_host_syncs_per_step", "profile_host_reads_per_step",
              *[f"profile_{c}_ms" for c in PROFILE_COMPONENTS], *[f"profile_host_{c}_ms" for c in PROFILE_COMPONENTS],
              "host_forward_ms", "host_backward_ms", "host_matching_ms", "host_optimizer_ms")


def csv_row(r: dict) -> dict:
    t, i, p = r.get("train") or {}, r.get("inference") or {}, r.get("profile") or {}
    v = r.get("variable") or {}
    mem = t.get("memory") or {}
    host_ranges = p.get("host_ms_per_step") or {}
    row = {"config": r["config"], "row": r["row"], "backend": r["backend"], "mode": r["mode"], "fast": r["fast"],
           "shape": "x".join(map(str, r["shape"])) if r.get("shape") else "", "status": r["status"],
           "error": r.get("error", ""), "param_groups": (r.get("optimizer") or {}).get("param_groups"),
           "train_median_ms": t.get("median_ms"), "train_p20_ms": t.get("p20_ms"), "train_p80_ms": t.get("p80_ms"),
           "train_std_ms": t.get("std_ms"), "img_per_s": t.get("img_per_s"), "train_speedup": t.get("speedup"),
           "peak_allocated_mb": mem.get("allocated_mb"), "peak_reserved_mb": mem.get("reserved_mb"),
           "memory_ratio": t.get("memory_ratio"), "first_loss": (t.get("first_step_losses") or {}).get("loss"),
           "infer_median_ms": i.get("median_ms"), "infer_fps": i.get("fps"), "infer_speedup": i.get("speedup"),
           "new_sizes_img_per_s": (v.get("new_sizes") or {}).get("img_per_s"),
           "seen_sizes_img_per_s": (v.get("seen_sizes") or {}).get("img_per_s"),
           "new_size_cost_ms": v.get("new_size_cost_ms"),
           "profile_step_wall_ms": p.get("step_wall_ms"), "profile_busy_fraction": p.get("busy_fraction"),
           "profile_unprofiled_step_wall_ms": p.get("unprofiled_step_wall_ms"),
           "profile_busy_fraction_unprofiled": p.get("busy_fraction_unprofiled"),
           "profile_kernels_per_step": p.get("kernels_per_step", p.get("ops_per_step")),
           "profile_host_syncs_per_step": p.get("host_syncs_per_step"),
           "profile_host_reads_per_step": p.get("host_reads_per_step")}
    for c in PROFILE_COMPONENTS:
        row[f"profile_{c}_ms"] = (p.get("components_ms_per_step") or {}).get(c)
        row[f"profile_host_{c}_ms"] = (p.get("host_components_ms_per_step") or {}).get(c)
    for name in ("forward", "backward", "matching", "optimizer"):
        row[f"host_{name}_ms"] = host_ranges.get(name)
    return row


def _stacked_bars(ax, profiled: List[dict], key: str, ylabel: str) -> None:
    colors = pyplot().get_cmap("tab10").colors
    bottoms = [0.0] * len(profiled)
    for index, component in enumerate(PROFILE_COMPONENTS):
        values = [r["profile"][key][component] for r in profiled]
        ax.bar(range(len(profiled)), values, bottom=bottoms, label=component, color=colors[index % len(colors)])
        bottoms = [b + v for b, v in zip(bottoms, values)]
    for x, r in enumerate(profiled):
        p = r["profile"]
        wall, busy = p.get("step_wall_ms"), p.get("busy_fraction")
        if wall:
            counts = (f"\n{p['host_syncs_per_step']:.0f} syncs" if p.get("host_syncs_per_step") is not None
                      else f"\n{p.get('host_reads_per_step', 0):.0f} host reads")
            ax.plot([x - 0.4, x + 0.4], [wall, wall], color="black", linewidth=1.5)
            ax.text(x, wall, f"step {wall:.0f} ms" + (f"\nbusy {100 * busy:.0f}%" if busy else "") + counts,
                    ha="center", va="bottom", fontsize=7)
    tallest = max([*bottoms, *(r["profile"].get("step_wall_ms") or 0 for r in profiled)])
    ax.set_ylim(0, 1.3 * tallest or 1)  # room for the labels above the wall-time lines
    ax.set_xticks(range(len(profiled)))
    ax.set_xticklabels([f"{short_config_name(r['config'])}\n{r['row']}" for r in profiled], fontsize=7)
    ax.set_ylabel(ylabel)


def plot_profiles(results: List[dict], path: str) -> Optional[str]:
    """Stacked bars of time by component per (config, row), the step's wall time drawn over them; a second panel
    with the host time by component when some row ran on CUDA."""
    profiled = [r for r in results if r.get("profile")]
    if not profiled:
        return None
    kind = profiled[0]["profile"]["time_kind"]
    cuda = any(r["profile"]["time_kind"] == "CUDA" for r in profiled)
    width = max(6.0, 1.6 * len(profiled) + 2)
    fig, axes = pyplot().subplots(1, 2 if cuda else 1, figsize=(width * (2 if cuda else 1), 5.5), squeeze=False)
    _stacked_bars(axes[0][0], profiled, "components_ms_per_step", f"{kind} time per training step (ms)")
    axes[0][0].set_title(f"{kind} time by component (bars) vs step wall time (lines)")
    if cuda:
        _stacked_bars(axes[0][1], profiled, "host_components_ms_per_step", "host time per training step (ms)")
        axes[0][1].set_title("host time by component (bars) vs step wall time (lines)")
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return save_figure(fig, path)


def write_outputs(results: List[dict], info: dict, args, rows, table: str) -> Dict[str, str]:
    """NAME.json (machine, settings, results), NAME.csv, NAME.md and, if profiled, NAME_profile.png."""
    if not args.out_dir:
        return {}
    os.makedirs(args.out_dir, exist_ok=True)
    paths = {"json": os.path.join(args.out_dir, f"{args.name}.json"),
             "csv": os.path.join(args.out_dir, f"{args.name}.csv"),
             "table": os.path.join(args.out_dir, f"{args.name}.md")}
    settings = {k: v for k, v in vars(args).items() if k not in ("rows", "child_json")}
    settings["rows"] = [r.label for r in rows]
    with open(paths["json"], "w") as f:
        json.dump({"machine": info, "settings": settings, "results": results}, f, indent=2, default=str)
    write_csv(paths["csv"], [csv_row(r) for r in results], fields=CSV_FIELDS)
    with open(paths["table"], "w") as f:
        f.write(table + "\n")
    stem = args.name if args.name.endswith("profile") else f"{args.name}_profile"
    chart = plot_profiles(results, os.path.join(args.out_dir, f"{stem}.png"))
    if chart:
        paths["png"] = chart
    return paths
