"""The MSDA entries users call, against the stock ones: eager, captured in a CUDA graph, and host time per call.

Entries (d_model = heads x head_dim):
    op            ``deform_plugin.ops.multi_scale_deformable_attn(..., backend='triton')``
    fused op      ``deform_plugin.ops.fused_multi_scale_deformable_attn`` from reference points, offsets, logits
    module        deform_plugin's ``MultiScaleDeformableAttention`` (projections included)
    stock op      mmcv's ``MultiScaleDeformableAttnFunction`` (its CUDA kernel), fp32/fp16 only
    stock module  mmcv's ``MultiScaleDeformableAttention`` with the same weights, fp32/fp16 only

For each: eager forward and forward+backward (``do_bench`` medians, L2 flushed), the same captured in a CUDA graph
and replayed (which removes the host's launch cost: close to the kernels' own time), and the host's microseconds
per call (the wall time to issue 50 calls back to back, before waiting for the GPU). An entry that cannot be
captured (the stock module checks its tables with a host sync) says so. Speedups are against the stock entry of
the same kind (op vs stock op, fused op vs stock op, module vs stock module), in fp32 for bf16 rows (stock has no
bf16).

``--host-split`` measures instead where the host time of one plain-op call goes, ours beside mmcv's: the whole
forward+backward, the forward without and with autograd, and the backward's launches called directly (see
:func:`host_split`).
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch

from deform_plugin.benchmarks.common import do_bench, machine_info, machine_line, markdown_table, write_csv
from deform_plugin.benchmarks.ops.msda import CASES, DTYPES, Case, make_inputs, reference_points

ENTRY_CASES = ("encoder_b2", "decoder_q300", "decoder_q900", "mask2former_b2")
DISTS = ("uniform", "realistic")  # how make_inputs draws the sampling locations
HOST_CALLS = 50


class Entry:
    """One callable entry: ``call()`` runs a forward on fixed inputs; ``leaves`` are what backward differentiates."""

    def __init__(self, name: str, call: Callable[[], torch.Tensor], leaves: Sequence[torch.Tensor]):
        self.name = name
        self.call = call
        self.leaves = [t for t in leaves if t.requires_grad]


def _leaf(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().clone().requires_grad_(tensor.is_floating_point())


def entries(case: Case, dtype: torch.dtype, dist: str, device="cuda") -> List[Entry]:
    """Every entry of ``case`` in ``dtype``, on inputs drawn as ``deform_plugin.benchmarks.ops.msda`` draws them."""
    import deform_plugin  # noqa: F401  (installs the integration: stock MSDA classes and our module)
    from deform_plugin.integration.mmcv_lite import compiled_mmcv_ops_available
    from deform_plugin.models import MultiScaleDeformableAttention
    from deform_plugin.ops import fused_multi_scale_deformable_attn, multi_scale_deformable_attn
    from mmcv.ops.multi_scale_deform_attn import MultiScaleDeformableAttention as StockModule
    from mmcv.ops.multi_scale_deform_attn import MultiScaleDeformableAttnFunction

    value, shapes, starts, locations, weights = make_inputs(case, dtype, dist, device=device)
    levels = len(case.levels)
    generator = torch.Generator(device=device).manual_seed(1)
    value_l, locations_l, weights_l = _leaf(value), _leaf(locations), _leaf(weights)
    ref = reference_points(case, generator, device)[:, :, None, :].expand(-1, -1, levels, -1).contiguous()
    # Offsets in pixels around the reference point, as the module predicts them at initialisation.
    offsets = _leaf((2.0 * torch.randn(locations.shape, generator=generator, device=device)).to(dtype))
    logits = _leaf(torch.randn(weights.shape, generator=generator, device=device).to(dtype))
    ref_l = _leaf(ref.to(dtype))
    result = [
        Entry("op", lambda: multi_scale_deformable_attn(value_l, shapes, starts, locations_l, weights_l,
                                                        backend="triton"), [value_l, locations_l, weights_l]),
        Entry("fused op", lambda: fused_multi_scale_deformable_attn(value_l, shapes, starts, ref_l, offsets, logits,
                                                                    backend="triton"),
              [value_l, ref_l, offsets, logits]),
    ]
    embed_dims = case.heads * case.head_dim
    kwargs = dict(embed_dims=embed_dims, num_heads=case.heads, num_levels=levels, num_points=case.points,
                  batch_first=True, dropout=0.0)
    # Initialised on the CPU and in eval mode (no dropout): the CUDA generator is never used, so an entry whose
    # capture fails (the stock module syncs) cannot leave it in a capturing state for the next entries.
    ours = MultiScaleDeformableAttention(**kwargs, backend="triton")
    ours.init_weights()
    ours = ours.to(device=device, dtype=dtype).eval()
    query = _leaf(torch.randn(case.batch, case.num_queries, embed_dims, generator=generator, device=device).to(dtype))
    memory = _leaf(torch.randn(case.batch, case.num_keys, embed_dims, generator=generator, device=device).to(dtype))
    ref_points = ref[..., :2].to(dtype)
    def module_call(module):
        return lambda: module(query, value=memory, reference_points=ref_points, spatial_shapes=shapes,
                              level_start_index=starts)
    result.append(Entry("module", module_call(ours), [query, memory, *ours.parameters()]))
    if compiled_mmcv_ops_available() and dtype != torch.bfloat16:
        im2col_step = math.gcd(case.batch, 64)
        result.append(Entry("stock op", lambda: MultiScaleDeformableAttnFunction.apply(
            value_l, shapes, starts, locations_l, weights_l, im2col_step), [value_l, locations_l, weights_l]))
        stock = StockModule(**kwargs).to(device=device, dtype=dtype).eval()
        stock.load_state_dict(ours.state_dict())
        result.append(Entry("stock module", module_call(stock), [query, memory, *stock.parameters()]))
    return result


def _forward(entry: Entry) -> Callable[[], object]:
    def run():
        with torch.no_grad():
            return entry.call()
    return run


def forward_backward(entry: Entry, grad_output: torch.Tensor) -> Callable[[], object]:
    def run():
        return torch.autograd.grad(entry.call(), entry.leaves, grad_output)
    return run


def _graph(run: Callable[[], object]) -> Optional[Callable[[], None]]:
    """``run`` captured in a CUDA graph (after a warm-up on a side stream): its replay, or None if it can't be."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
    except RuntimeError as error:
        torch.cuda.synchronize()
        print(f"    cannot capture: {str(error).splitlines()[0][:120]}", flush=True)
        return None
    return graph.replay


