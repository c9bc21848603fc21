"""Benchmark deformable SDPA: the PyTorch baseline (grid_sample, then attention) against the fused Triton kernels.

Sweeps the image size at the seed's configuration (B=2, V=8, S=32, H=16, D=32; 14x14 is the seed's own point) and
reports latency (``triton.testing.do_bench`` median, 20th and 80th percentiles) and peak memory for the forward,
the backward and forward+backward, with the speedup and memory ratio against the baseline timed in the same run.

Usage:
    python tools/bench_deform_sdpa.py --out bench_out                  # fp32, sizes 8..32
    python tools/bench_deform_sdpa.py --out bench_out --dtype bf16 --sizes 14 32

Writes ``DIR/bench_deform_sdpa.csv`` (rows appended) and ``DIR/latency_<dtype>.png``, ``DIR/memory_<dtype>.png``.
Peak memory is the largest allocation above what the inputs already hold, during one call.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import math
import os
import platform
import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from deform_plugin.ops.deform_sdpa import deform_sdpa  # noqa: E402
from repo_commit import repo_commit  # noqa: E402  (a sibling in tools/)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
BACKENDS = ("pytorch", "triton")
MODES = ("fwd", "bwd", "fwd+bwd")
SEED_SIZE = 14


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    return parser.parse_args()


def machine_line() -> str:
    import triton

    commit = repo_commit()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (f"machine: {gpu} | CUDA {torch.version.cuda} | torch {torch.__version__} | triton {triton.__version__} "
            f"| python {platform.python_version()} | commit {commit} | {datetime.datetime.now():%Y-%m-%d %H:%M}")


def make_inputs(args, size, dtype, device, requires_grad, seed=0):
    generator = torch.Generator(device=device).manual_seed(seed)
    pixels = size * size
    shape = (args.batch, args.views, args.heads, pixels, args.head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, generator=generator) for _ in range(3))
    coords = torch.rand(args.batch, args.views, pixels, args.views, args.samples, 2, device=device, dtype=dtype,
                        generator=generator)
    coords_grad = requires_grad and not args.no_coords_grad
    for tensor in (q, k, v):
        tensor.requires_grad_(requires_grad)
    coords.requires_grad_(coords_grad)
    return q, k, v, coords


def runner(mode, backend, inputs, size):
    """A no-argument callable that runs one mode, with everything it needs already computed."""
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


def latency_ms(run, device):
    """Median, 20th and 80th percentile in ms: do_bench on a GPU, a few wall-clock calls on a CPU (smoke only)."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(run, quantiles=[0.5, 0.2, 0.8], warmup=25, rep=100)
    import statistics
    import time

    times = []
    for _ in range(3):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), min(times), max(times)


def peak_memory_mb(run, device) -> float:
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = run()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del result
    return (peak - before) / 2**20


def relative_error(actual, expected) -> float:
    return ((actual.double() - expected.double()).abs().max() / expected.double().abs().max()).item()


def check_against_float64(args, size, dtype, device) -> float:
    """Largest relative error of the Triton forward against the float64 reference (NaN where that would not fit)."""
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
    inputs = make_inputs(args, size, dtype, device, requires_grad=(mode != "fwd"))
    try:
        run = runner(mode, backend, inputs, size)
        median, low, high = latency_ms(run, device)
        memory = peak_memory_mb(run, device)
    except torch.cuda.OutOfMemoryError:
        median = low = high = memory = float("nan")
    del inputs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return median, low, high, memory


def draw(rows, out_dir: Path, dtype_name: str, machine: str, args):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpu = machine.split("|")[0].replace("machine:", "").strip()
    title = (f"deformable SDPA {dtype_name}, B={args.batch} V={args.views} S={args.samples} H={args.heads} "
             f"D={args.head_dim}\n{gpu}")
    for metric, label, filename in (("ms", "latency (ms, median)", f"latency_{dtype_name}.png"),
                                    ("mem_mb", "peak memory above inputs (MB)", f"memory_{dtype_name}.png")):
        figure, axes = plt.subplots(figsize=(7, 4.5))
        for mode in args.modes:
            for backend, style in (("pytorch", "--"), ("triton", "-")):
                points = [(row["size"], row[metric]) for row in rows
                          if row["mode"] == mode and row["backend"] == backend and not math.isnan(row[metric])]
                if points:
                    axes.plot(*zip(*points), style, marker="o", label=f"{backend} {mode}")
        axes.axvline(SEED_SIZE, color="grey", linewidth=0.8, linestyle=":")
        axes.set_xlabel("image size (width = height)")
        axes.set_ylabel(label)
        axes.set_yscale("log")
        axes.set_title(title, fontsize=9)
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize=8)
        figure.tight_layout()
        figure.savefig(out_dir / filename, dpi=120)
        plt.close(figure)


def print_targets(rows):
    """Issue 5's goals at the seed's image size, where that size was swept."""
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


def main():
    args = parse_args()
    if args.smoke_cpu:
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
    machine = machine_line()
    print(machine)
    print(f"config: B={args.batch} V={args.views} S={args.samples} H={args.heads} D={args.head_dim} "
          f"dtype={args.dtype} coords_grad={not args.no_coords_grad}; latency = do_bench median [p20, p80]; "
          "memory = peak above the inputs")

    rows = []
    header = (f"{'size':>5} {'mode':>8} {'backend':>8} {'ms':>9} {'p20':>9} {'p80':>9} {'mem MB':>10} "
              f"{'speedup':>8} {'mem ratio':>9} {'err fp64':>9}")
    print(header)
    print("-" * len(header))
    for size in args.sizes:
        error = check_against_float64(args, size, dtype, device)
        for mode in args.modes:
            results = {backend: bench_one(args, mode, backend, size, dtype, device) for backend in BACKENDS}
            base_ms, base_mem = results["pytorch"][0], results["pytorch"][3]
            for backend in BACKENDS:
                median, low, high, memory = results[backend]
                speedup = base_ms / median
                memory_ratio = base_mem / memory if memory > 0 else float("nan")
                row = dict(size=size, mode=mode, backend=backend, ms=median, p20=low, p80=high, mem_mb=memory,
                           speedup=speedup, mem_ratio=memory_ratio, err_fp64=error if backend == "triton" else "",
                           batch=args.batch, views=args.views, samples=args.samples, heads=args.heads,
                           head_dim=args.head_dim, dtype=args.dtype, coords_grad=not args.no_coords_grad,
                           machine=machine)
                rows.append(row)
                marker = "  <- seed config" if size == SEED_SIZE and backend == "triton" else ""
                error_text = f"{error:9.2e}" if backend == "triton" else f"{'':>9}"
                print(f"{size:>5} {mode:>8} {backend:>8} {median:9.3f} {low:9.3f} {high:9.3f} {memory:10.1f} "
                      f"{speedup:7.1f}x {memory_ratio:8.1f}x {error_text}{marker}", flush=True)

    print_targets(rows)
    csv_path = out_dir / "bench_deform_sdpa.csv"
    new_file = not csv_path.exists()
    with open(csv_path, "a", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        if new_file:
            writer.writeheader()
        writer.writerows(rows)
    draw(rows, out_dir, args.dtype, machine, args)
    print(f"wrote {csv_path}, {out_dir / f'latency_{args.dtype}.png'}, {out_dir / f'memory_{args.dtype}.png'}")


if __name__ == "__main__":
    main()
