"""Peak memory and time of the CPU reference MSDA, forward + backward, against mmcv's grid_sample path.

Implementations: ``mmcv`` is ``multi_scale_deformable_attn_pytorch`` from ``mmcv.ops.multi_scale_deform_attn`` (what
mmcv's module runs on a CPU); ``ours`` is ``deform_plugin.ops.multi_scale_deformable_attn_reference`` (the 'pytorch'
backend). Both are checked against each other in float64 first (output and the three gradients).

Memory: each (case, dtype, implementation) runs in a fresh subprocess, so no allocator cache or earlier peak of
another run is counted. The child warms the implementation up on a tiny input (one-time allocations), builds its
inputs, resets the kernel's resident-set high-water mark (``/proc/self/clear_refs``), runs one forward+backward
(``torch.autograd.grad``, gradients kept) and reports ``VmHWM - VmRSS before``: the peak extra resident memory of the
call, output and gradients included, as mmdet's tests would see it in RSS. Where ``clear_refs`` is unavailable it
falls back to ``ru_maxrss`` minus the resident size before the call (an upper bound when building the inputs peaked
higher).

Time: in the parent process, after a warm-up call, the implementations take turns (so that load from other processes
on a shared machine hits both alike) for ``--repeats`` rounds; the table gives the median of host-timed forward calls
(under ``no_grad``) and forward+backward calls. Threads: torch's default, or ``OMP_NUM_THREADS``; the machine line
names the count.

Usage (from the repository root):
    OMP_NUM_THREADS=1 python -m deform_plugin.benchmarks.ops.reference_memory
    python -m deform_plugin.benchmarks.ops.reference_memory --cases encoder decoder_q300 --dtypes fp32 --repeats 3
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from typing import Dict, List

import torch

from deform_plugin.benchmarks.common import REPO_ROOT, repo_commit
from deform_plugin.benchmarks.ops.msda import Case

DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
IMPLEMENTATIONS = ("mmcv", "ours")
# Deformable-DETR's four levels at a small input resolution (about 256 x 336 pixels, strides 8 to 64).
DETR_LEVELS = ((32, 42), (16, 21), (8, 11), (4, 6))


CASES: Dict[str, Case] = {
    "encoder": Case("encoder", DETR_LEVELS, 2, None),
    "decoder_q300": Case("decoder_q300", DETR_LEVELS, 2, 300),
    "single_level": Case("single_level", ((48, 64),), 2, None),
    "encoder_2x": Case("encoder_2x", ((64, 84), (32, 42), (16, 21), (8, 11)), 1, None),
}


def make_inputs(case: Case, dtype: torch.dtype, seed: int = 0):
    """value, spatial_shapes, level_start_index, locations (10% outside the maps), weights; all leaves."""
    generator = torch.Generator().manual_seed(seed)
    shapes = torch.tensor(case.levels, dtype=torch.long)
    sizes = shapes.prod(1)
    starts = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)[:-1]])
    levels = len(case.levels)
    sample_shape = (case.batch, case.num_queries, case.heads, levels, case.points)
    value = torch.randn(case.batch, case.num_keys, case.heads, case.head_dim, generator=generator, dtype=dtype)
    locations = torch.rand(*sample_shape, 2, generator=generator, dtype=dtype).mul_(1.2).sub_(0.1)
    weights = torch.rand(*sample_shape, generator=generator, dtype=dtype)
    weights /= weights.sum((-2, -1), keepdim=True)
    return value, shapes, starts, locations, weights


def implementation(name: str):
    """A callable ``(value, shapes, starts, locations, weights) -> (B, Q, H*D)``."""
    import deform_plugin  # noqa: F401  (installs the mmcv-lite stand-in, so mmcv.ops imports)
    if name == "ours":
        from deform_plugin.ops import multi_scale_deformable_attn_reference
        return multi_scale_deformable_attn_reference
    from mmcv.ops.multi_scale_deform_attn import multi_scale_deformable_attn_pytorch
    return lambda value, shapes, starts, locations, weights: multi_scale_deformable_attn_pytorch(
        value, shapes, locations, weights)


def forward_backward(fn, inputs, grad_output):
    value, shapes, starts, locations, weights = inputs
    leaves = [t.requires_grad_() for t in (value, locations, weights)]
    out = fn(value, shapes, starts, locations, weights)
    return out, torch.autograd.grad(out, leaves, grad_output)


# ---------------------------------------------------------------------------------------------------------------------
# Child: one measurement
# ---------------------------------------------------------------------------------------------------------------------

def _status_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        return int(re.search(rf"^{field}:\s+(\d+) kB", status.read(), re.M).group(1))


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def measure_peak(case_name: str, dtype_name: str, impl: str) -> dict:
    """Peak extra resident memory of one forward+backward, in this (fresh) process."""
    case, dtype = CASES[case_name], DTYPES[dtype_name]
    fn = implementation(impl)
    tiny = make_inputs(Case("tiny", ((3, 4), (2, 2)), 1, 5, heads=2, head_dim=4, points=2), dtype)
    forward_backward(fn, tiny, torch.ones(1, 5, 8, dtype=dtype))
    inputs = make_inputs(case, dtype)
    grad_output = torch.randn(case.batch, case.num_queries, case.heads * case.head_dim, dtype=dtype)
    exact = _reset_peak_rss()
    before_kb = _status_kb("VmRSS")
    out, grads = forward_backward(fn, inputs, grad_output)
    peak_kb = _status_kb("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    del out, grads
    return dict(peak_mb=(peak_kb - before_kb) / 1024, exact=exact)


def measure_times(case: Case, dtype: torch.dtype, repeats: int) -> Dict[str, dict]:
    """Median forward and forward+backward milliseconds of each implementation, taking turns round by round."""
    inputs = make_inputs(case, dtype)
    grad_output = torch.randn(case.batch, case.num_queries, case.heads * case.head_dim, dtype=dtype)
    functions = {impl: implementation(impl) for impl in IMPLEMENTATIONS}
    samples = {impl: dict(forward_ms=[], step_ms=[]) for impl in IMPLEMENTATIONS}
    for fn in functions.values():
        forward_backward(fn, inputs, grad_output)
    for _ in range(repeats):
        for impl, fn in functions.items():
            start = time.perf_counter()
            with torch.no_grad():
                fn(*inputs)
            samples[impl]["forward_ms"].append((time.perf_counter() - start) * 1e3)
            start = time.perf_counter()
            forward_backward(fn, inputs, grad_output)
            samples[impl]["step_ms"].append((time.perf_counter() - start) * 1e3)
    return {impl: {name: statistics.median(values) for name, values in times.items()}
            for impl, times in samples.items()}


# ---------------------------------------------------------------------------------------------------------------------
# Parent: check, spawn, tabulate
# ---------------------------------------------------------------------------------------------------------------------

def check_agreement() -> float:
    """Largest relative difference, ours against mmcv, of output and gradients on a float64 case."""
    case = Case("decoder_q50", DETR_LEVELS[1:], 2, 50)
    inputs = make_inputs(case, torch.float64)
    grad_output = torch.randn(case.batch, case.num_queries, case.heads * case.head_dim, dtype=torch.float64)
    results = []
    for impl in IMPLEMENTATIONS:
        copies = [t.detach().clone() for t in inputs]
        out, grads = forward_backward(implementation(impl), copies, grad_output)
        results.append([out, *grads])
    return max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(*results))


def machine_line() -> str:
    import mmcv
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            cpu = re.search(r"^model name\s*:\s*(.+)$", cpuinfo.read(), re.M).group(1)
    except (OSError, AttributeError):
        pass
    return (f"CPU {cpu} ({os.cpu_count()} cores, torch threads {torch.get_num_threads()}), torch {torch.__version__}, "
            f"mmcv {mmcv.__version__}, python {platform.python_version()}, commit {repo_commit()}, "
            f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC")


def run_child(case_name: str, dtype_name: str, impl: str) -> dict:
    command = [sys.executable, "-m", "deform_plugin.benchmarks.ops.reference_memory", "--child", case_name, dtype_name,
               impl]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def table(rows: List[dict]) -> str:
    lines = ["| case | dtype | sizes | peak MB mmcv / ours | ours / mmcv | fwd ms mmcv / ours | f+b ms mmcv / ours | "
             "f+b speedup |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        mmcv, ours = row["mmcv"], row["ours"]
        lines.append(f"| {row['case']} | {row['dtype']} | {row['sizes']} "
                     f"| {mmcv['peak_mb']:.0f} / {ours['peak_mb']:.0f} | {ours['peak_mb'] / mmcv['peak_mb']:.2f} "
                     f"| {mmcv['forward_ms']:.0f} / {ours['forward_ms']:.0f} "
                     f"| {mmcv['step_ms']:.0f} / {ours['step_ms']:.0f} | {mmcv['step_ms'] / ours['step_ms']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=list(DTYPES))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--child", nargs=3, metavar=("CASE", "DTYPE", "IMPL"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure_peak(*args.child)))
        return
    print(machine_line())
    error = check_agreement()
    print(f"ours vs mmcv, float64 output and gradients: max relative difference {error:.1e}")
    if not error < 1e-12:
        raise SystemExit("the implementations disagree: not timing them")
    rows = []
    for case_name in args.cases:
        for dtype_name in args.dtypes:
            row = dict(case=case_name, dtype=dtype_name, sizes=CASES[case_name].describe())
            times = measure_times(CASES[case_name], DTYPES[dtype_name], args.repeats)
            for impl in IMPLEMENTATIONS:
                row[impl] = dict(run_child(case_name, dtype_name, impl), **times[impl])
            rows.append(row)
            print(f"  {case_name} {dtype_name}: done", file=sys.stderr)
    if not all(row[impl]["exact"] for row in rows for impl in IMPLEMENTATIONS):
        print("note: /proc/self/clear_refs unavailable; peaks are ru_maxrss minus RSS before the call")
    print(table(rows))


if __name__ == "__main__":
    main()
