"""Batch-1 inference benchmark: stock mmdet against ours, on images of mixed real sizes (see :mod:`.inference_loop`).

Rows (each in a process of its own, the same random weights and images):

    stock:fp32        mmdet + mmcv as installed (needs mmcv's compiled ops on a GPU)
    eager:fp32|bf16   ours, the plugin alone (mmdet's own predict)
    graph:fp32|bf16   ours with ``deform_plugin.apis.enable_fast_inference`` (its default buckets and policy:
                      128 px feature buckets for Deformable-DETR and DINO, 32 px image buckets for the others)
    graph-image:...   the same with 32 px image buckets for every detector
    graph-canvas:...  image buckets with ``throughput_buckets`` (the test pipeline's canvases: more padding)
    graph-exact:...   without buckets (a graph per exact input shape)

For each config and size distribution the report gives ms per image after the warm-up images and over all images
(the first included), the ratio to the first row (stock), what the graphs did (captures, replays, eager calls,
borrowed calls, capture seconds, graph memory, padding) and how far each row's detections are from the eager fp32
row's (the largest difference of the top-5 scores; the share of images whose top detection agrees).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from deform_plugin.benchmarks.common import (
    init_weights_quietly,
    machine_info,
    machine_line,
    markdown_table,
    pyplot,
    save_figure,
    write_csv,
)
from deform_plugin.benchmarks.detector.inference_loop import DISTRIBUTIONS
from deform_plugin.benchmarks.detector.random_text_encoder import TEXT_ENCODER_CHOICES, TIMING_ONLY_LABEL
from deform_plugin.benchmarks.stock_process import stock_command

LOOP_SCRIPT = Path(__file__).with_name("inference_loop.py")
LOOP_MODULE = "deform_plugin.benchmarks.detector.inference_loop"
ROW_KINDS = ("stock", "eager", "graph", "graph-image", "graph-canvas", "graph-exact")
MODES = {"fp32": None, "bf16": "bfloat16", "fp16": "float16"}
DEFAULT_ROWS = ("stock:fp32", "eager:fp32", "graph:fp32", "eager:bf16", "graph:bf16")


def parse_row(text: str) -> tuple:
    kind, _, mode = text.partition(":")
    if kind not in ROW_KINDS or mode not in MODES:
        raise argparse.ArgumentTypeError(f"row {text!r} is not KIND:MODE with KIND in {', '.join(ROW_KINDS)} and "
                                         f"MODE in {', '.join(MODES)}")
    if kind == "stock" and mode != "fp32":
        raise argparse.ArgumentTypeError(f"row {text!r}: stock runs fp32 only (the baseline)")
    return kind, mode


def parse_image_range(text: str) -> Tuple[int, int]:
    first, sep, last = text.partition(":")
    try:
        span = (int(first), int(last)) if sep else (int(first), int(first))
    except ValueError:
        span = None
    if span is None or not 1 <= span[0] <= span[1]:
        raise argparse.ArgumentTypeError(f"--profile {text!r} is not FIRST:LAST with 1 <= FIRST <= LAST")
    return span


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configs", nargs="+", help="detector configs (DETR family or Mask2Former)")
    parser.add_argument("--rows", nargs="+", default=list(DEFAULT_ROWS), metavar="KIND:MODE",
                        help=f"rows, the first the baseline (default: {' '.join(DEFAULT_ROWS)})")
    parser.add_argument("--sizes", nargs="+", default=["coco16", "distinct", "fixed"], choices=DISTRIBUTIONS,
                        help="size distributions (default: coco16 distinct fixed)")
    parser.add_argument("--images", type=int, default=64, help="images per distribution (default: 64)")
    parser.add_argument("--warmup", type=int, default=10, help="images left out of the steady figure (default: 10)")
    parser.add_argument("--device", default="cuda", help="device (default: cuda)")
    parser.add_argument("--seed", type=int, default=0, help="weights, images and sizes (default: 0)")
    parser.add_argument("--out-dir", default="bench_results/inference", help="JSON, CSV and PNG go here "
                        "(default: bench_results/inference)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per row (default: 900)")
    parser.add_argument("--phases", type=int, default=0, metavar="N",
                        help="after each row's timed loop, time its phases (pipeline, preprocess, forward, "
                             "postprocess) over its last N images, the device synchronised between phases "
                             "(default: 0, off)")
    parser.add_argument("--profile", type=parse_image_range, metavar="FIRST:LAST",
                        help="profile each row's images FIRST-LAST (1-based, inclusive) with torch.profiler; the "
                             "operator tables go to OUT_DIR/profiles/ (the profiler slows those images: leave them "
                             "out of the figures you quote)")
    parser.add_argument("--cold-triton-cache", dest="warm_triton_cache", action="store_false",
                        help="do not compile the Triton kernels before the rows: the first row of each dtype then "
                             "compiles them in its first image (default: compiled first, as a second run finds them)")
    parser.add_argument("--text-encoder", choices=TEXT_ENCODER_CHOICES, default="auto",
                        help="Grounding-DINO's BERT: random (a random text encoder of its shape, for timing only), "
                             "real (bert-base-uncased's files, from the Hugging Face cache), or auto (random where "
                             "those files are missing)")
    policy = parser.add_argument_group("graph rows' policy and buckets (default: the library's)")
    policy.add_argument("--capture-after", type=int, help="a shape is captured at this call")
    policy.add_argument("--max-graphs", type=int, help="graphs kept at most")
    policy.add_argument("--max-graph-memory-mb", type=float, help="memory the graphs may add, MiB")
    policy.add_argument("--size-divisor", type=int, help="bucket step in pixels")
    policy.add_argument("--borrow-max-pixels", type=float, help="largest pixel ratio of a borrowed graph")
    policy.add_argument("--own-graph-after", type=int, help="call at which a borrowing bucket gets its own graph")
    return parser


def _overrides(args) -> Dict[str, dict]:
    policy = {k: getattr(args, k) for k in ("capture_after", "max_graphs", "max_graph_memory_mb")
              if getattr(args, k) is not None}
    buckets = {k: getattr(args, k) for k in ("size_divisor", "borrow_max_pixels", "own_graph_after")
               if getattr(args, k) is not None}
    return dict(policy=policy, buckets=buckets)


def config_with_text_encoder(config: str, choice: str, scratch: Path) -> str:
    """``config``, or where :func:`~.random_text_encoder.random_text_encoder_override` puts the random text encoder
    (for timing only) in place of its BERT, that config written to ``scratch``: every row reads the same."""
    from mmengine.config import Config

    from .random_text_encoder import use_random_text_encoder
    cfg = Config.fromfile(config, import_custom_modules=False)
    if not use_random_text_encoder(cfg, choice):
        return config
    path = scratch / f"{Path(config).stem}-random-text-encoder.py"
    cfg.dump(str(path))
    print(f"{Path(config).stem}: its language model is a {TIMING_ONLY_LABEL}", flush=True)
    return str(path)


def save_random_weights(config: str, path: Path, seed: int):
    """One set of random weights for every row (ours and stock name their parameters alike); returns the model.

    ``init_detector(config, None)`` builds the model without ``init_weights()``, which leaves DETR's
    ``level_embed`` as uninitialised memory (zeros in most processes, garbage, NaN included, in some): the weights
    would then differ from run to run. ``init_weights()`` gives every parameter the model's own initialisation
    (``init_detector`` has dropped the backbone's pretrained ``init_cfg``: nothing is downloaded)."""
    import torch
    from mmdet.apis import init_detector

    import deform_plugin  # noqa: F401  (before mmdet: the mmcv-lite stand-in)
    torch.manual_seed(seed)
    model = init_detector(config, None, device="cpu")
    init_weights_quietly(model)
    # The classes go along, so that mmdet's init_detector need not build the config's dataset to find them.
    torch.save({"state_dict": model.state_dict(), "meta": {"dataset_meta": dict(model.dataset_meta)}}, path)
    return model


def compile_triton_kernels(model, dtypes: Sequence[str]) -> Optional[float]:
    """Every Triton MSDA variant ``model`` launches in ``dtypes``, compiled into the on-disk cache by parallel
    processes before any row is timed (as a user's second run finds them); the wall seconds, None off CUDA."""
    import torch

    from deform_plugin.engine.triton_precompile import model_msda_variants
    from deform_plugin.ops.msda.precompile import precompile_in_background
    if not torch.cuda.is_available():
        return None
    started = time.perf_counter()
    for process in precompile_in_background(model_msda_variants(model, dtypes), backward=False):
        process.wait()
    return time.perf_counter() - started


def run_row(spec: dict, scratch: Path, timeout: float) -> dict:
    spec_path = scratch / f"{spec['name']}.spec.json"
    spec_path.write_text(json.dumps(spec))
    started = time.perf_counter()
    # Stock rows in a process that never imports deform_plugin; ours import it while their model is built.
    loop = stock_command(LOOP_MODULE) if spec["row"] == "stock" else [str(LOOP_SCRIPT)]
    completed = subprocess.run([sys.executable, *loop, str(spec_path)], capture_output=True, text=True,
                               timeout=timeout)
    wall = time.perf_counter() - started
    if completed.returncode != 0:
        tail = "\n".join((completed.stdout + completed.stderr).strip().splitlines()[-15:])
        return dict(error=f"exit {completed.returncode}: {tail}", wall_seconds=wall)
    result = json.loads(Path(spec["out"]).read_text())
    result["wall_seconds"] = wall
    return result


def compare_detections(ours: Sequence[dict], reference: Sequence[dict]) -> dict:
    """The largest top-5 score difference, and the share of images whose top detection has the reference's label
    and a box within 1 px."""
    score_diff, agree = 0.0, 0
    for a, b in zip(ours, reference):
        n = min(len(a["scores"]), len(b["scores"]))
        if n:
            score_diff = max(score_diff, max(abs(x - y) for x, y in zip(a["scores"][:n], b["scores"][:n])))
            agree += int(a["labels"][0] == b["labels"][0]
                         and max(abs(x - y) for x, y in zip(a["bboxes"][0], b["bboxes"][0])) <= 1.0)
    return dict(max_score_diff=score_diff, top1_agreement=agree / max(len(ours), 1))


def summarize(result: dict, warmup: int) -> dict:
    seconds = result["seconds"]
    steady = seconds[warmup:] or seconds
    return dict(steady_ms=1e3 * statistics.mean(steady), all_ms=1e3 * statistics.mean(seconds),
                first_ms=1e3 * seconds[0], peak_memory_mb=result.get("peak_memory_mb"),
                nonfinite_images=sum(not d["finite"] for d in result["detections"]))


CALL_KINDS = ("eager", "capture", "replay", "borrow", "partial")


def _kind_cell(record: dict, kind: str) -> str:
    times = [s for s, k in zip(record["seconds"], record["call_kinds"]) if k == kind]
    return f"{len(times)} x {1e3 * statistics.mean(times):.1f}" if times else "0"


def _cudnn_api(record: dict) -> str:
    from deform_plugin.conv_planning import selects_v7_api
    if "cudnn_v8_api_disabled" not in record:
        return "-"
    return "v7" if selects_v7_api(record["cudnn_v8_api_disabled"]) else "v8"


def _fmt(value, spec=".1f") -> str:
    return "-" if value is None else format(value, spec)


def report(records: List[dict], info: dict, out_dir: Path) -> str:
    header = ["config", "sizes", "row", "ms/img steady", "ms/img all", "steady vs first row", "all vs first row",
              "first img ms", "graphs", "replays/eager/borrowed", "capture s", "graph MiB", "padding", "peak MiB",
              "max score diff vs eager:fp32", "top-1 agrees with stock", "images with NaN/inf", "cuDNN API"]
    rows = []
    for r in records:
        if "error" in r:
            rows.append([r["config"], r["sizes"], r["row"], "error"] + [""] * (len(header) - 4))
            continue
        g = r.get("graphs") or {}
        rows.append([r["config"], r["sizes"], r["row"], _fmt(r["steady_ms"]), _fmt(r["all_ms"]),
                     _fmt(r.get("steady_speedup"), ".2f") + "x", _fmt(r.get("all_speedup"), ".2f") + "x",
                     _fmt(r["first_ms"], ".0f"), g.get("graphs", "-"),
                     f"{g['replays']}/{g['eager_calls']}/{g['borrowed_calls']}" if g else "-",
                     _fmt(g.get("capture_seconds"), ".2f"), _fmt(g.get("graph_memory_mb"), ".0f"),
                     f"{100 * g['padded_pixels']:.1f}%" if g else "-", _fmt(r.get("peak_memory_mb"), ".0f"),
                     _fmt(r.get("max_score_diff"), ".2e"), _fmt(r.get("top1_vs_stock"), ".2f"),
                     r["nonfinite_images"], _cudnn_api(r)])
    text = machine_line(info) + "\n\n" + markdown_table(header, rows)
    for config in sorted({r["config"] for r in records if r.get("text_encoder")}):
        text += (f"\n\n{config} ran on a {TIMING_ONLY_LABEL} (BERT-base's shape, random weights, a generated "
                 "vocabulary): its detections mean nothing.")
    phased = [r for r in records if r.get("phases_ms")]
    if phased:
        from deform_plugin.benchmarks.detector.inference_phases import PHASES
        text += ("\n\nms per image by phase (the device synchronised between phases; the last images of each "
                 "row):\n\n" + markdown_table(["config", "sizes", "row", *PHASES, "total"],
                                               [[r["config"], r["sizes"], r["row"]]
                                                + [_fmt(r["phases_ms"][p], ".2f") for p in (*PHASES, "total")]
                                                for r in phased]))
    kinded = [r for r in records if r.get("call_kinds")]
    if kinded:
        text += ("\n\nGraph rows' calls by kind, over all images: count and mean ms per image (eager: a shape that "
                 "has not earned a graph; capture: the call that captured one, of any part; borrow: a larger "
                 "shape's graph; partial: the transformer replayed, the backbone eager at a new size):\n\n"
                 + markdown_table(["config", "sizes", "row", *CALL_KINDS],
                                  [[r["config"], r["sizes"], r["row"]] + [_kind_cell(r, kind) for kind in CALL_KINDS]
                                   for r in kinded]))
    (out_dir / "inference.md").write_text(text + "\n")
    write_csv(out_dir / "inference.csv", [{k: v for k, v in r.items() if k not in ("seconds", "detections", "call_kinds")}
                                          for r in records])
    plot(records, out_dir / "inference.png")
    return text


def plot(records: List[dict], path: Path) -> None:
    """ms per image along the image sequence, one panel per config and size distribution, one line per row."""
    panels = sorted({(r["config"], r["sizes"]) for r in records if "seconds" in r})
    if not panels:
        return
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, (config, sizes) in zip(axes[0], panels):
        for r in records:
            if r["config"] == config and r["sizes"] == sizes and "seconds" in r:
                ax.plot([1e3 * s for s in r["seconds"]], label=r["row"], linewidth=1)
        ax.set_yscale("log")
        ax.set_xlabel("image")
        ax.set_ylabel("ms (inference_detector, synchronised)")
        ax.set_title(f"{config}, {sizes}", fontsize=8)
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
    save_figure(fig, path)


def main(argv: Optional[Sequence[str]] = None, description: Optional[str] = None) -> int:
    parser = build_parser()
    if description:
        parser.description = description
    args = parser.parse_args(argv)
    try:
        rows = [parse_row(text) for text in args.rows]
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))
    for config in args.configs:
        if not Path(config).is_file():
            parser.error(f"config {config!r} does not exist")
    if args.images <= args.warmup:
        parser.error(f"--images ({args.images}) must exceed --warmup ({args.warmup})")
    if args.profile is not None and args.profile[1] > args.images:
        parser.error(f"--profile {args.profile[0]}:{args.profile[1]} goes past --images {args.images}")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    import torch
    info = machine_info(torch.device(args.device))
    overrides = _overrides(args)
    records = []
    with tempfile.TemporaryDirectory(prefix="deform_plugin_inference_") as scratch_dir:
        scratch = Path(scratch_dir)
        for config in args.configs:
            name = Path(config).stem
            plain = config
            config = config_with_text_encoder(config, args.text_encoder, scratch)
            weights = scratch / f"{name}.pth"
            model = save_random_weights(config, weights, args.seed)
            dtypes = sorted({MODES[mode] or "float32" for kind, mode in rows if kind != "stock"})
            if args.warm_triton_cache:
                seconds = compile_triton_kernels(model, dtypes)
                if seconds is not None:
                    print(f"{name}: Triton kernels of {', '.join(dtypes)} compiled in {seconds:.1f} s (parallel "
                          "processes)", flush=True)
            del model
            for sizes in args.sizes:
                group = []
                for kind, mode in rows:
                    label = f"{kind}:{mode}"
                    spec = dict(name=f"{name}-{sizes}-{kind}-{mode}", row=kind, config=config, weights=str(weights),
                                distribution=sizes, count=args.images, seed=args.seed, device=args.device,
                                amp_dtype=MODES[mode], out=str(scratch / f"{name}-{sizes}-{kind}-{mode}.json"),
                                phase_images=min(args.phases, args.images),
                                profile=None if args.profile is None else [i - 1 for i in args.profile],
                                **(overrides if kind.startswith("graph") else {}))
                    result = run_row(spec, scratch, args.timeout)
                    if result.get("profile"):
                        profiles = out_dir / "profiles"
                        profiles.mkdir(exist_ok=True)
                        (profiles / f"{spec['name']}.txt").write_text(result.pop("profile"))
                    record = dict(config=name, sizes=sizes, row=label, **result,
                                  text_encoder=TIMING_ONLY_LABEL if config != plain else None)
                    if "error" not in result:
                        record.update(summarize(result, args.warmup))
                    print(f"{name} {sizes} {label}: "
                          + (record["error"] if "error" in record else
                             f"{record['steady_ms']:.1f} ms/img steady, {record['all_ms']:.1f} all"), flush=True)
                    group.append(record)
                _relate(group)
                records.extend(group)
    (out_dir / "inference.json").write_text(json.dumps(dict(machine=info, settings=vars(args), records=records)))
    print(report(records, info, out_dir))
    return 0 if all("error" not in r for r in records) else 1


def _relate(group: List[dict]) -> None:
    """Speed-ups against the group's first row; detections against its eager fp32 row and its stock row."""
    ok = [r for r in group if "error" not in r]
    if not ok:
        return
    base = group[0] if "error" not in group[0] else None
    eager = next((r for r in ok if r["row"] == "eager:fp32"), None)
    stock = next((r for r in ok if r["row"].startswith("stock")), None)
    for r in ok:
        if base is not None:
            r["steady_speedup"] = base["steady_ms"] / r["steady_ms"]
            r["all_speedup"] = base["all_ms"] / r["all_ms"]
        if eager is not None:
            r["max_score_diff"] = compare_detections(r["detections"], eager["detections"])["max_score_diff"]
        if stock is not None:
            r["top1_vs_stock"] = compare_detections(r["detections"], stock["detections"])["top1_agreement"]


if __name__ == "__main__":
    sys.exit(main())
