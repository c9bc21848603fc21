"""CPU threads of the tools: an OpenMP wait policy and a thread count that suit a small machine shared with others.

Why: torch's OpenMP threads spin while they wait for work (the runtime's default active wait policy). On a 2-core
machine with another busy process, the spinning threads took the cores from the threads doing the work: a training
iteration of the demo measured 18.5 s instead of 1.1 s with ``OMP_WAIT_POLICY=PASSIVE``, under which idle threads
sleep; on an idle machine passive waiting costs nothing measurable. And torch starts one thread per core of the
machine, which can exceed the CPUs this process may use (``taskset``, a container's CPU quota).

The wait policy is read once, when torch loads its OpenMP runtime, so each tool sets it in ``os.environ`` at its
very top, before anything imports torch (``os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")``); a value that
the user set wins. :func:`configure_cpu_threads`, called at a tool's start, lowers torch's thread count to the CPUs
available unless the user set ``OMP_NUM_THREADS``. This module imports only the standard library at module level.

GPU inference in the user's own process (``inference_detector`` at batch 1) needs few torch CPU threads, and many
cost time: the test pipeline's one large torch op (PackDetInputs' HWC -> CHW copy) wakes every OpenMP worker,
which then spins while OpenCV's resize threads and the main thread want the same cores. On a 16-core H200 host,
DINO's batch-1 host phases (pipeline and preprocessing) took 9.9 ms per image with torch's 16 threads and 2.2 ms
with 4 (or with the passive wait policy); the GPU part was 8.6 ms either way. :func:`cap_threads_for_gpu_inference`
lowers the count for that case.
"""
from __future__ import annotations

import math
import os
from typing import Optional

CPU_QUOTA_FILE = "/sys/fs/cgroup/cpu.max"


def cgroup_cpu_limit(path: str = CPU_QUOTA_FILE) -> Optional[int]:
    """The CPUs a cgroup v2 quota allows this process (``cpu.max``: ``'200000 100000'`` -> 2), None without one."""
    try:
        with open(path) as handle:
            quota, period = handle.read().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return max(1, math.ceil(int(quota) / int(period)))


def available_cpus() -> int:
    """The CPUs this process may run on: its affinity mask, capped by a cgroup CPU quota."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    limit = cgroup_cpu_limit()
    return min(cpus, limit) if limit is not None else cpus


# torch CPU threads kept for batch-1 GPU inference: enough for the pipeline's tensor copies, few enough to leave
# the cores to OpenCV and the main thread (see the module).
GPU_INFERENCE_CPU_THREADS = 4


def check_thread_limit(limit: Optional[int]) -> None:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"cpu_threads must be a positive integer or None, got {limit!r}")


def cap_threads_for_gpu_inference(limit: Optional[int] = GPU_INFERENCE_CPU_THREADS) -> Optional[int]:
    """Lower torch's CPU thread count to ``limit`` for a process that runs inference on the GPU (see the module).

    A thread count that the user chose (``OMP_NUM_THREADS``) is kept, as is a count already at or below ``limit``;
    ``limit=None`` keeps it whatever it is. Returns the count set, or None where nothing changed.
    """
    check_thread_limit(limit)
    if limit is None or os.environ.get("OMP_NUM_THREADS", "").strip():
        return None
    import torch

    if torch.get_num_threads() <= limit:
        return None
    torch.set_num_threads(limit)
    return limit


def configure_cpu_threads() -> Optional[int]:
    """At most one torch thread per available CPU, unless ``OMP_NUM_THREADS`` is set (then torch follows it).

    Returns the thread count set, or None where the user's setting was kept. torch's own default (one thread per
    physical core) is kept where it is lower.
    """
    if os.environ.get("OMP_NUM_THREADS", "").strip():
        return None
    import torch

    threads = min(torch.get_num_threads(), available_cpus())
    torch.set_num_threads(threads)
    return threads
