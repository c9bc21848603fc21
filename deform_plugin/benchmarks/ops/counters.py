"""Hardware counters of the op kernels under Nsight Compute: which unit bounds each kernel, as a table.

For each target a child process runs the target's forward and backward once, on the inputs the benchmarks draw,
under ``ncu`` (``--clock-control none``: the clocks stay as the card runs them; caches flushed before each profiled
launch). ncu replays each launch of our kernels as often as its counters need. The parent reads the report back
(``--page raw --csv``) and prints a machine line and one row per kernel launch: duration, L1 hit rate,
the L1's, L2's and DRAM's throughput as a share of their peak, the L2's read, write and reduction (atomic add)
sectors, registers per thread and achieved occupancy. Writes ``DIR/kernel_counters.md`` and appends
``DIR/kernel_counters.csv``. Needs a CUDA GPU and an ``ncu`` that can read the counters.

Targets:
    ``sdpa:DTYPE``                 deform_sdpa at the seed's configuration (B=2 V=8 S=32 H=16 D=32, 14x14)
    ``msda:CASE:DIST:DTYPE``       the plain op, ``multi_scale_deformable_attn`` (CASE of :mod:`.msda`,
                                   DIST ``uniform`` or ``realistic``)
    ``msda-fused:CASE:DTYPE``      the fused op from reference points, offsets and logits, as the module calls it
"""
from __future__ import annotations

import argparse
import csv
import io
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

# Column -> (ncu metric, scale applied to its value, format). Durations are converted to ms by their unit instead.
COUNTERS = {
    "ms": ("gpu__time_duration.sum", 1.0, ".3f"),
    "L1 hit %": ("l1tex__t_sector_hit_rate.pct", 1.0, ".1f"),
    "L1 % of peak": ("l1tex__throughput.avg.pct_of_peak_sustained_elapsed", 1.0, ".1f"),
    "L2 % of peak": ("lts__throughput.avg.pct_of_peak_sustained_elapsed", 1.0, ".1f"),
    "DRAM % of peak": ("dram__throughput.avg.pct_of_peak_sustained_elapsed", 1.0, ".1f"),
    "L2 read Msectors": ("lts__t_sectors_op_read.sum", 1e-6, ".1f"),
    "L2 write Msectors": ("lts__t_sectors_op_write.sum", 1e-6, ".1f"),
    "L2 reduction Msectors": ("lts__t_sectors_op_red.sum", 1e-6, ".1f"),
    "registers": ("launch__registers_per_thread", 1.0, ".0f"),
    "occupancy %": ("sm__warps_active.avg.pct_of_peak_sustained_active", 1.0, ".1f"),
}
DEFAULT_TARGETS = ("sdpa:fp32", "msda:encoder_b2:uniform:fp32", "msda-fused:encoder_b2:bf16")
KERNEL_PATTERN = {"sdpa": "regex:deform_sdpa", "msda": "regex:msda_", "msda-fused": "regex:msda_"}
DTYPE_NAMES = ("fp32", "fp16", "bf16")


def parse_target(spec: str) -> List[str]:
    """Split and check a target; ``ValueError`` names what is wrong with it."""
    from deform_plugin.benchmarks.ops.msda import CASES

    parts = spec.split(":")
    kind = parts[0]
    expected = {"sdpa": 2, "msda": 4, "msda-fused": 3}
    if kind not in expected:
        raise ValueError(f"target {spec!r}: the kind must be one of {sorted(expected)}, got {kind!r}")
    if len(parts) != expected[kind]:
        raise ValueError(f"target {spec!r}: {kind} takes {expected[kind] - 1} ':'-separated fields, got "
                         f"{len(parts) - 1}")
    if parts[-1] not in DTYPE_NAMES:
        raise ValueError(f"target {spec!r}: dtype must be one of {DTYPE_NAMES}, got {parts[-1]!r}")
    if kind != "sdpa" and parts[1] not in CASES:
        raise ValueError(f"target {spec!r}: case must be one of {sorted(CASES)}, got {parts[1]!r}")
    if kind == "msda" and parts[2] not in ("uniform", "realistic"):
        raise ValueError(f"target {spec!r}: dist must be 'uniform' or 'realistic', got {parts[2]!r}")
    return parts


def launch_target(spec: str) -> None:
    """Run ``spec``'s forward and backward once on the GPU (the child process ncu watches)."""
    import torch

    parts = parse_target(spec)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[parts[-1]]
    if parts[0] == "sdpa":
        from deform_plugin.benchmarks.ops.deform_sdpa import SEED_SIZE, build_parser, make_inputs, runner

        args = build_parser().parse_args(["--out", tempfile.gettempdir()])
        inputs = make_inputs(args, SEED_SIZE, dtype, "cuda", requires_grad=True)
        run = runner("fwd+bwd", "triton", inputs, SEED_SIZE)
    else:
        from deform_plugin.benchmarks.ops.msda import CASES
        from deform_plugin.benchmarks.ops.msda_entry import entries, forward_backward

        name = "op" if parts[0] == "msda" else "fused op"
        dist = parts[2] if parts[0] == "msda" else "uniform"
        case = CASES[parts[1]]
        entry = next(e for e in entries(case, dtype, dist) if e.name == name)
        grad_output = torch.randn(case.batch, case.num_queries, case.heads * case.head_dim, device="cuda",
                                  dtype=dtype)
        run = forward_backward(entry, grad_output)
    run()
    torch.cuda.synchronize()


