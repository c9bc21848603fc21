#!/usr/bin/env python
"""Profile training steps of mmdet configs: time by component, GPU-busy fraction, kernels, host syncs, host time.

The arguments of ``tools/benchmark.py`` (configs, ``--rows BACKEND:MODE[:FAST]``, ``--shape``, ``--out-dir``,
``--trace``, ...), profiling only: per row, one step outside the profiler, then ``--profile-steps`` steps under
torch.profiler, each running mmengine's train_step pieces in named ranges (forward, backward, optimizer) and the
assigners' matching in its range; deform_plugin's MSDA op names its own range. Per step it reports:

  - device time by component: CUDA kernel time (CPU op self-time with --device cpu) in MSDA, GEMM, convolution,
    optimizer (clip + step + zero_grad), matching (assigners), elementwise, memcpy and other;
  - host time by component (the CPU time that issued that work) on CUDA rows;
  - the GPU-busy fraction of the step's wall time, kernels per step, host syncs per step (synchronising CUDA
    runtime calls) and host reads per step (aten::_local_scalar_dense: .item() and friends);
  - host time in each named range (forward, backward, optimizer, matching, msda, wait_for_device).

Outputs: NAME.json, NAME.csv, NAME.md (NAME defaults to 'profile'), a stacked-bar PNG (NAME.png) and, with
--trace, one Chrome trace per row. Example::

    python tools/profile_step.py configs/dino/dino-4scale_r50_8xb2-12e_coco_deform-plugin.py \\
        --rows mmcv:fp32:none triton:bf16:all --profile-steps 3 --out-dir bench_results/profile --trace
"""
import sys

from deform_plugin.benchmarks.detector.run import main

if __name__ == "__main__":
    sys.exit(main(description=__doc__, profile_only=True, name="profile"))
