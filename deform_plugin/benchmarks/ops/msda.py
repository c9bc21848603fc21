"""Benchmark of the MSDA op: correctness first, then latency, memory and floors, as a table, a CSV and a plot.

For each case, dtype and location distribution it
  1. checks the Triton op's output and gradients against the float64 reference on the same rounded inputs;
  2. times forward, backward and forward+backward with :func:`deform_plugin.benchmarks.common.do_bench` (median
     of L2-flushed runs, 20th/80th percentiles kept in the CSV) for our Triton op and for the stock mmcv CUDA op
     when mmcv's compiled ops are importable (its im2col_step = gcd(batch, 64)), else for our PyTorch reference;
  3. measures the peak extra memory of forward+backward;
  4. compares with the floors of :mod:`.floors`, measured on the same card.
With ``--deterministic`` it does the same for the Triton op under ``torch.use_deterministic_algorithms(True)``,
whose backward sums each ``grad_value`` row in a fixed order (sort and segment sum) instead of scattering with
atomics: the two backward strategies side by side, with their errors against float64 (column ``gv err``).
It prints a machine line and a table with speedup columns, appends rows to a CSV and draws a PNG.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

from deform_plugin.benchmarks.common import (do_bench, machine_info, machine_line, markdown_table, peak_extra_memory_mb,
                                             plot_lines, relative_error, write_csv)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
ENCODER_LEVELS = ((100, 167), (50, 84), (25, 42), (13, 21))
MASK2FORMER_LEVELS = ((128, 128), (64, 64), (32, 32))
MODES = ("fwd", "bwd", "fwd+bwd")
# Error limits against float64 (norm-based relative error). Location gradients jump at pixel edges: even the fp32
# PyTorch reference is off by up to 3.5e-3 there.
ERROR_LIMITS = {"fp32": 1e-4, "fp16": 5e-3, "bf16": 3e-2}
LOCATION_GRAD_LIMITS = {"fp32": 5e-3, "fp16": 2e-2, "bf16": 6e-2}


@dataclass(frozen=True)
class Case:
    name: str
    levels: Tuple[Tuple[int, int], ...]
    batch: int
    queries: Optional[int]     # None: one query per key (encoder self-attention)
    heads: int = 8
    head_dim: int = 32
    points: int = 4

    @property
    def num_keys(self) -> int:
        return sum(h * w for h, w in self.levels)

    @property
    def num_queries(self) -> int:
        return self.num_keys if self.queries is None else self.queries

    @property
    def encoder_like(self) -> bool:
        return self.queries is None

    @property
    def samples(self) -> int:
        return self.batch * self.num_queries * self.heads * len(self.levels) * self.points

    def describe(self) -> str:
        return (f"B={self.batch} Q={self.num_queries} S={self.num_keys} L={len(self.levels)} H={self.heads} "
                f"D={self.head_dim} P={self.points}")


CASES = {
    "encoder_b2": Case("encoder_b2", ENCODER_LEVELS, 2, None),
    "encoder_b8": Case("encoder_b8", ENCODER_LEVELS, 8, None),
    "decoder_q300": Case("decoder_q300", ENCODER_LEVELS, 2, 300),
    "decoder_q900": Case("decoder_q900", ENCODER_LEVELS, 2, 900),
    "mask2former_b2": Case("mask2former_b2", MASK2FORMER_LEVELS, 2, None),
}


# ---------------------------------------------------------------------------------------------------------------------
# Inputs and implementations
# ---------------------------------------------------------------------------------------------------------------------

def level_tables(levels, device):
    shapes = torch.tensor(levels, dtype=torch.long, device=device)
    sizes = shapes[:, 0] * shapes[:, 1]
    starts = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)[:-1]])
    return shapes, starts


def reference_points(case: Case, generator, device) -> torch.Tensor:
    """(B, Q, 2) normalized reference points: each key's pixel centre (encoder) or random object centres."""
    if case.encoder_like:
        centres = []
        for h, w in case.levels:
            ys, xs = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
            centres.append(torch.stack([(xs.flatten() + 0.5) / w, (ys.flatten() + 0.5) / h], -1))
        return torch.cat(centres).unsqueeze(0).expand(case.batch, -1, -1)
    return torch.rand(case.batch, case.num_queries, 2, generator=generator, device=device)


