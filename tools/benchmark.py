#!/usr/bin/env python
"""Whole-detector benchmark (and profile) of mmdet configs on synthetic batches, several variants in one run.

A *row* is ``BACKEND:MODE[:FAST]``, timed on every config given:

    BACKEND  stock    mmdet/mmcv untouched: a child process that never imports deform_plugin (drops the config's
                      deform_plugin imports and fast paths); needs mmcv's compiled ops on CUDA
             mmcv | pytorch | triton | auto
                      deform_plugin's MSDA module with that backend (``set_default_backend``)
    MODE     fp32 | fp16 | bf16    (fp16/bf16 = mmengine ``AmpOptimWrapper`` with that dtype; autocast at inference)
    FAST     config (default: whatever the config selects) | none | all (every exact one) | a '+' list of
             optim (merged param groups + fused/foreach optimizer), sdpa (SDPA attention bricks),
             matching (batched Hungarian matching), losses (sync-free loss normalisers), batched (every
             layer's loss in one pass), forward (sync-free forward), graph (graph inference), buckets
             (ShapeBucketsHook's training padding: the config's divisor, else 128; not exact)

The first row is the baseline of the speedup columns. Examples::

    # stock fp32 vs ours fp32 / bf16 with every fast path, three detectors, JSON/CSV/PNG in bench_results/
    python tools/benchmark.py \\
        configs/deformable_detr/deformable-detr-refine-twostage_r50_16xb2-50e_coco_deform-plugin.py \\
        configs/dino/dino-4scale_r50_8xb2-12e_coco_deform-plugin.py \\
        --rows stock:fp32 triton:fp32:all triton:bf16:all --out-dir bench_results/h100

    # CPU smoke run
    python tools/benchmark.py configs/demo/deformable-detr-refine_r18_tiny_1xb4-500i_shapes.py \\
        --device cpu --shape 128 160 --steps 2 --warmup 1 --rows pytorch:fp32:none pytorch:fp32:all

Each timed training step is mmengine's ``model.train_step`` (data preprocessor, forward, loss, backward, clip,
optimizer step, zero_grad) on one fixed synthetic batch, bracketed by device synchronisation. The image size is
--shape, else the config's own (the first fixed size of its training pipeline, then of its test pipeline); a size
the model cannot take is refused with the reason. ``--variable-sizes N`` adds N steps on batches of new
random-resize sizes (the DETR pipelines' distribution), then the same batches again: the cost of a new input size.
``--profile`` adds a torch.profiler breakdown per row (see
``tools/profile_step.py``). The code lives in the ``deform_plugin.benchmarks.detector`` package.
"""
import os

# Before anything loads torch's OpenMP runtime: idle threads sleep instead of spinning (deform_plugin/cpu_threads.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import sys  # noqa: E402

from deform_plugin.benchmarks.detector.run import build_parser, main
from deform_plugin.cli import check_cfg_options_of, require_path
from deform_plugin.cpu_threads import configure_cpu_threads

if __name__ == "__main__":
    # Parsed here too, for the checks of deform_plugin.cli: the benchmarks' modules import none of the rest of
    # deform_plugin (their stock rows run in processes that never import it).
    args = build_parser(__doc__).parse_args()
    for config in args.configs:
        require_path("config", config)
    check_cfg_options_of(args.configs, [item.split("=", 1)[0] for item in args.cfg_options or ()])
    configure_cpu_threads()
    sys.exit(main(description=__doc__))