def host_us_per_call(run: Callable[[], object], calls: int = HOST_CALLS) -> float:
    """Wall-clock microseconds the host spends issuing one call, measured over ``calls`` calls before syncing."""
    run()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        run()
    issued = time.perf_counter() - start
    torch.cuda.synchronize()
    return issued / calls * 1e6


def time_entry(entry: Entry, rep: int) -> Dict[str, Optional[float]]:
    out = entry.call().detach()
    grad_output = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out)
    runs = {"fwd": _forward(entry), "fwd+bwd": forward_backward(entry, grad_output)}
    result: Dict[str, Optional[float]] = {}
    for mode, run in runs.items():
        result[f"{mode}_ms"] = do_bench(run, rep=rep)[0]
        result[f"{mode}_host_us"] = host_us_per_call(run)
        replay = _graph(run)
        result[f"{mode}_graph_ms"] = do_bench(replay, rep=rep)[0] if replay else None
    return result


HOST_SPLIT_PIECES = ("forward+backward", "forward, no grad", "forward with autograd", "backward launches",
                     "zeros of value's shape")


def host_split(case: Case, dtype: torch.dtype, dist: str, device="cuda", calls: int = 300, repeats: int = 5,
               warmup: int = 20) -> List[dict]:
    """Host microseconds per call of the plain op's pieces, ours (``backend='triton'``) and mmcv's CUDA op.

    Each piece is issued ``calls`` times back to back and the wall time divided (the best of ``repeats``, after
    ``warmup`` calls; the device is synchronised between repeats, never inside one). The backward's launches are
    called without autograd: ours ``triton_launch.msda_backward``, mmcv's three ``zeros_like`` and its
    ``ms_deform_attn_backward``, as its autograd function does. mmcv's column is None where its compiled ops are
    missing or for bf16 (it has none).
    """
    from deform_plugin.integration.mmcv_lite import compiled_mmcv_ops_available
    from deform_plugin.ops import multi_scale_deformable_attn
    from deform_plugin.ops.msda import triton_launch

    value, shapes, starts, locations, weights = make_inputs(case, dtype, dist, device=device)
    leaves = [_leaf(t) for t in (value, locations, weights)]
    value_l, locations_l, weights_l = leaves
    grad_output = torch.randn((case.batch, case.num_queries, case.heads * case.head_dim),
                              generator=torch.Generator().manual_seed(2)).to(value)

    def ours_forward():
        return multi_scale_deformable_attn(value_l, shapes, starts, locations_l, weights_l, backend="triton")

    ours = {
        "forward+backward": lambda: torch.autograd.grad(ours_forward(), leaves, grad_output),
        "forward, no grad": lambda: _no_grad(ours_forward),
        "forward with autograd": ours_forward,
        "backward launches": lambda: triton_launch.msda_backward(grad_output, value, shapes, starts, locations,
                                                                 weights),
        "zeros of value's shape": lambda: torch.zeros(value.shape, device=value.device, dtype=torch.float32),
    }
    stock: Dict[str, Callable[[], object]] = {}
    if compiled_mmcv_ops_available() and dtype != torch.bfloat16 and value.is_cuda:
        from mmcv.ops.multi_scale_deform_attn import MultiScaleDeformableAttnFunction, ext_module
        im2col_step = math.gcd(case.batch, 64)

        def stock_forward():
            return MultiScaleDeformableAttnFunction.apply(value_l, shapes, starts, locations_l, weights_l,
                                                          im2col_step)

        def stock_backward():
            grads = [torch.zeros_like(t) for t in (value, locations, weights)]
            ext_module.ms_deform_attn_backward(value, shapes, starts, locations, weights, grad_output.contiguous(),
                                               *grads, im2col_step=im2col_step)
            return grads

        stock = {"forward+backward": lambda: torch.autograd.grad(stock_forward(), leaves, grad_output),
                 "forward, no grad": lambda: _no_grad(stock_forward),
                 "forward with autograd": stock_forward,
                 "backward launches": stock_backward}
    sync = torch.cuda.synchronize if value.is_cuda else (lambda: None)
    rows = []
    for piece in HOST_SPLIT_PIECES:
        row = dict(case=case.name, dtype=_dtype_name(dtype), piece=piece, ours_us=None, stock_us=None)
        for column, runs in (("ours_us", ours), ("stock_us", stock)):
            if piece in runs:
                row[column] = _best_host_us(runs[piece], sync, calls, repeats, warmup)
        rows.append(row)
    return rows


