"""The NaN hunt: batch-1 inference of one detector in many fresh processes, each process's detections against the
plain model's, to catch a result that differs (or holds NaN) in some runs and not in others.

Seen once: DINO with ``enable_fast_inference``, fp32, 480x640, random weights: in one of two runs the first image's
top-20 scores held a NaN. A value that changes from process to process on the same weights and images points at
memory read before it is written (its content is whatever the previous owner left: it differs between processes)
or at a race. So every variant runs in ``--processes`` fresh processes (:mod:`.inference_loop`'s rows, the same
saved random weights and images; ``--jobs`` at once: the processes also crowd one another, as runs do), and the
report gives, per variant:

- processes whose first image (or any image) held a non-finite score or box coordinate;
- the largest difference of the first image's top-20 scores from the plain model's (``eager:fp32``, the plugin
  without ``enable_fast_inference``, one process of its own): graph variants pad to their bucket, which moves
  scores slightly (docs/results.md), so this is a scale, not a pass mark;
- how far the first image's top-20 boxes are from the plain model's (each box from its nearest reference box);
- the spread within the variant: the largest difference of any process's top-20 scores, on any of its images, from
  the variant's first process. On the same weights, images and kernels this is 0 (or at the level of atomics' order,
  which inference does not use): anything else is the nondeterminism the hunt is after.

The saved weights come from :func:`.inference.save_random_weights` (the model's own ``init_weights()``); the report
says whether any parameter is non-finite. A variant is ``KIND:MODE[:poison]``, KIND ``eager`` (the plugin,
mmdet's predict) or ``graph`` (with ``enable_fast_inference``), MODE ``fp32`` or ``bf16`` (autocast). ``:poison``
fills every uninitialised tensor PyTorch allocates with NaN (:func:`.inference_loop.poison_uninitialized_memory`): a
read before write then shows as NaN in every process rather than in some. Writes ``nan_hunt.md`` and
``nan_hunt.json`` (every process's detections) to ``--out-dir``; exit status 1 where a process failed, held a
non-finite value or spread beyond ``--spread-limit``, or where a saved parameter is non-finite.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from deform_plugin.benchmarks.common import REPO_ROOT, machine_info, machine_line, markdown_table
from deform_plugin.benchmarks.detector.inference import MODES, compile_triton_kernels, run_row, save_random_weights
from deform_plugin.benchmarks.detector.inference_loop import DISTRIBUTIONS

DEFAULT_CONFIG = REPO_ROOT / "configs" / "dino" / "dino-4scale_r50_8xb2-12e_coco_deform-plugin.py"
DEFAULT_VARIANTS = ("eager:fp32", "graph:fp32", "eager:bf16", "graph:bf16", "graph:fp32:poison")
REFERENCE = "eager:fp32"
KINDS = ("eager", "graph")
TOP_K = 20
# Within one variant, processes on the same weights and images run the same kernels on the same values.
DEFAULT_SPREAD_LIMIT = 1e-5


def parse_variant(text: str) -> dict:
    parts = text.split(":")
    if len(parts) not in (2, 3) or parts[0] not in KINDS or parts[1] not in ("fp32", "bf16") or (
            len(parts) == 3 and parts[2] != "poison"):
        raise argparse.ArgumentTypeError(f"variant {text!r} is not KIND:MODE[:poison] with KIND in "
                                         f"{', '.join(KINDS)} and MODE fp32 or bf16")
    return dict(name=text, row=parts[0], mode=parts[1], poison=len(parts) == 3)


def max_abs_diff(a: Sequence[float], b: Sequence[float]) -> float:
    """The largest ``|a_i - b_i|`` over the common length; NaN where either side holds a NaN (Python's ``max``
    would drop it depending on its position)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0.0
    diffs = [abs(x - y) for x, y in zip(a[:n], b[:n])]
    return math.nan if any(math.isnan(d) for d in diffs) else max(diffs)


def nearest_box_distance(boxes: Sequence[Sequence[float]], reference: Sequence[Sequence[float]]) -> float:
    """The largest distance (pixels, L-inf over the four coordinates) from a box to its nearest reference box: top
    boxes compared without their order, which near-tied scores may swap. NaN where a coordinate is NaN."""
    if not boxes or not reference:
        return 0.0
    distances = []
    for box in boxes:
        to_each = [max(abs(a - b) for a, b in zip(box, other)) for other in reference]
        if any(math.isnan(a) for a in box) or any(math.isnan(d) for d in to_each):
            return math.nan
        distances.append(min(to_each))
    return max(distances)


def _spread(process: dict, first: dict) -> float:
    """The largest score difference of any image's top detections from the same image in ``first``."""
    return _nanmax([max_abs_diff(a["scores"], b["scores"])
                    for a, b in zip(process["detections"], first["detections"])]) or 0.0


