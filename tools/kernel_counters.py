#!/usr/bin/env python
"""Hardware counters (Nsight Compute) of the MSDA and deformable-SDPA kernels: which unit bounds each one.

    python tools/kernel_counters.py --out DIR [--targets sdpa:fp32 msda:encoder_b2:uniform:fp32
                                               msda-fused:encoder_b2:bf16] [--ncu PATH]

Run from the repository root on a GPU host whose ncu can read the counters. See
:mod:`deform_plugin.benchmarks.ops.counters`.
"""
import sys

from deform_plugin.benchmarks.ops.counters import main

if __name__ == "__main__":
    sys.exit(main(description=__doc__))
