#!/usr/bin/env python
"""compute-sanitizer (memcheck, initcheck, racecheck) over every Triton kernel, one captured training step and one
graph inference; one table of what each tool reported, with the kernel it named.

    python tools/sanitize_kernels.py --out DIR [--tools memcheck initcheck racecheck] [--cases all | KIND:DTYPE ...]
        [--group-dtypes] [--jobs 8] [--timeout 300] [--deadline SECONDS] [--sanitizer PATH]
    python tools/sanitize_kernels.py --out DIR --native [--device cpu --tiny]   # the targets alone, no sanitizer

Cases: msda:{fp32,fp16,bf16,fp64}, msda-fused:{...}, sdpa:{fp32,fp16,bf16}, nms:fp32, graph-train:{fp32,bf16},
graph-infer:{fp32,bf16}, and control:{fp32,bf16} (no code of ours: what a tool reports there is the tool's);
--group-dtypes runs each kind's dtypes in one process per tool. Each case first runs natively with NaN-poisoned
allocations (which also warms Triton's cache). Writes DIR/sanitize.md, DIR/sanitize.json and DIR/logs/. Exit
status 0: every run clean and every check passed; 1: something reported or failed; 2: no compute-sanitizer or no
GPU. The code lives in :mod:`deform_plugin.benchmarks.sanitizer`.
"""
import sys

from deform_plugin.benchmarks.sanitizer.run import main

if __name__ == "__main__":
    sys.exit(main(description=__doc__))
