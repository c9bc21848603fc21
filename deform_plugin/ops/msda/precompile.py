"""Compile the Triton MSDA kernels that a model will launch, ahead of its first step and in parallel processes.

A process's first launch of each kernel variant compiles it (about a second or two each), and a training run's first
iteration launches them one after another: the fused forward and backward, for point and box reference points, in
each dtype the run computes in. Compiled binaries land in Triton's on-disk cache (``TRITON_CACHE_DIR``, by default
``~/.triton/cache``), which every later process reads in milliseconds. :func:`precompile_in_background` starts one
process per variant that compiles it into that cache while the caller goes on building its model and data loaders;
a variant that the caller reaches before its process is done is compiled by the caller as it would have been.

    python -m deform_plugin.ops.msda.precompile '[{"num_heads": 8, "head_dim": 32, "num_levels": 4,
                                                   "num_points": 4, "dtype": "bfloat16", "reference_dim": 4}]'
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Iterable, List, Sequence

import torch

from .functional import fused_multi_scale_deformable_attn

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


def run_variant(variant: MSDAVariant, device="cuda", backward: bool = True) -> torch.Tensor:
    """One small fused MSDA call of ``variant`` (forward, and backward with ``backward``): the launches that compile
    its kernels. Returns the output."""
    dtype = getattr(torch, variant.dtype)
    shapes = [(max(8 >> level, 1), max(10 >> level, 1)) for level in range(variant.num_levels)]
    spatial_shapes = torch.tensor(shapes, dtype=torch.int64, device=device)
    sizes = torch.tensor([h * w for h, w in shapes], device=device)
    level_start_index = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)[:-1]])
    generator = torch.Generator(device="cpu").manual_seed(0)

    def tensor(*shape, scale=1.0):
        return (torch.rand(*shape, generator=generator) * scale).to(device=device, dtype=dtype).requires_grad_(
            backward)
    batch, queries = 1, 5
    value = tensor(batch, int(sizes.sum()), variant.num_heads, variant.head_dim)
    # Reference points stay float32 whatever the compute dtype: under autocast the DETRs make them outside any
    # matmul. Their dtype is part of the compiled variant's key.
    reference = torch.rand(batch, queries, variant.num_levels, variant.reference_dim,
                           generator=generator).to(device=device)
    offsets = tensor(batch, queries, variant.num_heads, variant.num_levels, variant.num_points, 2)
    logits = tensor(batch, queries, variant.num_heads, variant.num_levels, variant.num_points)
    output = fused_multi_scale_deformable_attn(value, spatial_shapes, level_start_index, reference, offsets, logits,
                                               backend="triton")
    if backward:
        output.float().sum().backward()
    return output


def precompile_in_background(variants: Iterable[MSDAVariant], backward: bool = True) -> List[subprocess.Popen]:
    """One process per variant that compiles it into Triton's on-disk cache; returns them (already running).
    Their output is discarded: a failure only means the caller compiles that variant itself."""
    processes = []
    for variant in dict.fromkeys(variants):
        command = [sys.executable, "-m", __name__, json.dumps([asdict(variant)])]
        if not backward:
            command.append("--forward-only")
        processes.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          start_new_session=True))
    return processes


def main(argv: Sequence[str]) -> int:
    if not argv:
        raise SystemExit(__doc__)
    variants = [MSDAVariant(**spec) for spec in json.loads(argv[0])]
    for variant in variants:
        run_variant(variant, backward="--forward-only" not in argv[1:])
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
