"""Triton kernel variants compiled in background processes while a run starts, and the wait of a variant's first
launch for the process that compiles it.

A process's first launch of a kernel variant compiles it: 1-1.6 s for an MSDA forward variant and 3.6-5.6 s for a
backward one on a CPU host (docs/kernels.md, "Compile time"), one variant after another in a training run's first
iteration. Here the variants a run will launch are compiled beforehand, one process per variant, all at once:

1. :func:`capture_job` asks Triton's JIT, in this process, for the specialization of a launch (what its compile
   depends on: argument types and alignment, constexprs, options, this GPU's target) without compiling or launching
   anything, through Triton's ``jit_cache_hook``;
2. :func:`start_background_compiles` starts a worker per job (:mod:`deform_plugin.ops.compile_worker`, which imports
   only triton) that compiles the variant into Triton's on-disk cache;
3. :func:`wait_for_background_compile`, called by a variant's first launch (``DirectLaunches``), waits for the worker
   of that variant instead of compiling it a second time beside it; Triton then loads it from the cache.

Imports neither torch nor triton at import time.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from . import compile_worker

__all__ = ["CompileJob", "capture_job", "compile_jobs_here", "start_background_compiles", "variant_signature",
           "wait_for_background_compile"]

logger = logging.getLogger(__name__)

WORKER_FILE = os.path.abspath(compile_worker.__file__)
# A first launch waits this long for its variant's worker at most (a compile takes seconds), then compiles the
# variant itself: a worker that hangs delays a run, never stops it.
WAIT_LIMIT_S = 120.0


def variant_signature(kernel, tensors: Sequence, scalars: Sequence, num_warps: int, num_stages: int) -> tuple:
    """What tells two launches' compiled variants apart, short of Triton's full key: the tensors' dtypes, the values
    of the constexpr arguments, the launch options. Launches that differ in it never share a variant; launches that
    agree in it share one unless their pointers' alignment or an integer's value class differ."""
    arguments = tuple(tensors) + tuple(scalars)
    constexprs = tuple(str(arguments[index]) for index in getattr(kernel, "constexprs", ()))
    return tuple(str(tensor.dtype) for tensor in tensors), constexprs, num_warps, num_stages


@dataclass(frozen=True)
class CompileJob:
    """One kernel variant to compile: the kernel, the variant's signature here, and what a worker needs."""

    kernel: object           # the JIT function (stays in this process)
    variant: tuple           # its variant_signature
    module: str
    source_file: str
    function: str
    specialization: str      # Triton's specialization data of the variant (JSON)
    target: Tuple[str, object, int]  # backend, arch, warp size: ("cuda", 90, 32) for sm_90

    def worker_spec(self) -> dict:
        return dict(module=self.module, source_file=self.source_file, function=self.function,
                    specialization=self.specialization, target=list(self.target))

    @property
    def name(self) -> str:
        dtypes, constexprs, _, _ = self.variant
        return f"{self.function}[{', '.join(constexprs)}] on {dtypes[0] if dtypes else 'no'} tensors"


def capture_job(kernel, grid, tensors: Sequence, scalars: Sequence, num_warps: int,
                num_stages: int) -> Optional[CompileJob]:
    """The compile job of the launch ``kernel[grid](*tensors, *scalars, num_warps=..., num_stages=...)``, captured
    from Triton's JIT for the active GPU target; nothing is compiled or launched (the tensors may be CPU tensors of
    the launch's dtypes: Triton reads their dtypes and alignment only). None where this process has the variant
    compiled already, where the kernel is interpreted, or where this Triton offers no ``jit_cache_hook``."""
    try:
        from triton import knobs
        from triton.runtime.driver import driver
        from triton.runtime.jit import JITFunction
    except ImportError:
        return None
    if not isinstance(kernel, JITFunction):  # an interpreted kernel: nothing to compile
        return None
    captured = {}
    previous = knobs.runtime.jit_cache_hook

    def record(*args, **kwargs):
        info = kwargs.get("fn")
        if info is not None and getattr(info, "jit_function", None) is kernel:
            captured["specialization"] = kwargs["compile"]["specialization_data"]
            return True  # recorded: Triton compiles nothing now
        return previous(*args, **kwargs) if previous is not None else None

    knobs.runtime.jit_cache_hook = record
    try:
        kernel.warmup(*tensors, *scalars, grid=grid, num_warps=num_warps, num_stages=num_stages)
    finally:
        knobs.runtime.jit_cache_hook = previous
    if "specialization" not in captured:
        return None
    target = driver.active.get_current_target()
    fn = kernel.fn
    return CompileJob(kernel=kernel, variant=variant_signature(kernel, tensors, scalars, num_warps, num_stages),
                      module=fn.__module__, source_file=os.path.abspath(fn.__code__.co_filename),
                      function=fn.__name__, specialization=captured["specialization"],
                      target=(target.backend, target.arch, target.warp_size))


