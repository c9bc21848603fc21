"""A training run's Triton MSDA kernels compiled in background processes while the run starts.

The first iteration of a run on a machine whose Triton cache is empty compiles every variant of the MSDA kernels
that the model launches, one after another (see :mod:`deform_plugin.ops.msda.precompile`). Started from a hook's
``before_run``, one process per variant compiles them into the on-disk cache while the run initialises its weights
and starts its data loader's workers.
"""
from __future__ import annotations

from typing import List

import torch
from mmengine.logging import print_log


def run_dtypes(optim_wrapper) -> List[str]:
    """float32, and the autocast dtype of an ``AmpOptimWrapper`` (mmengine's, or a subclass)."""
    dtypes = ["float32"]
    cast = getattr(optim_wrapper, "cast_dtype", None)
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


def precompile_model_kernels(model, optim_wrapper) -> list:
    """Start compiling the model's MSDA kernel variants in background processes (on CUDA with Triton only); returns
    the processes."""
    from deform_plugin.ops.msda.precompile import precompile_in_background
    from deform_plugin.ops.triton_support import triton_interpreter_enabled, triton_unavailable_reason
    if (triton_interpreter_enabled() or not torch.cuda.is_available()
            or triton_unavailable_reason(torch.device("cuda")) is not None):
        return []
    variants = model_msda_variants(model, run_dtypes(optim_wrapper))
    processes = precompile_in_background(variants)
    if processes:
        print_log(f"deform_plugin: compiling {len(processes)} Triton MSDA kernel variants in background processes",
                  logger="current")
    return processes
