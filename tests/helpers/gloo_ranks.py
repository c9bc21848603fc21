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


def run_gloo_workers(workers, out_dir, world_size: int = 2, timeout_s: float = 240.0) -> dict:
    """Run each of ``workers`` (module-level functions) as ``worker(rank, folder)``, one after another in one set of
    ranks (spawning the processes costs seconds; the workers share their process group); ``folder`` is the
    worker's own, ``out_dir / worker.__name__``. Returns ``{worker.__name__: folder}``."""
    from pathlib import Path
    folders = {worker.__name__: Path(out_dir) / worker.__name__ for worker in workers}
    assert len(folders) == len(workers), "workers need distinct names"
    for folder in folders.values():
        folder.mkdir(parents=True, exist_ok=True)
    run_gloo_ranks(_each_worker, tuple(workers), folders, world_size=world_size, timeout_s=timeout_s)
    return folders


def _each_worker(rank, workers, folders):
    import torch.distributed as dist
    kept = []  # what the workers return lives until the process exits (see the teardown note in _rank_main)
    for worker in workers:
        kept.append(worker(rank, folders[worker.__name__]))
        dist.barrier()  # the next worker starts on every rank after this one has ended on all


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