def _no_grad(run: Callable[[], object]) -> object:
    with torch.no_grad():
        return run()


def _dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, candidate in DTYPES.items() if candidate == dtype)


def _best_host_us(run: Callable[[], object], sync: Callable[[], None], calls: int, repeats: int,
                  warmup: int) -> float:
    for _ in range(warmup):
        run()
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            run()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    sync()
    return best


def format_host_split(rows: List[dict], machine: str) -> str:
    def cell(value):
        return "-" if value is None else f"{value:.1f}"

    body = [[r["case"], r["dtype"], r["piece"], cell(r["ours_us"]), cell(r["stock_us"])] for r in rows]
    legend = ("host us per call: wall time to issue the piece, calls back to back, best of the repeats; "
              "'-' = not run (no compiled mmcv ops, or bf16)")
    return "\n".join([machine, markdown_table(["case", "dtype", "piece", "ours us", "mmcv us"], body, pad=True),
                      legend])


STOCK_OF = {"op": "stock op", "fused op": "stock op", "module": "stock module"}
METRICS = ("fwd_ms", "fwd+bwd_ms", "fwd_graph_ms", "fwd+bwd_graph_ms", "fwd_host_us", "fwd+bwd_host_us")


def add_speedups(rows: List[dict]) -> None:
    """Speedup of each entry over its stock counterpart (same case and dist; fp32 stock for bf16 rows)."""
    index = {(r["case"], r["dist"], r["dtype"], r["entry"]): r for r in rows}
    for row in rows:
        stock_name = STOCK_OF.get(row["entry"])
        stock_dtype = "fp32" if row["dtype"] == "bf16" else row["dtype"]
        stock = index.get((row["case"], row["dist"], stock_dtype, stock_name)) if stock_name else None
        for metric in METRICS:
            ours, theirs = row.get(metric), (stock or {}).get(metric)
            row[f"{metric}_speedup"] = theirs / ours if ours and theirs else None