class _Worker(NamedTuple):
    job: CompileJob
    process: subprocess.Popen
    stderr: object  # a temporary file: the worker's error output, read if it fails


# Workers not yet waited for: {kernel: {variant signature: worker}}.
_in_flight: Dict[object, Dict[tuple, _Worker]] = {}
_in_flight_lock = threading.Lock()


def _worker_environment() -> dict:
    from triton import knobs

    # The interpreter (CPU tests) would give the worker interpreted kernels, which do not compile.
    environment = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    # This process's cache, also where it was set through Triton's knobs rather than the environment.
    environment["TRITON_CACHE_DIR"] = knobs.cache.dir
    return environment


def worker_command(jobs: Sequence[CompileJob]) -> List[str]:
    return [sys.executable, WORKER_FILE, json.dumps([job.worker_spec() for job in jobs])]


def start_background_compiles(jobs: Sequence[CompileJob]) -> List[subprocess.Popen]:
    """Start one worker process per job whose variant no worker of this process compiles yet; returns them."""
    if not jobs:
        return []
    started = []
    environment = _worker_environment()
    for job in jobs:
        with _in_flight_lock:
            if job.variant in _in_flight.get(job.kernel, {}):
                continue
            stderr = tempfile.TemporaryFile()
            # A session of its own: a Ctrl-C in the terminal stops the run, and the worker finishes its variant.
            process = subprocess.Popen(worker_command([job]), stdout=subprocess.DEVNULL, stderr=stderr,
                                       env=environment, start_new_session=True)
            _in_flight.setdefault(job.kernel, {})[job.variant] = _Worker(job, process, stderr)
        started.append(process)
    return started


def in_flight_count() -> int:
    """Workers started here and not yet waited for (finished or not)."""
    with _in_flight_lock:
        return sum(len(workers) for workers in _in_flight.values())


def wait_for_background_compile(kernel, tensors: Sequence, scalars: Sequence, num_warps: int,
                                num_stages: int) -> None:
    """Called before a launch goes through Triton (which compiles a variant it has not loaded): wait for the worker
    that compiles this launch's variant, if one was started here. Returns at once where none was (one dict lookup
    where no worker was ever started)."""
    if not _in_flight:
        return
    with _in_flight_lock:
        workers = _in_flight.get(kernel)
        if not workers:
            return
        worker = workers.pop(variant_signature(kernel, tensors, scalars, num_warps, num_stages), None)
        if not workers:
            del _in_flight[kernel]
    if worker is None:
        return
    try:
        returncode = worker.process.wait(timeout=WAIT_LIMIT_S)
    except subprocess.TimeoutExpired:
        logger.warning("deform_plugin: the background compile of %s is still running after %.0f s; compiling it "
                       "here", worker.job.name, WAIT_LIMIT_S)
        return
    if returncode != 0:
        logger.warning("deform_plugin: the background compile of %s failed (exit status %s); compiling it here. "
                       "Its error output ends:\n%s", worker.job.name, returncode, _tail(worker.stderr))
    worker.stderr.close()


def _tail(stream, limit: int = 4000) -> str:
    stream.seek(0)
    return stream.read().decode(errors="replace")[-limit:]


def compile_jobs_here(jobs: Sequence[CompileJob]) -> None:
    """Compile the jobs one after another in this process (into the on-disk cache and this process's JIT)."""
    for job in jobs:
        compile_worker.compile_job(job.worker_spec())
