"""Tests that need several processes joined by a gloo process group (torch.distributed on the CPU)."""
import os
import sys


def run_gloo_ranks(worker, *args, world_size: int = 2, timeout_s: float = 240.0) -> None:
    """Run ``worker(rank, *args)`` in ``world_size`` spawned processes joined by a gloo process group (one torch
    thread each); fail (never hang) if they do not all finish in ``timeout_s``. ``worker`` is a module-level function
    that leaves its results on disk."""
    import socket
    import time

    import pytest
    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.spawn(_rank_main, args=(world_size, f"tcp://127.0.0.1:{port}", worker, args), nprocs=world_size,
                       join=False)
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{world_size} gloo ranks did not finish within {timeout_s:.0f} s")


def _rank_main(rank, world_size, init_method, worker, args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        worker(rank, *args)
    except BaseException:
        dist.destroy_process_group()
        raise
    # Every rank done, then exit without the group's teardown: a gloo group's destructor (a DDP reducer's, when
    # the worker's objects are freed) can deadlock on the GIL with gloo's own threads.
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
