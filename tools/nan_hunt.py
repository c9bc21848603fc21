#!/usr/bin/env python
"""The NaN hunt: batch-1 inference_detector in many fresh processes per variant, each process's detections against
the plain model's (eager fp32) and against the other processes of its variant.

    python tools/nan_hunt.py [CONFIG] [--variants eager:fp32 graph:fp32 eager:bf16 graph:bf16 graph:fp32:poison]
        [--processes 8] [--jobs 4] [--images 4] [--sizes fixed] [--deadline SECONDS] [--out-dir DIR]

CONFIG defaults to DINO R50 (configs/dino). Every process loads the same saved random weights and runs the same
images, the first 480x640. ``:poison`` fills PyTorch's uninitialised allocations with NaN. Writes nan_hunt.md and
nan_hunt.json to --out-dir. The code lives in :mod:`deform_plugin.benchmarks.detector.nan_hunt`.
"""
import sys

from deform_plugin.benchmarks.detector.nan_hunt import main

if __name__ == "__main__":
    sys.exit(main(description=__doc__))
