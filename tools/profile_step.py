#!/usr/bin/env python
"""Profile training steps of mmdet configs: time by component, GPU-busy fraction, kernels per step, host time.

Same arguments as ``tools/benchmark.py`` (rows, configs, shape, --out-dir, --trace); this entry point only profiles
(``--profile-only``), writing per row: CUDA (or, on CPU, CPU) time per step in MSDA, GEMM, convolution, optimizer
(clip + step + zero_grad), matching (assigners), elementwise, memcpy and other kernels; the GPU-busy fraction of the
step's wall time; kernels per step; host time in matching, optimizer and backward; a stacked-bar PNG
(NAME_profile.png) and, with --trace, one Chrome trace per row. Example::

    python tools/profile_step.py configs/dino/dino-4scale_r50_8xb2-12e_coco_deform-plugin.py \\
        --rows mmcv:fp32:none triton:bf16:all --profile-steps 3 --out-dir bench_results/profile --trace
"""
import importlib.util
import os
import sys

# Not named tools/profile_step.py: with tools/ first on sys.path (as for every `python tools/X.py`), that file would
# shadow the standard library's `profile`, which cProfile (imported by torch and mmengine) imports.
TOOLS_DIR = os.path.dirname(os.path.abspath(__file__))


def _load_benchmark():
    spec = importlib.util.spec_from_file_location("deform_plugin_tools_benchmark",
                                                  os.path.join(TOOLS_DIR, "benchmark.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--profile-only" not in argv:
        argv.append("--profile-only")
    if "--name" not in argv:
        argv += ["--name", "profile"]
    return _load_benchmark().main(argv)


if __name__ == "__main__":
    sys.exit(main())
