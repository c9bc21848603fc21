#!/usr/bin/env python
"""Benchmark of the MSDA kernels: correctness first, then latency, memory and floors, as a table, CSV and plot.

For each case (encoder and decoder shapes of Deformable-DETR/DINO, Mask2Former's pixel decoder), dtype and location
distribution it
  1. checks the Triton op's output and gradients against the float64 reference on the same rounded inputs;
  2. times forward, backward and forward+backward with ``triton.testing.do_bench`` (median of L2-flushed runs,
     20th/80th percentiles kept in the CSV) for our Triton op and for the stock mmcv CUDA op when mmcv's compiled
     ops are importable (its im2col_step = gcd(batch, 64)), else for our PyTorch reference;
  3. measures the peak extra memory of forward+backward;
  4. compares with two floors measured on the same card: the DRAM floor (fewest bytes over the measured copy
     bandwidth) and a gather/scatter floor: plain Triton kernels that gather (and atomically scatter) exactly the
     corner rows this case touches, with no interpolation arithmetic.
It prints a machine line and a table with a speedup column, appends rows to a CSV and draws a PNG. The code lives in
``deform_plugin.benchmarks.ops.msda`` and ``deform_plugin.benchmarks.ops.floors``.

Usage (on a CUDA machine):
    python tools/bench_msda.py                       # every case, fp32/fp16/bf16, uniform + realistic
    python tools/bench_msda.py --cases encoder_b2 --dtypes fp32 --dists uniform
    python tools/bench_msda.py --tune                # sweep launch configurations of the Triton kernels
"""
import sys

from deform_plugin.benchmarks.ops.msda import main

if __name__ == "__main__":
    sys.exit(main(description=__doc__))
