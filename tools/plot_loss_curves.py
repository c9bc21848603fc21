"""Plot the training loss of several mmengine runs on one chart (e.g. fp32 against bf16 AMP).

    python tools/plot_loss_curves.py WORK_DIR[=LABEL] [WORK_DIR[=LABEL] ...] --out docs/loss_fp32_vs_bf16.png

Each WORK_DIR is a ``tools/train.py --work-dir``; the newest ``*/vis_data/scalars.json`` under it is read. Prints
a table of the loss at a few iterations and the largest relative gap between the curves (smoothed), and writes
the PNG.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Tuple

from deform_plugin.benchmarks.detector.loss_curves import read_losses, smooth


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="WORK_DIR or WORK_DIR=LABEL")
    parser.add_argument("--out", required=True, help="PNG path")
    parser.add_argument("--key", default="loss", help="scalar to plot (default: loss)")
    parser.add_argument("--title", default="training loss")
    args = parser.parse_args(argv)

    curves: Dict[str, List[Tuple[int, float]]] = {}
    for run in args.runs:
        work_dir, _, label = run.partition("=")
        try:
            curves[label or os.path.basename(os.path.normpath(work_dir))] = read_losses(work_dir, args.key)
        except (FileNotFoundError, ValueError) as error:  # a path or key the user gave: one line, as argparse does
            print(f"error: {error}", file=sys.stderr)
            return 2

    labels = list(curves)
    iters = sorted(set.intersection(*(set(i for i, _ in c) for c in curves.values())))
    smoothed = {label: dict(zip([i for i, _ in curves[label]], smooth([v for _, v in curves[label]])))
                for label in labels}
    print(f"{'iter':>6} " + " ".join(f"{label:>14}" for label in labels))
    for it in iters[::max(1, len(iters) // 8)] + ([iters[-1]] if iters else []):
        print(f"{it:>6} " + " ".join(f"{dict(curves[label])[it]:>14.4f}" for label in labels))
    if len(labels) > 1 and iters:
        base = labels[0]
        for other in labels[1:]:
            gap = max(abs(smoothed[other][i] - smoothed[base][i]) / abs(smoothed[base][i]) for i in iters)
            print(f"largest relative gap of smoothed {args.key}, {other} vs {base}: {gap:.3f}")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for label in labels:
        xs = [i for i, _ in curves[label]]
        ax.plot(xs, [v for _, v in curves[label]], alpha=0.3)
        ax.plot(xs, smooth([v for _, v in curves[label]]), label=f"{label} (smoothed)", color=ax.lines[-1].get_color())
    ax.set_xlabel("iteration")
    ax.set_ylabel(args.key)
    ax.set_title(args.title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
