#!/usr/bin/env python
"""AP parity over seeds: stock mmdet/mmcv against deform_plugin's fast configs, trained from the same initial weights
on the embedded shapes set, many runs at once; bbox mAP mean ± std per row, the target check, loss curves.

    python tools/ap_parity.py --rows stock:fp32 ours:fp32 ours:bf16 ours:bf16:no-buckets --iters auto \\
        --deadline 520 --work-dir /tmp/ap_parity --out-dir results

    python tools/ap_parity.py --device cpu --configs demo --rows stock:fp32 ours:fp32 --seeds 0 --iters 30 \
        --warmup-iters 5 --scales 96 128 --test-scale 128 --val-images 16

``--dry-run`` prints the plan and the derived configs, ``--report-only WORK_DIR`` aggregates finished runs again.
See deform_plugin/benchmarks/detector/ap_parity.py.
"""
import time

STARTED = time.time()  # --deadline counts from here, the imports included

import os  # noqa: E402

# Before anything loads torch's OpenMP runtime: idle threads sleep instead of spinning (deform_plugin/cpu_threads.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import sys  # noqa: E402

from deform_plugin.benchmarks.detector.ap_parity import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], started=STARTED))