def _nanmax(values: Sequence[float]) -> Optional[float]:
    values = list(values)
    if not values:
        return None
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def summarize_variant(name: str, processes: List[dict], reference: Optional[dict]) -> dict:
    """One variant's row from its processes' results (``detections`` per image, or ``error``)."""
    ok = [p for p in processes if "error" not in p]
    first_nonfinite = [p["detections"][0]["nonfinite"] for p in ok]
    any_nonfinite = [sum(d["nonfinite"] for d in p["detections"]) for p in ok]
    compared = reference is not None and "error" not in reference
    vs_reference = ([max_abs_diff(p["detections"][0]["scores"], reference["detections"][0]["scores"]) for p in ok]
                    if compared else [])
    boxes_vs_reference = ([nearest_box_distance(p["detections"][0]["bboxes"], reference["detections"][0]["bboxes"])
                           for p in ok] if compared else [])
    spread = [_spread(p, ok[0]) for p in ok[1:]]
    return dict(variant=name, processes=len(processes), failed=len(processes) - len(ok),
                first_image_nonfinite_processes=sum(n > 0 for n in first_nonfinite),
                first_image_nonfinite_counts=first_nonfinite,
                any_image_nonfinite_processes=sum(n > 0 for n in any_nonfinite),
                max_diff_vs_reference=_nanmax(vs_reference), min_diff_vs_reference=(
                    None if not vs_reference else math.nan if any(map(math.isnan, vs_reference))
                    else min(vs_reference)),
                max_box_distance_vs_reference=_nanmax(boxes_vs_reference),
                spread=_nanmax(spread) if spread else 0.0 if ok else None,
                graphs=[p.get("graphs") for p in ok][:1],
                errors=[p["error"] for p in processes if "error" in p][:3])


def _fmt(value, spec=".2e") -> str:
    if value is None:
        return "-"
    return "NaN" if isinstance(value, float) and math.isnan(value) else format(value, spec)


def report(rows: List[dict], info: dict, settings: dict, out_dir: Path) -> str:
    header = ["variant", "processes (failed)", "first image with NaN/inf", "any image with NaN/inf",
              f"first-image top-{TOP_K} score diff vs {REFERENCE} (min-max)",
              "first-image top boxes: farthest from a reference box (px)", "spread within variant (all images)",
              "graphs/replays/eager (first process)"]
    cells = []
    for row in rows:
        graphs = row["graphs"][0] if row["graphs"] and row["graphs"][0] else None
        cells.append([row["variant"], f"{row['processes']} ({row['failed']})",
                      f"{row['first_image_nonfinite_processes']}/{row['processes'] - row['failed']}",
                      f"{row['any_image_nonfinite_processes']}/{row['processes'] - row['failed']}",
                      f"{_fmt(row['min_diff_vs_reference'])} - {_fmt(row['max_diff_vs_reference'])}",
                      _fmt(row["max_box_distance_vs_reference"], ".3g"), _fmt(row["spread"]),
                      f"{graphs['graphs']}/{graphs['replays']}/{graphs['eager_calls']}" if graphs else "-"])
    lines = [machine_line(info), "",
             f"{settings['config']}, {settings['images']} images ({settings['sizes']}) per process, "
             f"{settings['processes']} processes per variant, {settings['jobs']} at once, seed {settings['seed']}; "
             "saved random weights: " + (f"non-finite parameters {', '.join(settings['nonfinite_parameters'])}"
                                         if settings.get("nonfinite_parameters") else "all finite"), "",
             markdown_table(header, cells)]
    errors = [f"- {row['variant']}: {error}" for row in rows for error in row["errors"]]
    if errors:
        lines += ["", "Failed processes (last lines):", *errors]
    text = "\n".join(lines) + "\n"
    (out_dir / "nan_hunt.md").write_text(text)
    return text


def write_outputs(jobs: Sequence[tuple], results: Dict[int, dict], args, info: dict, settings: dict,
                  out_dir: Path):
    """The rows of the processes finished so far, written to nan_hunt.md and nan_hunt.json; ``(rows, text)``."""
    reference = results.get(0)
    by_variant: Dict[str, List[dict]] = {v["name"]: [] for v in args.variants}
    for number, result in sorted(results.items()):
        if number > 0:
            by_variant[jobs[number][0]["name"]].append(result)
    rows = [summarize_variant(REFERENCE + " (reference)", [reference] if reference else [], reference)]
    rows += [summarize_variant(name, processes, reference) for name, processes in by_variant.items()]
    text = report(rows, info, settings, out_dir)
    (out_dir / "nan_hunt.json").write_text(json.dumps(dict(
        machine=info, settings=dict(settings, spread_limit=args.spread_limit, pending=len(jobs) - len(results)),
        rows=rows, reference=reference, processes=by_variant)))
    return rows, text