def make_inputs(case: Case, dtype: torch.dtype, dist: str, seed: int = 0, device="cuda"):
    """(value, shapes, starts, locations, weights); ``dist`` 'uniform' or 'realistic' (reference point + ~2 px)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    shapes, starts = level_tables(case.levels, device)
    levels = len(case.levels)
    value = torch.randn(case.batch, case.num_keys, case.heads, case.head_dim, generator=generator, device=device)
    loc_shape = (case.batch, case.num_queries, case.heads, levels, case.points, 2)
    if dist == "uniform":
        locations = torch.rand(loc_shape, generator=generator, device=device)
    else:
        ref = reference_points(case, generator, device)[:, :, None, None, None, :]
        pixel_size = 1.0 / torch.tensor([[w, h] for h, w in case.levels], device=device, dtype=torch.float32)
        offsets = 2.0 * torch.randn(loc_shape, generator=generator, device=device)
        locations = ref + offsets * pixel_size[None, None, None, :, None, :]
    logits = torch.randn(case.batch, case.num_queries, case.heads, levels * case.points, generator=generator,
                         device=device)
    weights = logits.softmax(-1).view(loc_shape[:-1])
    return value.to(dtype), shapes, starts, locations.to(dtype), weights.to(dtype)


def stock_mmcv_op() -> Optional[Callable]:
    """mmcv's compiled MSDA (the stock CUDA kernel), or None where mmcv's compiled ops are absent."""
    from deform_plugin.integration.mmcv_lite import compiled_mmcv_ops_available
    if not compiled_mmcv_ops_available():
        return None
    from mmcv.ops.multi_scale_deform_attn import MultiScaleDeformableAttnFunction

    def stock(value, shapes, starts, locations, weights):
        return MultiScaleDeformableAttnFunction.apply(value, shapes, starts, locations, weights,
                                                      math.gcd(value.shape[0], 64))
    return stock


# The implementation timed with ``torch.use_deterministic_algorithms(True)``: the Triton op whose backward sums each
# grad_value row's contributions in a fixed order (sort and segment sum) instead of scattering them with atomics.
DETERMINISTIC = "triton det"


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool):
    """``torch.use_deterministic_algorithms(enabled)`` inside the block, the previous setting after it."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(enabled)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def implementations(dtype: torch.dtype, baseline: str, deterministic: bool = False) -> Dict[str, Callable]:
    from deform_plugin.ops import multi_scale_deformable_attn_reference
    from deform_plugin.ops.msda.triton_op import multi_scale_deformable_attn_triton

    impls = {"triton": multi_scale_deformable_attn_triton}
    if deterministic:
        impls[DETERMINISTIC] = multi_scale_deformable_attn_triton
    stock = stock_mmcv_op()
    if baseline == "stock" and stock is not None and dtype != torch.bfloat16:
        impls["mmcv"] = stock
    elif baseline == "reference" or stock is None:
        impls["reference"] = multi_scale_deformable_attn_reference
    return impls


# ---------------------------------------------------------------------------------------------------------------------
# Correctness, timing, memory
# ---------------------------------------------------------------------------------------------------------------------

def check_against_float64(fn, inputs) -> Dict[str, float]:
    """Relative errors of ``fn``'s output and gradients against the float64 reference on the same inputs.

    ``rounding`` is the float64 output rounded to the inputs' dtype: the error no implementation can beat.
    """
    from deform_plugin.ops import multi_scale_deformable_attn_reference

    value, shapes, starts, locations, weights = inputs
    grad_output = torch.randn(value.shape[0], locations.shape[1], value.shape[2] * value.shape[3],
                              device=value.device).to(value.dtype)
    ours = [t.detach().clone().requires_grad_() for t in (value, locations, weights)]
    out = fn(ours[0], shapes, starts, ours[1], ours[2])
    grads = torch.autograd.grad(out, ours, grad_output)
    ref = [t.detach().double().requires_grad_() for t in (value, locations, weights)]
    with deterministic_algorithms(False):  # the reference's own scatter need not be ordered
        ref_out = multi_scale_deformable_attn_reference(ref[0], shapes, starts, ref[1], ref[2])
        ref_grads = torch.autograd.grad(ref_out, ref, grad_output.double())
    errors = dict(out=relative_error(out, ref_out), rounding=relative_error(ref_out.to(value.dtype), ref_out))
    for name, a, b in zip(("grad_value", "grad_loc", "grad_weight"), grads, ref_grads):
        errors[name] = relative_error(a, b)
    return errors


def errors_pass(errors: Dict[str, float], dtype_name: str) -> bool:
    limit = ERROR_LIMITS[dtype_name]
    return (all(errors[k] <= limit for k in ("out", "grad_value", "grad_weight"))
            and errors["grad_loc"] <= LOCATION_GRAD_LIMITS[dtype_name]
            and errors["out"] <= max(2 * errors["rounding"], 1e-5))