def find_ncu(explicit: Optional[str] = None) -> str:
    """The ncu executable: ``explicit``, else ``ncu`` on PATH, else CUDA's usual place; a clear error if none."""
    candidates = [explicit] if explicit else [shutil.which("ncu"), "/usr/local/cuda/bin/ncu"]
    for candidate in candidates:
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError(f"Nsight Compute's ncu not found (tried {[c for c in candidates if c]}); "
                            "pass --ncu PATH")


def profile_command(ncu: str, spec: str, report: Path) -> List[str]:
    """The ncu command line that profiles every launch of ``spec``'s kernels into ``report``."""
    metrics = ",".join(metric for metric, _, _ in COUNTERS.values())
    return [ncu, "--clock-control", "none", "--metrics", metrics, "-k", KERNEL_PATTERN[parse_target(spec)[0]],
            "-f", "-o", str(report), sys.executable, "-m", "deform_plugin.benchmarks.ops.counters", "--launch", spec]


def export_command(ncu: str, report: Path) -> List[str]:
    metrics = ",".join(metric for metric, _, _ in COUNTERS.values())
    return [ncu, "-i", str(report), "--page", "raw", "--csv", "--metrics", metrics]


# ncu prints each duration in a unit of its choosing (the units row names it).
_MILLISECONDS_PER = {"nsecond": 1e-6, "ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0,
                     "second": 1e3, "s": 1e3}


def parse_raw_csv(text: str) -> List[Dict[str, object]]:
    """Rows of ``ncu --page raw --csv`` (a header, a units row, one row per launch) as ``{column: value}``: the
    kernel's name and the COUNTERS columns, scaled; a counter ncu did not report is None."""
    lines = [line for line in text.splitlines() if line.startswith('"')]  # ncu's own log lines are not quoted
    records = list(csv.reader(io.StringIO("\n".join(lines))))
    if len(records) < 2:
        return []
    header, units, data = records[0], records[1], records[2:]
    index = {name: i for i, name in enumerate(header)}
    rows = []
    for record in data:
        row: Dict[str, object] = {"kernel": record[index["Kernel Name"]]}
        for column, (metric, scale, _) in COUNTERS.items():
            cell = record[index[metric]].replace(",", "") if metric in index else ""
            if column == "ms" and metric in index:
                scale = _MILLISECONDS_PER.get(units[index[metric]])
            try:
                row[column] = float(cell) * scale
            except (TypeError, ValueError):  # absent, or a duration in a unit not known here
                row[column] = None
        rows.append(row)
    return rows


def format_rows(rows: Sequence[Dict[str, object]]) -> List[List[str]]:
    table = []
    for row in rows:
        cells = [str(row["target"]), str(row["kernel"])]
        for column, (_, _, spec) in COUNTERS.items():
            value = row.get(column)
            cells.append("-" if value is None else format(value, spec))
        table.append(cells)
    return table


def build_parser(description: Optional[str] = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description or __doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="folder for kernel_counters.md and kernel_counters.csv")
    parser.add_argument("--targets", nargs="+", default=list(DEFAULT_TARGETS), help="see the targets above")
    parser.add_argument("--ncu", help="path of the ncu executable (default: ncu on PATH, then CUDA's bin)")
    parser.add_argument("--launch", help=argparse.SUPPRESS)  # the child process: run one target, nothing else
    return parser


def main(argv=None, description: Optional[str] = None) -> int:
    args = build_parser(description).parse_args(argv)
    if args.launch:
        launch_target(args.launch)
        return 0
    if not args.out:
        build_parser(description).error("--out is required")
    for spec in args.targets:
        parse_target(spec)  # every target checked before anything runs
    import torch

    from deform_plugin.benchmarks.common import machine_info, machine_line, markdown_table, write_csv

    if not torch.cuda.is_available():
        print("kernel_counters: needs a CUDA GPU (none visible)", file=sys.stderr)
        return 2
    ncu = find_ncu(args.ncu)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: List[Dict[str, object]] = []
    with tempfile.TemporaryDirectory() as scratch:
        for spec in args.targets:
            report = Path(scratch) / (spec.replace(":", "_") + ".ncu-rep")
            profiled = subprocess.run(profile_command(ncu, spec, report), capture_output=True, text=True)
            if profiled.returncode != 0 or not report.exists():
                print(f"kernel_counters: ncu failed on {spec} (exit {profiled.returncode}):\n"
                      f"{profiled.stdout[-2000:]}{profiled.stderr[-2000:]}", file=sys.stderr)
                return 1
            exported = subprocess.run(export_command(ncu, report), capture_output=True, text=True, check=True)
            rows += [dict(target=spec, **row) for row in parse_raw_csv(exported.stdout)]
    machine = machine_line(machine_info())
    header = ["target", "kernel", *COUNTERS]
    cells = format_rows(rows)
    table = markdown_table(header, cells)
    print(machine)
    print(markdown_table(header, cells, pad=True))
    (out_dir / "kernel_counters.md").write_text(machine + "\n\n" + table + "\n")
    write_csv(out_dir / "kernel_counters.csv", [dict(row, machine=machine) for row in rows], append=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