def build_parser(description: Optional[str] = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description or __doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", default=str(DEFAULT_CONFIG), help="detector config (default: DINO R50)")
    parser.add_argument("--variants", nargs="+", type=parse_variant, default=[parse_variant(v) for v in
                                                                             DEFAULT_VARIANTS],
                        metavar="KIND:MODE[:poison]", help=f"default: {' '.join(DEFAULT_VARIANTS)}")
    parser.add_argument("--processes", type=int, default=8, help="fresh processes per variant (default: 8)")
    parser.add_argument("--jobs", type=int, default=4, help="processes at once (default: 4)")
    parser.add_argument("--images", type=int, default=4, help="images per process, the first 480x640 (default: 4)")
    parser.add_argument("--sizes", default="fixed", choices=DISTRIBUTIONS,
                        help="image sizes after the first (default: fixed, all 480x640: the graph rows then run "
                             "eagerly, capture and replay; coco16 starts with 480x640 too)")
    parser.add_argument("--device", default="cuda", help="device (default: cuda)")
    parser.add_argument("--seed", type=int, default=0, help="weights and images (default: 0)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per process (default: 300)")
    parser.add_argument("--deadline", type=float, help="seconds after which no new process starts")
    parser.add_argument("--spread-limit", type=float, default=DEFAULT_SPREAD_LIMIT,
                        help=f"largest spread within a variant that passes (default: {DEFAULT_SPREAD_LIMIT:g})")
    parser.add_argument("--cold-triton-cache", dest="warm_triton_cache", action="store_false",
                        help="do not compile the Triton kernels before the processes")
    parser.add_argument("--out-dir", default="bench_results/nan_hunt", help="default: bench_results/nan_hunt")
    return parser


def main(argv: Optional[Sequence[str]] = None, description: Optional[str] = None) -> int:
    parser = build_parser(description)
    args = parser.parse_args(argv)
    if not Path(args.config).is_file():
        parser.error(f"config {args.config!r} does not exist")
    for name in ("processes", "jobs", "images"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    import torch
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    info = machine_info(torch.device(args.device))
    settings = dict(config=Path(args.config).name, images=args.images, sizes=args.sizes, processes=args.processes,
                    jobs=args.jobs, seed=args.seed)
    started = time.perf_counter()
    reference_variant = parse_variant(REFERENCE)
    with tempfile.TemporaryDirectory(prefix="deform_plugin_nan_hunt_") as scratch_dir:
        scratch = Path(scratch_dir)
        weights = scratch / "weights.pth"
        model = save_random_weights(args.config, weights, args.seed)
        # What every process loads: a non-finite parameter would put NaN in all of them.
        settings["nonfinite_parameters"] = sorted(
            name for name, tensor in model.state_dict().items()
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()))
        if args.warm_triton_cache:
            dtypes = sorted({MODES[v["mode"]] or "float32" for v in args.variants + [reference_variant]})
            seconds = compile_triton_kernels(model, dtypes)
            if seconds is not None:
                print(f"nan_hunt: Triton kernels of {', '.join(dtypes)} compiled in {seconds:.1f} s", flush=True)
        del model

        def spec(variant: dict, index: int) -> dict:
            name = f"{variant['name'].replace(':', '-')}-{index}"
            return dict(name=name, row=variant["row"], config=args.config, weights=str(weights),
                        distribution=args.sizes, count=args.images, seed=args.seed, device=args.device,
                        amp_dtype=MODES[variant["mode"]], top_k=TOP_K, poison=variant["poison"],
                        out=str(scratch / f"{name}.json"))

        jobs = [(reference_variant, "reference")] + [
            (variant, index) for index in range(args.processes) for variant in args.variants]
        results: Dict[int, dict] = {}
        lock = threading.Lock()

        def one(number: int) -> None:
            variant, index = jobs[number]
            if args.deadline is not None and time.perf_counter() - started > args.deadline:
                result = dict(error="not run (deadline)")
            else:
                result = run_row(spec(variant, index), scratch, args.timeout)
            state = result["error"].splitlines()[0] if "error" in result else (
                f"first image non-finite {result['detections'][0]['nonfinite']}, top score "
                f"{result['detections'][0]['scores'][:1]}")
            with lock:
                results[number] = result
                print(f"nan_hunt: {variant['name']} process {index}: {state}", flush=True)
                write_outputs(jobs, results, args, info, settings, out_dir)

        # The reference runs beside the others; the report (rewritten after every process) compares with it once
        # it is in.
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            list(pool.map(one, range(len(jobs))))
    rows, text = write_outputs(jobs, results, args, info, settings, out_dir)
    print(text)
    bad = [row for row in rows if row["failed"] or row["any_image_nonfinite_processes"]
           or row["spread"] is None or not row["spread"] <= args.spread_limit]
    return 1 if bad or settings["nonfinite_parameters"] else 0


if __name__ == "__main__":
    sys.exit(main())
