"""What every benchmark shares: the machine line, timing, peak memory, the error metric and the writers.

One helper per concern, so the op benchmarks and the detector benchmark report the same way:

- :func:`machine_info` / :func:`machine_line`: device, CUDA, torch, triton, mmcv (and whether its compiled ops are
  present), mmdet, python, commit, date; every table starts with this line;
- :func:`do_bench`: ``triton.testing.do_bench`` median with the 20th and 80th percentiles;
- :func:`summarize_ms`: the same statistics of host-timed samples;
- :func:`reset_peak_memory`, :func:`peak_memory_mb`, :func:`peak_extra_memory_mb`: peak CUDA memory;
- :func:`relative_error`: ``||actual - expected|| / ||expected||`` (Frobenius norms, in float64);
- :func:`init_weights_quietly`: a random model's ``init_weights()`` without mmengine's log of every parameter;
- :func:`write_csv`, :func:`markdown_table`, :func:`plot_lines` / :func:`save_figure`: the writers.

This module imports torch and the standard library only: it serves processes that must not import deform_plugin.
"""
from __future__ import annotations

import csv
import math
import os
import platform
import runpy
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
MMCV_LITE_SCRIPT = Path(__file__).resolve().parents[1] / "integration" / "mmcv_lite.py"
QUANTILES = (0.5, 0.2, 0.8)


# ---------------------------------------------------------------------------------------------------------------------
# Machine line
# ---------------------------------------------------------------------------------------------------------------------