def format_table(rows: List[dict], machine: str) -> str:
    def cell(value, spec=".3f"):
        return "-" if value is None else format(value, spec)

    def pair(row, metric, spec):
        speedup = row.get(f"{metric}_speedup")
        return cell(row.get(metric), spec) + (f" ({speedup:.2f}x)" if speedup else "")

    header = ["case", "dist", "dtype", "entry", "fwd ms", "f+b ms", "graph fwd ms", "graph f+b ms", "host us fwd",
              "host us f+b"]
    body = [[r["case"], r["dist"], r["dtype"], r["entry"], pair(r, "fwd_ms", ".3f"), pair(r, "fwd+bwd_ms", ".3f"),
             pair(r, "fwd_graph_ms", ".3f"), pair(r, "fwd+bwd_graph_ms", ".3f"), pair(r, "fwd_host_us", ".0f"),
             pair(r, "fwd+bwd_host_us", ".0f")] for r in rows]
    legend = ("(Nx) = stock entry's time / ours (for host us: stock's host time / ours); graph = replay of the call "
              "captured in a CUDA graph (no launch cost: the kernels' own time); '-' = not captured / not run")
    return "\n".join([machine, markdown_table(header, body, pad=True), legend])


def build_parser(description: Optional[str] = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description or __doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(ENTRY_CASES), help=f"comma list of {', '.join(CASES)}")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--dists", default="uniform")
    parser.add_argument("--rep", type=int, default=100, help="do_bench repetition time per measurement (ms)")
    parser.add_argument("--out", default="bench_results", help="folder for msda_entry.csv and msda_entry.md")
    parser.add_argument("--host-split", action="store_true",
                        help="only the host time of the plain op's pieces, ours and mmcv's (msda_host_split.md)")
    return parser


def main(argv=None, description: Optional[str] = None) -> int:
    parser = build_parser(description)
    args = parser.parse_args(argv)
    for option, given, known in (("--cases", args.cases, CASES), ("--dtypes", args.dtypes, DTYPES),
                                 ("--dists", args.dists, DISTS)):
        unknown = [name for name in given.split(",") if name and name not in known]
        if unknown:
            parser.error(f"{option}: unknown {', '.join(map(repr, unknown))} (choose from {', '.join(known)})")
    if not torch.cuda.is_available():
        print("the MSDA entry benchmark needs a CUDA device")
        return 2
    machine = machine_line(machine_info(torch.device("cuda")))
    print(machine, flush=True)
    if args.host_split:
        rows = []
        for name, dist, dtype_name in _combinations(args):
            print(f"{name} {dist} {dtype_name} host split", flush=True)
            rows.extend(host_split(CASES[name], DTYPES[dtype_name], dist))
        _report(args.out, "msda_host_split", rows, format_host_split(rows, machine), machine)
        return 0
    rows = []
    for name, dist, dtype_name in _combinations(args):
        for entry in entries(CASES[name], DTYPES[dtype_name], dist):
            print(f"{name} {dist} {dtype_name} {entry.name}", flush=True)
            rows.append(dict(case=name, dist=dist, dtype=dtype_name, entry=entry.name,
                             **time_entry(entry, args.rep)))
        torch.cuda.empty_cache()
    add_speedups(rows)
    _report(args.out, "msda_entry", rows, format_table(rows, machine), machine)
    return 0


def _combinations(args):
    """(case, dist, dtype) of every run the arguments ask for, in their order."""
    for name in [c for c in args.cases.split(",") if c]:
        for dist in [d for d in args.dists.split(",") if d]:
            for dtype_name in [d for d in args.dtypes.split(",") if d]:
                yield name, dist, dtype_name


def _report(out_dir: str, stem: str, rows: List[dict], table: str, machine: str) -> None:
    """Print the table and write it (``STEM.md``) beside the rows (``STEM.csv``, appended) under ``out_dir``."""
    print("\n" + table)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / f"{stem}.csv", [dict(machine=machine, **r) for r in rows], append=True)
    (out / f"{stem}.md").write_text(table + "\n")
