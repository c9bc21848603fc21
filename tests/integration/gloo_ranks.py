"""Tests that need several processes joined by a gloo process group (torch.distributed on the CPU)."""
import os


def run_gloo_ranks(worker, *args, world_size: int = 2, timeout_s: float = 240.0) -> None:
    """Run ``worker(rank, world_size, init_method, *args)`` in ``world_size`` spawned processes joined by a gloo
    process group; fail (never hang) if they do not all finish in ``timeout_s``.

    A worker ends with :func:`leave_gloo_ranks`: the teardown of a gloo group (a DDP reducer's, at the worker's
    return) can deadlock on the GIL with gloo's own threads, and the results are on disk by then.
    """
    import socket
    import time

    import pytest
    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.spawn(worker, args=(world_size, f"tcp://127.0.0.1:{port}", *args), nprocs=world_size, join=False)
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{world_size} gloo ranks did not finish within {timeout_s:.0f} s")


def leave_gloo_ranks() -> None:
    """The last call of a :func:`run_gloo_ranks` worker: wait for every rank, then exit without tearing down."""
    import sys

    import torch.distributed as dist
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