def time_modes(fn, inputs, repeat_ms: int = 100) -> Dict[str, Tuple[float, float, float]]:
    """(median, p20, p80) ms of forward, backward (replayed graph) and forward+backward."""
    value, shapes, starts, locations, weights = inputs
    leaves = [t.detach().clone().requires_grad_() for t in (value, locations, weights)]

    def forward():
        with torch.no_grad():
            return fn(leaves[0], shapes, starts, leaves[1], leaves[2])

    out = fn(leaves[0], shapes, starts, leaves[1], leaves[2])
    grad_output = torch.randn_like(out)

    def backward():
        return torch.autograd.grad(out, leaves, grad_output, retain_graph=True)

    def forward_backward():
        o = fn(leaves[0], shapes, starts, leaves[1], leaves[2])
        return torch.autograd.grad(o, leaves, grad_output)

    calls = {"fwd": forward, "bwd": backward, "fwd+bwd": forward_backward}
    return {mode: do_bench(call, rep=repeat_ms) for mode, call in calls.items()}


def forward_backward_memory_mb(fn, inputs) -> float:
    value, shapes, starts, locations, weights = inputs
    leaves = [t.detach().clone().requires_grad_() for t in (value, locations, weights)]

    def run():
        out = fn(leaves[0], shapes, starts, leaves[1], leaves[2])
        return torch.autograd.grad(out, leaves, torch.ones_like(out))
    return peak_extra_memory_mb(run, value.device)


# ---------------------------------------------------------------------------------------------------------------------
# Tuning sweep
# ---------------------------------------------------------------------------------------------------------------------

# (queries per program, warps, pipelining stages) that the sweep times; choose_config's default is (8, 1, 1).
TUNE_CONFIGS = ((8, 1, 1), (16, 2, 1), (32, 4, 1), (32, 4, 2), (64, 8, 1), (128, 4, 1))


def fused_inputs(case: Case, dtype: torch.dtype, locations: torch.Tensor, device="cuda"):
    """(reference points, offsets, logits) for the fused launchers: each query's reference point (encoder-like
    cases) or a random box (decoder cases), offsets ~2 px as the module predicts at initialisation."""
    generator = torch.Generator(device=device).manual_seed(1)
    levels = len(case.levels)
    ref = reference_points(case, generator, device)[:, :, None, :].expand(-1, -1, levels, -1).contiguous()
    if not case.encoder_like:  # boxes (cx, cy, w, h), as the decoders pass them
        ref = torch.cat([ref, 0.05 + 0.3 * torch.rand(ref.shape, generator=generator, device=device)], -1)
    offsets = 2.0 * torch.randn(locations.shape, generator=generator, device=device)
    logits = torch.randn(locations.shape[:-1], generator=generator, device=device)
    return ref.to(dtype), offsets.to(dtype), logits.to(dtype)


def tune(case_names, dtype_names, dists, rep: int = 100, device="cuda", cases=None) -> List[dict]:
    """Median ms of the Triton launchers (plain and fused, forward and backward) under each of ``TUNE_CONFIGS``:
    kernel time without the public entry's host path. Prints one line per case, dtype and distribution."""
    from deform_plugin.ops.msda import triton_launch

    cases = cases or CASES
    rows = []
    for name in case_names:
        case = cases[name]
        for dtype_name in dtype_names:
            for dist in dists:
                value, shapes, starts, locations, weights = make_inputs(case, DTYPES[dtype_name], dist, device=device)
                ref, offsets, logits = fused_inputs(case, value.dtype, locations, device=device)
                grad_output = torch.randn(case.batch, case.num_queries, case.heads * case.head_dim,
                                          device=value.device, dtype=value.dtype)
                line = [f"{name} {dtype_name} {dist}:"]
                for block_q, warps, stages in TUNE_CONFIGS:
                    config = replace(
                        triton_launch.choose_config(case.head_dim, block_q=block_q, num_warps=warps),
                        num_stages=stages)
                    launches = {
                        "fwd": lambda: triton_launch.msda_forward(value, shapes, starts, locations, weights,
                                                                  config=config),
                        "bwd": lambda: triton_launch.msda_backward(grad_output, value, shapes, starts, locations,
                                                                   weights, config=config),
                        "fused fwd": lambda: triton_launch.fused_msda_forward(value, shapes, starts, ref, offsets,
                                                                              logits, config=config),
                        "fused bwd": lambda: triton_launch.fused_msda_backward(grad_output, value, shapes, starts,
                                                                               ref, offsets, logits, config=config),
                    }
                    times = {kernel: do_bench(run, device=value.device, rep=rep)[0]
                             for kernel, run in launches.items()}
                    rows.append(dict(case=name, dtype=dtype_name, dist=dist, block_q=block_q, warps=warps,
                                     stages=stages, **{f"{kernel} ms": ms for kernel, ms in times.items()}))
                    line.append(f"bq{block_q}w{warps}s{stages} " + " ".join(f"{k} {v:.3f}" for k, v in times.items()))
                print(" | ".join(line), flush=True)
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# One case, the table, main
# ---------------------------------------------------------------------------------------------------------------------

