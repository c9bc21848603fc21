"""The fused MSDA backward's sums across threads add rounded products only, checked in its sm_90 PTX (no GPU).

Where a thread's own product is fused into the first cross-thread addition of a ``tl.sum`` (an FMA: its product
unrounded, its partner's rounded), the threads that replicate the sum hold values a few ulps apart and race to write
them to shared memory (compute-sanitizer racecheck on an H200; ``_sum_of_products`` in the kernel file says why).
In PTX a cross-thread addition is a ``shfl.sync.bfly`` whose result the next instruction that reads it combines.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
_NVIDIA_BACKEND = importlib.util.find_spec("triton") is not None and \
    importlib.util.find_spec("triton.backends.nvidia") is not None

# Runs without the interpreter, which the test session sets: Triton compiles for sm_90 and launches nothing.
_BUTTERFLY_COMBINES = """
import json
import torch
from deform_plugin.ops.compile_worker import use_compile_only_target
from deform_plugin.ops.msda.triton_launch import recorded_fused_launches

def butterfly_combines(ptx):
    lines = ptx.splitlines()
    combines = fused = 0
    for index, line in enumerate(lines):
        words = line.split()
        if not words or words[0] != "shfl.sync.bfly.b32":
            continue
        shuffled = words[1].rstrip(",")
        for later in lines[index + 1:index + 8]:
            opcode, *operands = later.split() or [""]
            if shuffled in [operand.strip(",;") for operand in operands] and opcode.split(".")[0] in ("add", "fma"):
                combines += 1
                fused += opcode.startswith("fma.")
                break
    return [combines, fused]

use_compile_only_target("cuda", 90)
counts = {}
shapes = torch.tensor([[8, 10], [4, 5]])
sizes = shapes.prod(1)
starts = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)[:-1]])
# head_dim 24, below its 32-channel block (the channel mask is live): there sm_90's compiler fuses a plain
# tl.sum(a * b)'s products into the additions (at the DETRs' 32 it happened not to).
for head_dim in (24,):
    value = torch.zeros(1, int(sizes.sum()), 8, head_dim)
    launches = recorded_fused_launches(value, shapes, starts, torch.zeros(1, 5, 2, 2), torch.zeros(1, 5, 8, 2, 4, 2),
                                       torch.zeros(1, 5, 8, 2, 4), backward=True)
    for launch in launches:
        compiled = launch.kernel.warmup(*launch.tensors, *launch.scalars, grid=launch.grid,
                                        num_warps=launch.num_warps, num_stages=launch.num_stages)
        counts[f"{compiled.name} D{head_dim}"] = butterfly_combines(compiled.asm["ptx"])
print(json.dumps(counts))
"""


@pytest.mark.slow
@pytest.mark.skipif(not _NVIDIA_BACKEND, reason="compiles for sm_90 with the triton wheel's NVIDIA backend and ptxas")
def test_the_fused_backwards_cross_thread_sums_add_rounded_products(tmp_path):
    environment = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    environment["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    completed = subprocess.run([sys.executable, "-c", _BUTTERFLY_COMBINES], capture_output=True, text=True,
                               timeout=600, env=environment, cwd=ROOT)
    assert completed.returncode == 0, completed.stderr[-3000:]
    counts = json.loads(completed.stdout.strip().splitlines()[-1])
    # The backward sums a query's channels for every sample (the softmax backward's sum too): many cross-thread
    # additions, and none of them an FMA.
    combines, fused = counts["msda_backward_kernel D24"]
    assert combines >= 50 and fused == 0, counts
