#!/usr/bin/env python
"""Batch-1 inference of whole detectors, stock against ours, on images of mixed real sizes.

    python tools/benchmark_infer.py CONFIG [CONFIG ...] [--rows stock:fp32 eager:fp32 graph:fp32 eager:bf16
        graph:bf16] [--sizes coco16 distinct fixed] [--images 64] [--warmup 10] [--out-dir DIR]

Each row runs ``mmdet.apis.inference_detector`` image by image in a process of its own (stock: mmdet and mmcv as
installed, never importing deform_plugin), on the same random weights and images. Size distributions: ``coco16``
(the 16 commonest COCO val2017 sizes, cycling), ``distinct`` (every image a size of its own, sides 300-1333 px),
``fixed`` (480 x 640 only: a speed-up that holds only when sizes repeat). Writes inference.md, .csv, .json and
.png to --out-dir. The code lives in the ``deform_plugin.benchmarks.detector.inference`` module.
"""
import sys

from deform_plugin.benchmarks.detector.inference import main

if __name__ == "__main__":
    sys.exit(main(description=__doc__))