def bench_case(case: Case, dist: str, dtype_names: List[str], baseline: str, bandwidth: float, rep: int,
               deterministic: bool = False) -> Tuple[List[dict], bool]:
    """Rows of every implementation and dtype for one case and distribution, and whether every check passed
    (``deterministic``: also the Triton op under deterministic algorithms, with its own errors)."""
    from deform_plugin.benchmarks.ops.floors import dram_bytes, gather_scatter_floor

    rows, ok, stock_fp32 = [], True, None
    for dtype_name in dtype_names:
        dtype = DTYPES[dtype_name]
        inputs = make_inputs(case, dtype, dist)
        impls = implementations(dtype, baseline, deterministic)
        errors_of = {}
        for impl in ("triton", DETERMINISTIC):
            if impl not in impls:
                continue
            with deterministic_algorithms(impl == DETERMINISTIC):
                errors_of[impl] = check_against_float64(impls[impl], inputs)
            passed = errors_pass(errors_of[impl], dtype_name)
            ok &= passed
            print(f"check {case.name} {dtype_name} {dist} {impl}: "
                  + " ".join(f"{k} {v:.2e}" for k, v in errors_of[impl].items())
                  + ("" if passed else "  FAILED"), flush=True)
        gather_ms, scatter_ms = gather_scatter_floor(case, dtype, inputs[2], inputs[3])
        floor_fwd, floor_total = (b / bandwidth * 1e3 for b in dram_bytes(case, dtype))
        timings = {}
        for impl, fn in impls.items():
            if impl == "reference" and case.batch * case.num_queries > 50000:
                continue  # the reference needs ~2 GB per encoder call; time it only where it fits quickly
            with deterministic_algorithms(impl == DETERMINISTIC):
                timings[impl] = (time_modes(fn, inputs, rep), forward_backward_memory_mb(fn, inputs))
        if "mmcv" in timings and dtype == torch.float32:
            stock_fp32 = timings["mmcv"][0]
        base = timings.get("mmcv", timings.get("reference"))
        for impl, (modes, memory) in timings.items():
            row = dict(case=case.name, dtype=dtype_name, dist=dist, impl=impl, samples=case.samples,
                       peak_extra_mb=round(memory, 1), out_err=errors_of[impl]["out"] if impl in errors_of else "",
                       grad_value_err=errors_of[impl]["grad_value"] if impl in errors_of else "",
                       gather_floor_ms=gather_ms, scatter_floor_ms=scatter_ms,
                       dram_floor_fwd_ms=floor_fwd, dram_floor_fwd_bwd_ms=floor_total)
            for mode, (median, p20, p80) in modes.items():
                row[f"{mode}_ms"], row[f"{mode}_p20"], row[f"{mode}_p80"] = median, p20, p80
                row[f"{mode}_speedup"] = base[0][mode][0] / median if base else ""
                row[f"{mode}_vs_stock_fp32"] = stock_fp32[mode][0] / median if stock_fp32 else ""
            row["fwd_vs_gather_floor"] = row["fwd_ms"] / gather_ms
            row["fwd+bwd_vs_floor"] = row["fwd+bwd_ms"] / (2 * gather_ms + scatter_ms)
            row["fwd_dram_fraction"] = floor_fwd / row["fwd_ms"]
            row["fwd+bwd_dram_fraction"] = floor_total / row["fwd+bwd_ms"]
            rows.append(row)
            print(f"  {impl:<10} fwd {row['fwd_ms']:.3f} bwd {row['bwd_ms']:.3f} f+b {row['fwd+bwd_ms']:.3f} "
                  f"ms, {memory:.0f} MB, floors gather {gather_ms:.3f} scatter {scatter_ms:.3f}", flush=True)
        del inputs
        torch.cuda.empty_cache()
    return rows, ok


