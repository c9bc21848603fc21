"""``python -m deform_plugin warmup CONFIG``: compile every Triton MSDA kernel variant a config's model launches.

A machine's first run compiles each variant when the model first reaches it (a second or two each, one after
another). Run once per machine (for example while building a container image), this puts them all into Triton's
on-disk cache at once, one process per variant; every later run loads them in milliseconds. Training runs with
``FastPathsHook`` start the same compiles in the background by themselves.
"""
from __future__ import annotations

import time
from typing import List, Sequence


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
    """Compile ``variants`` (one process each with ``parallel``, else one after another here); wall seconds."""
    from deform_plugin.ops.msda.precompile import precompile_in_background, run_variant
    started = time.perf_counter()
    if parallel:
        failed = [process.args for process in precompile_in_background(variants) if process.wait() != 0]
        if failed:
            raise RuntimeError(f"{len(failed)} of {len(variants)} variants failed to compile; first: {failed[0]}")
    else:
        for variant in variants:
            run_variant(variant)
    return time.perf_counter() - started


def run_warmup(config_path: str, dtypes: List[str], parallel: bool = True) -> int:
    import torch

    from deform_plugin.engine.triton_precompile import model_msda_variants
    from deform_plugin.ops.triton_support import triton_interpreter_enabled, triton_unavailable_reason
    reason = ("no CUDA device" if not torch.cuda.is_available() else "Triton runs in its interpreter"
              if triton_interpreter_enabled() else triton_unavailable_reason(torch.device("cuda")))
    if reason is not None:
        print(f"error: warmup compiles Triton kernels for a CUDA device, and here: {reason}")
        return 2
    variants = model_msda_variants(model_from_config(config_path), dtypes)
    if not variants:
        print(f"{config_path}: its model has no deform_plugin MSDA module: nothing to compile")
        return 0
    seconds = compile_variants(variants, parallel)
    how = "in parallel processes" if parallel else "one after another"
    print(f"compiled {len(variants)} Triton MSDA kernel variants ({', '.join(dtypes)}) {how} in {seconds:.1f} s")
    return 0
