"""Benchmark of deformable SDPA: the PyTorch baseline (grid_sample, then attention) against the fused Triton kernels.

Sweeps the image size at the seed's configuration (B=2, V=8, S=32, H=16, D=32; 14x14 is the seed's own point) and
reports latency (:func:`deform_plugin.benchmarks.common.do_bench`: median, 20th and 80th percentiles) and peak
memory for the forward, the backward and forward+backward, with the speedup and memory ratio against the baseline
timed in the same run, and the Triton forward's relative error against float64 (norm-based:
:func:`deform_plugin.benchmarks.common.relative_error`).

Writes ``DIR/bench_deform_sdpa.csv`` (rows appended) and ``DIR/latency_<dtype>.png``, ``DIR/memory_<dtype>.png``.
Peak memory is the largest allocation above what the inputs already hold, during one call.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import List, Optional

import torch

from deform_plugin.benchmarks.common import (do_bench, machine_info, machine_line, markdown_table, peak_extra_memory_mb,
                                             plot_lines, relative_error, write_csv)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
BACKENDS = ("pytorch", "triton")
MODES = ("fwd", "bwd", "fwd+bwd")
SEED_SIZE = 14


def build_parser(description: Optional[str] = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description or __doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the CSV and the PNG plots")
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 12, 14, 16, 20, 24, 28, 32],
                        help="square image sizes (width = height) to sweep")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--views", type=int, default=8)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--smoke-cpu", action="store_true",
                        help="check the tool itself on a CPU under the Triton interpreter (tiny sizes, no timing "
                             "worth reading, no memory numbers)")
    parser.add_argument("--no-coords-grad", action="store_true",
                        help="leave coords out of the backward (the seed's op has no coordinate gradient)")
    return parser


def make_inputs(args, size, dtype, device, requires_grad, seed=0):
    generator = torch.Generator(device=device).manual_seed(seed)
    pixels = size * size
    shape = (args.batch, args.views, args.heads, pixels, args.head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, generator=generator) for _ in range(3))
    coords = torch.rand(args.batch, args.views, pixels, args.views, args.samples, 2, device=device, dtype=dtype,
                        generator=generator)
    for tensor in (q, k, v):
        tensor.requires_grad_(requires_grad)
    coords.requires_grad_(requires_grad and not args.no_coords_grad)
    return q, k, v, coords


def runner(mode, backend, inputs, size):
    """A no-argument callable that runs one mode, with everything it needs already computed."""
    from deform_plugin.ops import deform_sdpa

    grad_inputs = [t for t in inputs if t.requires_grad]

    def forward():
        return deform_sdpa(*inputs, size, size, backend=backend)

    if mode == "fwd":
        def run():
            with torch.no_grad():
                return forward()
        return run
    grad_out = torch.randn_like(inputs[0])
    if mode == "fwd+bwd":
        return lambda: torch.autograd.grad(forward(), grad_inputs, grad_out)
    out = forward()  # mode "bwd": the graph is built once and replayed
    return lambda: torch.autograd.grad(out, grad_inputs, grad_out, retain_graph=True)


def check_against_float64(args, size, dtype, device) -> float:
    """Relative error of the Triton forward against the float64 reference (NaN where that would not fit)."""
    from deform_plugin.ops import deform_sdpa

    if device.type == "cuda":
        # The float64 baseline holds the sampled keys and values, stacked and permuted (about three copies).
        sampled_bytes = 2 * args.batch * args.views * args.heads * size * size * args.views * args.samples \
            * args.head_dim * 8
        if 3 * sampled_bytes > 0.6 * torch.cuda.get_device_properties(device).total_memory:
            return float("nan")
    q, k, v, coords = make_inputs(args, size, dtype, device, requires_grad=False, seed=1)
    try:
        expected = deform_sdpa(q.double(), k.double(), v.double(), coords.double(), size, size, backend="pytorch")
    except torch.cuda.OutOfMemoryError:
        return float("nan")
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return relative_error(deform_sdpa(q, k, v, coords, size, size, backend="triton"), expected)


def bench_one(args, mode, backend, size, dtype, device):
    """(median, p20, p80, peak MiB) of one mode and backend; NaN where it runs out of memory."""
    inputs = make_inputs(args, size, dtype, device, requires_grad=(mode != "fwd"))
    try:
        run = runner(mode, backend, inputs, size)
        median, low, high = do_bench(run, device)
        memory = peak_extra_memory_mb(run, device)
    except torch.cuda.OutOfMemoryError:
        median = low = high = memory = float("nan")
    del inputs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return median, low, high, memory


def draw(rows, out_dir: Path, dtype_name: str, device: str, args) -> List[str]:
    title = (f"deformable SDPA {dtype_name}, B={args.batch} V={args.views} S={args.samples} H={args.heads} "
             f"D={args.head_dim}\n{device}")
    styles = {f"{backend} {mode}": "--" if backend == "pytorch" else "-" for backend in BACKENDS for mode in MODES}
    paths = []
    for metric, label, filename in (("ms", "latency (ms, median)", f"latency_{dtype_name}.png"),
                                    ("mem_mb", "peak memory above inputs (MB)", f"memory_{dtype_name}.png")):
        series = {}
        for row in rows:
            series.setdefault(f"{row['backend']} {row['mode']}", []).append((row["size"], row[metric]))
        paths.append(plot_lines(out_dir / filename, [dict(series=series, styles=styles, vline=SEED_SIZE, xlog=False,
                                                          xlabel="image size (width = height)", ylabel=label)],
                                title=title, panel_size=(7, 4.5)))
    return paths


def results_table(rows) -> str:
    def seed_mark(row):
        return "<- seed config" if row["size"] == SEED_SIZE and row["backend"] == "triton" else ""
    return markdown_table(
        ["size", "mode", "backend", "ms", "p20", "p80", "mem MB", "speedup", "mem ratio", "err fp64", "note"],
        [[r["size"], r["mode"], r["backend"], f"{r['ms']:.3f}", f"{r['p20']:.3f}", f"{r['p80']:.3f}",
          f"{r['mem_mb']:.1f}", f"{r['speedup']:.1f}x", f"{r['mem_ratio']:.1f}x",
          _error_cell(r), seed_mark(r)] for r in rows], pad=True)


def _error_cell(row) -> str:
    if row["backend"] != "triton":
        return ""
    # NaN: the float64 baseline would not fit in the card's memory at this size, so the check did not run.
    return "not run (fp64 too big)" if math.isnan(row["err_fp64"]) else f"{row['err_fp64']:.2e}"


def print_targets(rows):
    """The goals at the seed's image size, where that size was swept."""
    seed_rows = {(row["mode"], row["backend"]): row for row in rows if row["size"] == SEED_SIZE}
    if ("fwd", "triton") not in seed_rows:
        return
    forward = seed_rows[("fwd", "triton")]
    print(f"seed config ({SEED_SIZE}x{SEED_SIZE}): forward {forward['speedup']:.1f}x faster (goal >= 10x), "
          f"{forward['mem_ratio']:.1f}x less peak memory (goal >= 10x), error vs float64 {forward['err_fp64']:.1e} "
          "(goal ~1e-5 in fp32)")
    if ("fwd+bwd", "triton") in seed_rows:
        print(f"seed config ({SEED_SIZE}x{SEED_SIZE}): forward+backward "
              f"{seed_rows[('fwd+bwd', 'triton')]['speedup']:.1f}x faster (goal >= 5x)")


