#!/usr/bin/env python
"""The MSDA entries users call (op, fused op, module) against mmcv's, eager and in CUDA graphs, with host time.

    python tools/bench_msda_entry.py [--cases encoder_b2,decoder_q300,decoder_q900,mask2former_b2]
                                     [--dtypes fp32,bf16] [--dists uniform] [--out bench_results]

See :mod:`deform_plugin.benchmarks.ops.msda_entry`.
"""
import sys

from deform_plugin.benchmarks.ops.msda_entry import main

if __name__ == "__main__":
    sys.exit(main(description=__doc__))
