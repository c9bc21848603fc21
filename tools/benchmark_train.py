#!/usr/bin/env python
"""Training speed along the user's path: stock mmdet/mmcv and deform_plugin rows, each in its own process.

Each row trains a config for ``--iters`` iterations with the training script a user runs (mmdet's own
``tools/train.py`` for ``stock`` rows, ours for ``ours`` rows) and mmengine's Runner, the config's own train pipeline
reading a synthetic COCO-like set (detection and instance segmentation configs) or COCO-panoptic-like set (panoptic
configs); a hook times windows of iterations with device syncs at the window ends only::

    python tools/benchmark_train.py \\
        configs/fast/deformable-detr-refine-twostage_r50_16xb2-50e_coco_deform-plugin-fast.py \\
        --rows stock:fp32 ours:fp32 ours:bf16 --iters 100 --batch-size 2 --workers 4 --out-dir bench_results/train

Rows are ``SIDE:MODE`` (``stock`` | ``ours``, ``fp32`` | ``fp16`` | ``bf16``); the first is the speedup baseline.
Stock rows need mmcv with its compiled ops on a GPU. The table (steady-state img/s over the second half of the
run, whole-run and first-20 img/s, our kernel compile count, peak memory, speedup) is printed and written with
JSON, CSV and the rows' logs and overlay configs into ``--out-dir``. ``--gpus 1 4`` runs every row on one GPU, then
on four, and adds the scaling against one GPU and, under ``FlatGradientsDataParallel``, each rank's compute,
all-reduce, wait for slower ranks and communication per step. See :mod:`deform_plugin.benchmarks.detector.user_path`.
"""
import os

# Before anything loads torch's OpenMP runtime: idle threads sleep instead of spinning (deform_plugin/cpu_threads.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import sys  # noqa: E402

from deform_plugin.benchmarks.detector.user_path import build_parser, main
from deform_plugin.cli import require_path

if __name__ == "__main__":
    # Parsed here too, for the checks of deform_plugin.cli: the benchmarks' modules import none of the rest of
    # deform_plugin (their stock rows run in processes that never import it). Each row's training process sets its own
    # threads, as tools/train.py does.
    for config in build_parser().parse_args(sys.argv[1:]).configs:
        require_path("config", str(config))
    sys.exit(main(sys.argv[1:]))