def main(argv=None, description: Optional[str] = None) -> int:
    args = build_parser(description).parse_args(argv)
    if args.smoke_cpu:
        # Triton reads this when its kernels are decorated: before deform_plugin's Triton modules are imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        sys.exit("bench_deform_sdpa needs a CUDA GPU: the Triton interpreter on a CPU is far too slow to time "
                 "(--smoke-cpu checks the tool itself at tiny sizes)")
    dtype = DTYPES[args.dtype]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    info = machine_info(device)
    machine = machine_line(info)
    print(machine)
    print(f"config: B={args.batch} V={args.views} S={args.samples} H={args.heads} D={args.head_dim} "
          f"dtype={args.dtype} coords_grad={not args.no_coords_grad}; latency = do_bench median [p20, p80]; "
          "memory = peak above the inputs; err fp64 = ||triton - float64|| / ||float64||", flush=True)

    rows = []
    for size in args.sizes:
        error = check_against_float64(args, size, dtype, device)
        for mode in args.modes:
            results = {backend: bench_one(args, mode, backend, size, dtype, device) for backend in BACKENDS}
            base_ms, base_mem = results["pytorch"][0], results["pytorch"][3]
            for backend in BACKENDS:
                median, low, high, memory = results[backend]
                row = dict(size=size, mode=mode, backend=backend, ms=median, p20=low, p80=high, mem_mb=memory,
                           speedup=base_ms / median, mem_ratio=base_mem / memory if memory > 0 else float("nan"),
                           err_fp64=error if backend == "triton" else "", batch=args.batch, views=args.views,
                           samples=args.samples, heads=args.heads, head_dim=args.head_dim, dtype=args.dtype,
                           coords_grad=not args.no_coords_grad, machine=machine)
                rows.append(row)
                print(f"{size} {mode} {backend}: {median:.3f} ms [{low:.3f}, {high:.3f}], {memory:.1f} MB", flush=True)

    print()
    print(machine)
    print(results_table(rows))
    print_targets(rows)
    csv_path = write_csv(out_dir / "bench_deform_sdpa.csv", rows, append=True)
    pngs = draw(rows, out_dir, args.dtype, info["device"], args)
    print(f"wrote {csv_path}, {', '.join(pngs)}")
    return 0
