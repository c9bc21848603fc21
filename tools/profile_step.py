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

Outputs, in --out-dir (default: work_dirs/profile/<config stem>): NAME.json, NAME.csv, NAME.md (NAME defaults to
'profile'), a stacked-bar PNG (NAME.png) and, with --trace, one Chrome trace per row. Example::

    python tools/profile_step.py configs/dino/dino-4scale_r50_8xb2-12e_coco_deform-plugin.py \\
        --rows mmcv:fp32:none triton:bf16:all --profile-steps 3 --out-dir bench_results/profile --trace
"""
import os

# Before anything loads torch's OpenMP runtime: idle threads sleep instead of spinning (deform_plugin/cpu_threads.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import sys  # noqa: E402

from deform_plugin.benchmarks.detector.run import build_parser, main
from deform_plugin.cli import check_cfg_options_of, require_path
from deform_plugin.cpu_threads import configure_cpu_threads

PROFILE_DEFAULTS = dict(profile_only=True, name="profile")


def default_out_dir(configs) -> str:
    stem = os.path.splitext(os.path.basename(configs[0]))[0]
    return os.path.join("work_dirs", "profile", stem + (f"_and_{len(configs) - 1}_more" if len(configs) > 1 else ""))


if __name__ == "__main__":
    argv = sys.argv[1:]
    # Parsed here too, for the checks of deform_plugin.cli: the benchmarks' modules import none of the rest of
    # deform_plugin (their stock rows run in processes that never import it).
    args = build_parser(__doc__, profile_only=True).parse_args(argv)
    for config in args.configs:
        require_path("config", config)
    check_cfg_options_of(args.configs, [item.split("=", 1)[0] for item in args.cfg_options or ()])
    if args.out_dir is None:
        argv += ["--out-dir", default_out_dir(args.configs)]
        print(f"the report goes to {argv[-1]} (--out-dir to choose another folder)", flush=True)
    configure_cpu_threads()
    sys.exit(main(argv, description=__doc__, **PROFILE_DEFAULTS))
