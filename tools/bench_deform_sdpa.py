#!/usr/bin/env python
"""Benchmark deformable SDPA: the PyTorch baseline (grid_sample, then attention) against the fused Triton kernels.

Sweeps the image size at the seed's configuration (B=2, V=8, S=32, H=16, D=32; 14x14 is the seed's own point) and
reports latency (``triton.testing.do_bench`` median, 20th and 80th percentiles) and peak memory for the forward,
the backward and forward+backward, with the speedup and memory ratio against the baseline timed in the same run,
and the Triton forward's relative error against float64 (||triton - float64|| / ||float64||).

Usage:
    python tools/bench_deform_sdpa.py --out bench_out                  # fp32, sizes 8..32
    python tools/bench_deform_sdpa.py --out bench_out --dtype bf16 --sizes 14 32

Writes ``DIR/bench_deform_sdpa.csv`` (rows appended) and ``DIR/latency_<dtype>.png``, ``DIR/memory_<dtype>.png``.
Peak memory is the largest allocation above what the inputs already hold, during one call. The code lives in
``deform_plugin.benchmarks.ops.deform_sdpa``.
"""
import os
import sys

if "--smoke-cpu" in sys.argv:
    # Triton reads this when a kernel is decorated, that is when deform_plugin's Triton modules are imported below.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from deform_plugin.benchmarks.ops.deform_sdpa import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(description=__doc__))
