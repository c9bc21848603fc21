"""The Triton MSDA kernel variants that a model will launch, compiled ahead of its first step in parallel processes.

A process's first launch of each kernel variant compiles it (on a CPU host: 1-1.6 s for a forward variant, 3.6-5.6 s
for a backward one; docs/kernels.md), and a training run's first iteration launches them one after another: the
fused forward and backward, for point and box reference points, in each dtype the run computes in. Compiled binaries
land in Triton's on-disk cache (``TRITON_CACHE_DIR``, by default ``~/.triton/cache``), which every later process
reads in milliseconds.

:func:`compile_jobs` records the launches a small fused call of each variant would make (CPU tensors of the
variant's dtypes; nothing runs) and asks Triton's JIT for their specializations;
:func:`precompile_in_background` compiles each in a worker process of its own
(:mod:`deform_plugin.ops.background_compile`) while the caller goes on; the caller's first launch of a variant waits
for its worker instead of compiling it again.
"""
from __future__ import annotations

import subprocess
from dataclasses import dataclass
from typing import Iterable, List

import torch

from ..background_compile import CompileJob, capture_job, start_background_compiles
from .triton_launch import KernelLaunch, recorded_fused_launches

DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class MSDAVariant:
    """What selects a compiled variant of the fused kernels (image sizes and query counts do not)."""

    num_heads: int
    head_dim: int
    num_levels: int
    num_points: int
    dtype: str = "float32"
    reference_dim: int = 2  # 2: reference points; 4: reference boxes

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"MSDAVariant: dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.reference_dim not in (2, 4):
            raise ValueError(f"MSDAVariant: reference_dim must be 2 or 4, got {self.reference_dim!r}")
        for name in ("num_heads", "head_dim", "num_levels", "num_points"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MSDAVariant: {name} must be an int >= 1, got {value!r}")


def variant_launches(variant: MSDAVariant, backward: bool = True) -> List[KernelLaunch]:
    """The launches of a small fused MSDA call of ``variant`` (forward, and backward with ``backward``), recorded on
    CPU tensors, not made. As in the DETRs' training steps: value, offsets and logits (and so the output's gradient)
    in the variant's dtype, which under autocast is the dtype of the Linear layers that make them; reference points
    in float32 and without gradient (the DETRs make them outside any matmul, as constants or detached)."""
    dtype = getattr(torch, variant.dtype)
    shapes = [(max(8 >> level, 1), max(10 >> level, 1)) for level in range(variant.num_levels)]
    spatial_shapes = torch.tensor(shapes, dtype=torch.int64)
    sizes = spatial_shapes.prod(1)
    level_start_index = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)[:-1]])
    batch, queries = 1, 5
    value = torch.zeros(batch, int(sizes.sum()), variant.num_heads, variant.head_dim, dtype=dtype)
    reference = torch.zeros(batch, queries, variant.num_levels, variant.reference_dim)
    offsets = torch.zeros(batch, queries, variant.num_heads, variant.num_levels, variant.num_points, 2, dtype=dtype)
    logits = torch.zeros(batch, queries, variant.num_heads, variant.num_levels, variant.num_points, dtype=dtype)
    return recorded_fused_launches(value, spatial_shapes, level_start_index, reference, offsets, logits,
                                   backward=backward, reference_grad=False)


def compile_jobs(variants: Iterable[MSDAVariant], backward: bool = True) -> List[CompileJob]:
    """The compile jobs of the variants' kernels for the active GPU target, the backward ones (the longest) first;
    variants this process has compiled already are left out. Needs a process where Triton compiles (CUDA, or a
    compile-only target: :func:`deform_plugin.ops.compile_worker.use_compile_only_target`)."""
    jobs = {}
    for variant in dict.fromkeys(variants):
        for launch in variant_launches(variant, backward):
            job = capture_job(*launch)
            if job is not None:
                jobs.setdefault((job.function, job.variant), job)
    return sorted(jobs.values(), key=lambda job: "backward" not in job.function)


def precompile_in_background(variants: Iterable[MSDAVariant], backward: bool = True) -> List[subprocess.Popen]:
    """Start compiling the variants' kernels, one worker process per kernel variant; returns the processes started
    (running). A failed worker only means that the caller's first launch compiles that variant itself."""
    return start_background_compiles(compile_jobs(variants, backward))