def repo_commit() -> str:
    """Short hash of this checkout's HEAD, with ``+dirty`` when tracked files have uncommitted changes.

    A copy of the tree without ``.git`` (a remote GPU host gets one) names its commit through the environment
    variable ``DEFORM_PLUGIN_COMMIT``; without either, ``'unknown'``.
    """
    named = os.environ.get("DEFORM_PLUGIN_COMMIT")
    if named:
        return named

    def git(*argv: str) -> str:
        try:
            return subprocess.run(["git", *argv], cwd=REPO_ROOT, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return "unknown"
    return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def package_version(name: str) -> Optional[str]:
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:  # noqa: BLE001 - any metadata failure means "not installed"
        return None


def mmcv_compiled_ops_available() -> bool:
    """deform_plugin's answer to "are mmcv's compiled ops present?", asked without importing deform_plugin (its
    ``mmcv_lite.py`` is run by path: it imports the standard library and torch only)."""
    return bool(runpy.run_path(str(MMCV_LITE_SCRIPT))["compiled_mmcv_ops_available"]())


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{props.name} ({props.multi_processor_count} SMs)"
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def machine_info(device: Optional[torch.device] = None) -> dict:
    """Everything the machine line names, as a dict (the JSON reports keep it whole)."""
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return {"device": device_name(torch.device(device)), "cuda": torch.version.cuda, "torch": torch.__version__,
            "triton": package_version("triton"), "mmcv": package_version("mmcv") or package_version("mmcv-lite"),
            "mmcv_compiled_ops": mmcv_compiled_ops_available(), "mmdet": package_version("mmdet"),
            "mmengine": package_version("mmengine"), "python": platform.python_version(), "commit": repo_commit(),
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}


def machine_line(info: Mapping) -> str:
    compiled = {True: "yes", False: "no"}.get(info.get("mmcv_compiled_ops"), "unknown")
    return (f"machine: {info['device']}, CUDA {info['cuda']}, torch {info['torch']}, triton {info['triton']}, "
            f"mmcv {info['mmcv']} (compiled ops: {compiled}), mmdet {info['mmdet']}, python {info['python']}, "
            f"commit {info['commit']}, {info['date_utc']} UTC")


# ---------------------------------------------------------------------------------------------------------------------
# Timing and memory
# ---------------------------------------------------------------------------------------------------------------------

def summarize_ms(samples_s: Sequence[float]) -> dict:
    """Median, 20th/80th percentiles (linear interpolation), min, max and std in ms of samples in seconds."""
    ms = sorted(s * 1e3 for s in samples_s)

    def quantile(q: float) -> float:
        pos = q * (len(ms) - 1)
        lo = int(math.floor(pos))
        hi = min(lo + 1, len(ms) - 1)
        return ms[lo] + (ms[hi] - ms[lo]) * (pos - lo)
    return {"median_ms": statistics.median(ms), "p20_ms": quantile(0.2), "p80_ms": quantile(0.8),
            "min_ms": ms[0], "max_ms": ms[-1], "std_ms": statistics.pstdev(ms), "n": len(ms)}


def do_bench(fn: Callable[[], object], device: Optional[torch.device] = None, warmup: int = 25,
             rep: int = 100, cpu_calls: int = 3) -> Tuple[float, float, float]:
    """(median, p20, p80) in ms of ``fn()``.

    On CUDA: ``triton.testing.do_bench`` (L2 flushed before each call, ``warmup`` and ``rep`` in ms). On a CPU
    (smoke runs of the tools only, never a number to report): ``cpu_calls`` wall-clock calls.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        import triton.testing
        return tuple(triton.testing.do_bench(fn, warmup=warmup, rep=rep, quantiles=list(QUANTILES)))
    samples = []
    for _ in range(cpu_calls):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    stats = summarize_ms(samples)
    return stats["median_ms"], stats["p20_ms"], stats["p80_ms"]


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device: torch.device) -> Optional[dict]:
    """Peak allocated and reserved CUDA memory (MiB) since :func:`reset_peak_memory`; None off CUDA."""
    if device.type != "cuda":
        return None
    return {"allocated_mb": torch.cuda.max_memory_allocated(device) / 2 ** 20,
            "reserved_mb": torch.cuda.max_memory_reserved(device) / 2 ** 20}


def peak_extra_memory_mb(fn: Callable[[], object], device: torch.device) -> float:
    """Peak CUDA memory (MiB) allocated during one ``fn()`` above what was allocated before it; NaN off CUDA."""
    if device.type != "cuda":
        return float("nan")
    reset_peak_memory(device)
    before = torch.cuda.memory_allocated(device)
    result = fn()
    torch.cuda.synchronize(device)
    extra = peak_memory_mb(device)["allocated_mb"] - before / 2 ** 20
    del result
    return extra


# ---------------------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------------------

def init_weights_quietly(model) -> None:
    """``model.init_weights()`` with mmengine's logger at WARNING (it logs a paragraph per parameter at INFO).

    A model built from a config without ``init_weights()`` (mmdet's ``init_detector(config, None)`` does not run it)
    keeps whatever memory some parameters were allocated in: DETR's ``level_embed`` is ``torch.Tensor(L, C)``.
    """
    import logging

    from mmengine.logging import MMLogger
    logger = MMLogger.get_current_instance()
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        model.init_weights()
    finally:
        logger.setLevel(level)


# ---------------------------------------------------------------------------------------------------------------------
# Error metric
# ---------------------------------------------------------------------------------------------------------------------

def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected||_F / ||expected||_F`` in float64; inf when ``actual`` has a NaN or an infinity.

    Norm-based rather than max-based: one rounding-sized outlier next to a small largest element does not dominate
    it, and it reads as the relative error of the tensor as a whole.
    """
    actual, expected = actual.detach().double(), expected.detach().double()
    if not torch.isfinite(actual).all():
        return float("inf")
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------------------------------------------------------
# Writers
# ---------------------------------------------------------------------------------------------------------------------

def write_csv(path, rows: Sequence[Mapping], fields: Optional[Sequence[str]] = None, append: bool = False) -> Path:
    """Write ``rows`` to a CSV (``fields`` or the keys of the rows, first-seen order).

    With ``append``, rows go after those already in the file; a file whose header lacks some of the new fields is
    rewritten with the union of both headers, so runs of different versions stay in one readable table.
    """
    path = Path(path)
    fields = list(fields) if fields is not None else list(dict.fromkeys(k for row in rows for k in row))
    previous: List[dict] = []
    if append and path.exists() and path.stat().st_size:
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            header = list(reader.fieldnames or [])
            if set(fields) <= set(header):
                with path.open("a", newline="") as out:
                    csv.DictWriter(out, fieldnames=header, restval="").writerows(rows)
                return path
            previous = list(reader)
        fields = header + [k for k in fields if k not in header]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, restval="")
        writer.writeheader()
        writer.writerows(previous)
        writer.writerows(rows)
    return path


def markdown_table(header: Sequence[str], rows: Iterable[Sequence], pad: bool = False) -> str:
    """A Markdown table; ``pad`` aligns the columns for reading in a terminal."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    if pad:
        widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
        cells = [[c.ljust(w) for c, w in zip(row, widths)] for row in cells]
        rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    else:
        rule = "|" + "---|" * len(header)
    lines = ["| " + " | ".join(row) + " |" for row in cells]
    lines.insert(1, rule)
    return "\n".join(lines)


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return str(path)


def plot_lines(path, panels: Sequence[Mapping], title: str = "", panel_size: Tuple[float, float] = (6.5, 4.5)
               ) -> str:
    """One PNG of side-by-side line plots, one line per implementation.

    Each panel is a mapping with ``series`` (label -> list of (x, y)), ``xlabel``, ``ylabel`` and optionally
    ``styles`` (label -> matplotlib line style), ``xlog``/``ylog`` (default True/True) and ``vline`` (an x to
    mark). Points with a NaN y are left out.
    """
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(panel_size[0] * len(panels), panel_size[1]), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        styles = panel.get("styles") or {}
        for label, points in sorted(panel["series"].items()):
            points = sorted((x, y) for x, y in points if y is not None and not math.isnan(y))
            if points:
                ax.plot(*zip(*points), styles.get(label, "-"), marker="o", label=label)
        if panel.get("vline") is not None:
            ax.axvline(panel["vline"], color="grey", linewidth=0.8, linestyle=":")
        if panel.get("xlog", True):
            ax.set_xscale("log")
        if panel.get("ylog", True):
            ax.set_yscale("log")
        ax.set_xlabel(panel["xlabel"])
        ax.set_ylabel(panel["ylabel"])
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=8)
    return save_figure(fig, path)