TABLE_COLUMNS = (("case", "case", "s"), ("dtype", "dtype", "s"), ("dist", "dist", "s"), ("impl", "impl", "s"),
                 ("fwd ms", "fwd_ms", ".3f"), ("bwd ms", "bwd_ms", ".3f"), ("f+b ms", "fwd+bwd_ms", ".3f"),
                 ("spd fwd", "fwd_speedup", ".2f"), ("spd f+b", "fwd+bwd_speedup", ".2f"),
                 ("vs32 f", "fwd_vs_stock_fp32", ".2f"), ("vs32 fb", "fwd+bwd_vs_stock_fp32", ".2f"),
                 ("MB", "peak_extra_mb", ".0f"), ("gv err", "grad_value_err", ".1e"),
                 ("gath", "gather_floor_ms", ".3f"),
                 ("scat", "scatter_floor_ms", ".3f"), ("fwd/fl", "fwd_vs_gather_floor", ".2f"),
                 ("fb/fl", "fwd+bwd_vs_floor", ".2f"), ("dram%", "fwd+bwd_dram_fraction", ".1%"))


def format_table(rows: List[dict], machine: str) -> str:
    def cell(value, spec):
        return format(value, spec) if isinstance(value, (int, float)) and spec != "s" else str(value or "-")
    legend = ("spd = speedup vs the baseline in the same dtype timed in this run; vs32 = vs the stock op's fp32; "
              "gath/scat = gather/scatter floor ms (kernel-only); fwd/fl, fb/fl = time over that floor; "
              "dram% = DRAM floor / f+b")
    table = markdown_table([c[0] for c in TABLE_COLUMNS],
                           [[cell(r[key], spec) for _, key, spec in TABLE_COLUMNS] for r in rows], pad=True)
    return "\n".join([machine, legend, table])


def plot(rows: List[dict], path: Path, machine: str) -> str:
    time_series, memory_series = {}, {}
    for row in rows:
        key = f"{row['impl']} {row['dtype']} {row['dist']}"
        time_series.setdefault(key, []).append((row["samples"], row["fwd+bwd_ms"]))
        memory_series.setdefault(key, []).append((row["samples"], row["peak_extra_mb"]))
    return plot_lines(path, [
        dict(series=time_series, xlabel="samples (B*Q*H*L*P)", ylabel="forward+backward median (ms)"),
        dict(series=memory_series, xlabel="samples (B*Q*H*L*P)", ylabel="peak extra memory fwd+bwd (MB)"),
    ], title=machine)


def build_parser(description: Optional[str] = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description or __doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    parser.add_argument("--dtypes", default="fp32,fp16,bf16")
    parser.add_argument("--dists", default="uniform,realistic")
    parser.add_argument("--baseline", choices=("stock", "reference"), default="stock",
                        help="stock mmcv op when importable (falls back to the reference), or our reference")
    parser.add_argument("--out", default="bench_results", help="folder for msda_bench.csv and msda_bench.png")
    parser.add_argument("--tune", action="store_true",
                        help="time the Triton launchers (plain and fused) under TUNE_CONFIGS instead")
    parser.add_argument("--rep", type=int, default=100, help="do_bench repetition time per measurement (ms)")
    parser.add_argument("--deterministic", action="store_true",
                        help=f"also time the Triton op under torch.use_deterministic_algorithms(True) (row "
                             f"'{DETERMINISTIC}': grad_value summed per row in a fixed order, no atomics)")
    return parser


def main(argv=None, description: Optional[str] = None) -> int:
    args = build_parser(description).parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_msda needs a CUDA device", file=sys.stderr)
        return 2
    case_names = [c for c in args.cases.split(",") if c]
    dtype_names = [d for d in args.dtypes.split(",") if d]
    dists = [d for d in args.dists.split(",") if d]
    machine = machine_line(machine_info(torch.device("cuda")))
    print(machine, flush=True)
    if args.tune:
        tune(case_names, dtype_names, dists, rep=args.rep)
        return 0

    from deform_plugin.benchmarks.ops.floors import measure_copy_bandwidth
    bandwidth = measure_copy_bandwidth()
    print(f"memory floor bandwidth: {bandwidth / 1e12:.2f} TB/s (2 GiB device-to-device copy, read + write)")
    print(f"stock mmcv op: {'available' if stock_mmcv_op() else 'not available (baseline: our reference)'}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: List[dict] = []
    ok = True
    for name in case_names:
        for dist in dists:
            case_rows, case_ok = bench_case(CASES[name], dist, dtype_names, args.baseline, bandwidth, args.rep,
                                            args.deterministic)
            rows += case_rows
            ok &= case_ok
    print("\n" + format_table(rows, machine))
    csv_path = write_csv(out_dir / "msda_bench.csv", [dict(machine=machine, **r) for r in rows], append=True)
    png_path = plot(rows, out_dir / "msda_bench.png", machine)
    print(f"wrote {csv_path} and {png_path}")
    return 0 if ok else 1
