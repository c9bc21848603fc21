"""Host time of a DETR step's matching pass: every decoder layer's (and the encoder's) cost matrices, their copy to
the host and the assignments (``deform_plugin``'s batched matching,
:func:`deform_plugin.integration.mmdet_fast_paths.batched_matching.solve_ahead`).

In a replayed training step the network costs one graph launch and the eager tail decides the step's host time;
the matching pass is a fixed part of that tail. Per case it reports the median (20th / 80th percentiles) of:

- ``launch``: host time from the pass's start until its cost terms are launched (the kernels the host queues);
- ``pass``: the whole pass, including the wait for the device (the copy syncs), the copy and scipy's solves.

Cases are synthetic predictions (random logits and boxes) shaped as the fast configs' heads produce them, two images
with the given gt counts, the DETR configs' assigner (focal, box-L1 in cx-cy-w-h, GIoU costs).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from deform_plugin.benchmarks.common import machine_info, machine_line, markdown_table, summarize_ms

# (decoder layers, queries, encoder proposals matched against the same gts (DINO) or 0)
CASES: Dict[str, tuple] = {"dino": (6, 900, 900), "deformable-detr": (6, 300, 0)}
IMAGE_SHAPES = ((800, 1100), (760, 1216))


def make_case(name: str, device: torch.device, num_gts: Sequence[int] = (7, 13), num_classes: int = 80,
              scale: float = 1.0, seed: int = 0):
    """``(prediction_sets, batch_gt_instances, batch_img_metas)`` of one step; ``scale`` shrinks the query counts
    (tests)."""
    from mmengine.structures import InstanceData
    layers, queries, proposals = CASES[name]
    queries, proposals = max(1, int(queries * scale)), int(proposals * scale)
    generator = torch.Generator().manual_seed(seed)
    batch = len(num_gts)

    def predictions(*leading):
        scores = torch.randn(*leading, batch, queries, num_classes, generator=generator)
        boxes = torch.rand(*leading, batch, queries, 4, generator=generator) * 0.5 + 0.1
        return scores.to(device), boxes.to(device)
    sets = [predictions(layers)]
    if proposals:
        sets.append(predictions())
    gts, metas = [], []
    for count, (height, width) in zip(num_gts, IMAGE_SHAPES * batch):
        corner = torch.rand(count, 2, generator=generator) * torch.tensor([width, height]) * 0.7
        size = 20 + torch.rand(count, 2, generator=generator) * 150
        gts.append(InstanceData(bboxes=torch.cat([corner, corner + size], 1).to(device),
                                labels=torch.randint(0, num_classes, (count,), generator=generator).to(device)))
        metas.append(dict(img_shape=(height, width)))
    return sets, gts, metas


def detr_assigner():
    from mmdet.models.task_modules.assigners import HungarianAssigner
    return HungarianAssigner(match_costs=[dict(type="FocalLossCost", weight=2.0),
                                          dict(type="BBoxL1Cost", weight=5.0, box_format="xywh"),
                                          dict(type="IoUCost", iou_mode="giou", weight=2.0)])


def time_pass(assigner, case, device: torch.device, warmup: int, repeats: int) -> dict:
    """Launch and whole-pass samples of :func:`solve_ahead` (timed as its two halves) on one case."""
    from deform_plugin.integration.mmdet_fast_paths.batched_matching import launch_costs, solve_launched_costs
    launches, passes = [], []
    for index in range(warmup + repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        costs = launch_costs(assigner, *case)
        launched = time.perf_counter()
        solve_launched_costs(costs)
        ended = time.perf_counter()
        if index >= warmup:
            launches.append(launched - started)
            passes.append(ended - started)
    return dict(launch=summarize_ms(launches), whole=summarize_ms(passes))


def run(cases: Sequence[str], device: torch.device, num_gts: Sequence[int], warmup: int, repeats: int,
        scale: float = 1.0) -> List[dict]:
    import deform_plugin  # noqa: F401  (mmcv-lite stand-in where needed)
    assigner = detr_assigner()
    rows = []
    for name in cases:
        timing = time_pass(assigner, make_case(name, device, num_gts, scale=scale), device, warmup, repeats)
        layers, queries, proposals = CASES[name]
        rows.append(dict(case=name, rows_per_image=int(layers * queries * scale) + int(proposals * scale),
                         gts=list(num_gts), launch_ms=timing["launch"], pass_ms=timing["whole"]))
    return rows


def _cell(stats: dict) -> str:
    return f"{stats['median_ms']:.2f} ({stats['p20_ms']:.2f} / {stats['p80_ms']:.2f})"


def report(rows: Sequence[dict], info: dict) -> str:
    table = markdown_table(["case", "cost rows per image", "gts per image", "launch ms", "whole pass ms"],
                           [[r["case"], r["rows_per_image"], ", ".join(map(str, r["gts"])), _cell(r["launch_ms"]),
                             _cell(r["pass_ms"])] for r in rows])
    return f"{machine_line(info)}\n\n{table}\n\nmedian (20th / 80th percentile) over the timed repeats"


def main(argv: Optional[Sequence[str]] = None, description: str = __doc__) -> int:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--gts", nargs="+", type=int, default=[7, 13], help="gts per image (one number per image)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--scale", type=float, default=1.0, help="shrink the query counts (quick checks)")
    parser.add_argument("--out", default=None, help="also write matching_pass.json and matching_pass.md here")
    args = parser.parse_args(argv)
    if args.warmup < 0 or args.repeats < 1 or not 0 < args.scale <= 1 or min(args.gts) < 0:
        parser.error(f"need --warmup >= 0, --repeats >= 1, 0 < --scale <= 1 and --gts >= 0; got {args.warmup}, "
                     f"{args.repeats}, {args.scale}, {args.gts}")
    device = torch.device(args.device)
    rows = run(args.cases, device, args.gts, args.warmup, args.repeats, args.scale)
    info = machine_info(device)
    text = report(rows, info)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "matching_pass.md").write_text(text + "\n")
        (out / "matching_pass.json").write_text(json.dumps(dict(machine=info, rows=rows), indent=1))
    return 0
