"""``python -m deform_plugin warmup CONFIG``: compile every Triton MSDA kernel variant a config's model launches.

A machine's first run compiles each variant when the model first reaches it (1-6 s each on a CPU host, one after
another). Run once per machine (for example while building a container image), this puts them all into Triton's
on-disk cache at once, one worker process per variant; every later run loads them in milliseconds. With ``--arch``
it compiles for that GPU architecture on a machine without a GPU (``--arch 90``: H100/H200). Training runs with
``FastPathsHook`` start the same compiles in the background by themselves.
"""
from __future__ import annotations

import time
from typing import List, Optional, Sequence


def model_from_config(config_path: str):
    """The config's model, built on the CPU with its initial weights (no checkpoint, no download)."""
    from mmdet.registry import MODELS
    from mmdet.utils import register_all_modules
    from mmengine.config import Config
    from mmengine.registry import init_default_scope
    cfg = Config.fromfile(config_path)
    register_all_modules(init_default_scope=False)
    init_default_scope(cfg.get("default_scope", "mmdet"))
    return MODELS.build(cfg.model)


def compile_variants(variants: Sequence, parallel: bool = True) -> float:
    """Compile ``variants``' kernels (one worker process per kernel variant with ``parallel``, else one after another
    here) for the active GPU target; wall seconds."""
    from deform_plugin.ops.background_compile import compile_jobs_here, start_background_compiles
    from deform_plugin.ops.msda.precompile import compile_jobs
    started = time.perf_counter()
    jobs = compile_jobs(variants)
    if parallel:
        processes = start_background_compiles(jobs)
        failed = [process.args for process in processes if process.wait() != 0]
        if failed:
            raise RuntimeError(f"{len(failed)} of {len(processes)} kernel variants failed to compile; the first "
                               f"worker's command: {failed[0]}")
    else:
        compile_jobs_here(jobs)
    return time.perf_counter() - started


def unavailable_reason(arch: Optional[int]) -> Optional[str]:
    """Why the kernels cannot be compiled here, or None: a CUDA device, or ``arch`` without one."""
    import torch

    from deform_plugin.ops.triton_support import triton_interpreter_enabled, triton_unavailable_reason
    if triton_interpreter_enabled():
        return "Triton runs in its interpreter (TRITON_INTERPRET is set)"
    if arch is not None:
        return triton_unavailable_reason(torch.device("cuda"))
    if not torch.cuda.is_available():
        return "no CUDA device (--arch compiles for a GPU architecture without one)"
    return triton_unavailable_reason(torch.device("cuda"))


def run_warmup(config_path: str, dtypes: List[str], parallel: bool = True, arch: Optional[int] = None) -> int:
    reason = unavailable_reason(arch)
    if reason is not None:
        print(f"error: warmup compiles Triton kernels for a CUDA device, and here: {reason}")
        return 2
    if arch is not None:
        from deform_plugin.ops.compile_worker import use_compile_only_target
        use_compile_only_target("cuda", arch)
    from deform_plugin.engine.triton_precompile import model_msda_variants
    variants = model_msda_variants(model_from_config(config_path), dtypes)
    if not variants:
        print(f"{config_path}: its model has no deform_plugin MSDA module: nothing to compile")
        return 0
    seconds = compile_variants(variants, parallel)
    how = "in parallel processes" if parallel else "one after another"
    target = f" for sm_{arch}" if arch is not None else ""
    print(f"compiled the Triton MSDA kernels of {len(variants)} variants ({', '.join(dtypes)}){target} {how} in "
          f"{seconds:.1f} s")
    return 0
