#!/usr/bin/env python
"""Host time of a DETR step's matching pass (cost terms, copy to the host, assignments), per head shape.

    python tools/bench_matching.py [--cases dino deformable-detr] [--gts 7 13] [--out DIR]

Run from the repository root. See :mod:`deform_plugin.benchmarks.detector.matching_pass`.
"""
import sys

from deform_plugin.benchmarks.detector.matching_pass import main

if __name__ == "__main__":
    sys.exit(main(description=__doc__))
