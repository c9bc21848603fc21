"""A training run's Triton MSDA kernels compiled in background processes while the run starts.

The first iteration of a run on a machine whose Triton cache is empty compiles every variant of the MSDA kernels
that the model launches, one after another (see :mod:`deform_plugin.ops.msda.precompile`). Started from a hook's
``before_run``, one worker process per kernel variant compiles them all at once into the on-disk cache while the run
initialises its weights and starts its data loader's workers; the run's first launch of a variant waits for its
worker (:mod:`deform_plugin.ops.background_compile`).
"""
from __future__ import annotations

import contextlib
import logging
from typing import List

import torch
from mmengine.logging import print_log


def run_dtypes(optim_wrapper) -> List[str]:
    """float32, and the autocast dtype of an ``AmpOptimWrapper`` (mmengine's, or a subclass; built, or its config
    before the Runner builds it): its ``dtype``, or float16 where it has none (mmengine then autocasts to CUDA's
    default, float16, as with ``--amp``)."""
    from mmengine.optim import AmpOptimWrapper
    from mmengine.registry import OPTIM_WRAPPERS
    dtypes = ["float32"]
    if isinstance(optim_wrapper, dict):
        wrapper_type = optim_wrapper.get("type", "OptimWrapper")
        if isinstance(wrapper_type, str):
            wrapper_type = OPTIM_WRAPPERS.get(wrapper_type)
        amp = isinstance(wrapper_type, type) and issubclass(wrapper_type, AmpOptimWrapper)
        cast = optim_wrapper.get("dtype", None) if amp else None
        cast = getattr(torch, cast) if isinstance(cast, str) else cast
    else:
        amp = isinstance(optim_wrapper, AmpOptimWrapper)
        cast = getattr(optim_wrapper, "cast_dtype", None)
    if cast is None and amp:
        cast = torch.float16
    if isinstance(cast, torch.dtype) and cast != torch.float32:
        dtypes.append(str(cast).replace("torch.", ""))
    return dtypes


def model_msda_variants(model, dtypes) -> list:
    """Every kernel variant the model's MSDA modules may launch: their heads, head size, levels and points, in each
    of ``dtypes``, for reference points and for reference boxes."""
    from deform_plugin.models.msda import MultiScaleDeformableAttention
    from deform_plugin.ops.msda.precompile import MSDAVariant
    shapes = {(m.num_heads, m.embed_dims // m.num_heads, m.num_levels, m.num_points)
              for m in model.modules() if isinstance(m, MultiScaleDeformableAttention)}
    return [MSDAVariant(*shape, dtype=dtype, reference_dim=reference_dim)
            for shape in sorted(shapes) for dtype in dtypes for reference_dim in (2, 4)]


def _triton_compiles_here() -> bool:
    from deform_plugin.ops.triton_support import triton_interpreter_enabled, triton_unavailable_reason
    return (not triton_interpreter_enabled() and torch.cuda.is_available()
            and triton_unavailable_reason(torch.device("cuda")) is None)


def _start_compiles(variants, device, when: str) -> list:
    """Start the variants' compile workers, Triton's JIT targeting ``device`` (None: the current one); a failure to
    start is logged and leaves the run's first launches to compile."""
    from deform_plugin.ops.msda.precompile import precompile_in_background
    try:
        with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
            processes = precompile_in_background(variants)
    except Exception as error:  # ahead of time only: the run's first launches compile and report real errors
        print_log(f"deform_plugin: the background compile of the Triton MSDA kernels did not start ({error!r}); "
                  "the first iteration compiles them", logger="current", level=logging.WARNING)
        return []
    if processes:
        print_log(f"deform_plugin: compiling {len(processes)} Triton MSDA kernel variants in background processes, "
                  f"one per variant{when}", logger="current")
    return processes


def precompile_model_kernels(model, optim_wrapper) -> list:
    """Start compiling the model's MSDA kernel variants in background processes (on CUDA with Triton only); returns
    the processes. Variants this process has compiled, or whose workers it started already, are left out."""
    if not _triton_compiles_here():
        return []
    # Triton's JIT compiles for the current device's target: the model's GPU.
    device = next((p.device for p in model.parameters() if p.is_cuda), None)
    return _start_compiles(model_msda_variants(model, run_dtypes(optim_wrapper)), device, "")


def config_asks_for_precompile(cfg) -> bool:
    """Whether the config's ``custom_hooks`` hold a ``FastPathsHook`` that compiles ahead (``precompile_triton``,
    on by default). The hook is named, not imported: it imports this module."""
    def is_fast_paths_hook(hook_type) -> bool:
        name = hook_type if isinstance(hook_type, str) else getattr(hook_type, "__name__", None)
        return name is not None and name.rsplit(".", 1)[-1] == "FastPathsHook"
    return any(isinstance(hook, dict) and is_fast_paths_hook(hook.get("type")) and hook.get("precompile_triton", True)
               for hook in cfg.get("custom_hooks") or ())


def config_msda_variants(cfg) -> list:
    """The MSDA kernel variants of the config's model and run dtypes, read from a copy of the model built on the meta
    device (no weights, a fraction of a second); [] where that build fails (a model whose construction reads
    tensor values, as Swin's drop-path schedule does)."""
    import copy

    from mmengine.registry import MODELS, DefaultScope
    try:
        with DefaultScope.overwrite_default_scope(cfg.get("default_scope")), torch.device("meta"):
            model = MODELS.build(copy.deepcopy(cfg.model))
    except Exception:
        return []
    return model_msda_variants(model, run_dtypes(cfg.get("optim_wrapper")))


def precompile_config_kernels(cfg) -> list:
    """What :func:`precompile_runner_kernels` starts, started from the config before the Runner is built: building
    it (the model, its move to the GPU, the hooks) takes seconds that the compiles then overlap too, and the run's
    first iteration waits for less. Returns the processes; [] where the config asks for nothing, where Triton does
    not compile here, or where the model cannot be built on the meta device (the Runner's model then starts
    them)."""
    if not config_asks_for_precompile(cfg) or not _triton_compiles_here():
        return []
    variants = config_msda_variants(cfg)
    return _start_compiles(variants, None, ", while the Runner is built") if variants else []


def precompile_runner_kernels(runner) -> list:
    """What ``FastPathsHook(precompile_triton=True)`` starts at ``before_run``, started as soon as the Runner is
    built (``tools/train.py`` calls it before ``runner.train()``): ``train()`` builds the loops' datasets and data
    loaders (tens of seconds for COCO's annotations), the optimizer and the validation loop before ``before_run``,
    and the kernels compile meanwhile. The hook's own call then starts nothing twice. Nothing where no
    ``FastPathsHook`` asks for it."""
    from mmengine.model import is_model_wrapper
    # FastPathsHook is the hook with this switch; it imports this module, so it is found by its switch.
    if not any(getattr(hook, "precompile_triton", False) is True for hook in getattr(runner, "hooks", ())):
        return []
    model = runner.model.module if is_model_wrapper(runner.model) else runner.model
    return precompile_model_kernels(model, getattr(runner, "optim_wrapper", None))
