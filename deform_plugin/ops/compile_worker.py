"""Compile Triton kernel variants into Triton's on-disk cache, in a process that imports neither torch nor the rest
of deform_plugin.

Started by path (``python .../deform_plugin/ops/compile_worker.py JOBS``), never with ``-m deform_plugin...``:
importing the package imports torch, mmengine and mmdet first, which took 8-10 s on a CPU host where compiling one
MSDA variant takes 1-6 s, so a worker that imported it finished after the training process had compiled the same
variant itself. This file imports only the standard library at the top and triton inside its functions; the kernel
files it loads import only triton.

``JOBS`` is a JSON list; each job names a kernel (its module, source file and function name), the GPU target
(``["cuda", 90, 32]`` for sm_90) and the specialization data that Triton's JIT recorded for the variant in the
process that will launch it (:mod:`deform_plugin.ops.background_compile`). The worker compiles it with
``JITFunction.preload``, Triton's own inverse of that record, so the variant lands under the cache key the
launching process's first launch looks up.

It also builds the variant's launcher: the small C extension through which Triton's NVIDIA driver launches a
kernel of that signature. Triton builds it with the host's C compiler at a process's first launch of the kernel
(0.35-0.6 s each on a CPU host), after the cubin is loaded, and caches it under the hash of its C source in the same
directory; built here, the launching process's first launch finds it there too.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import sys
from typing import Sequence

# Where a job's lock lives, inside Triton's cache directory.
LOCK_FOLDER = "deform_plugin_compile_locks"


class CompileOnlyTarget:
    """Stands for Triton's active driver in a process that compiles for ``target`` and launches nothing.

    Triton's JIT asks the active driver for the current device and its target; the CUDA driver would import torch
    and initialise CUDA for that. Device 0 is only the key of the JIT's per-device caches here.
    """

    def __init__(self, backend: str, arch: int, warp_size: int):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget(backend, arch, warp_size)

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0


def use_compile_only_target(backend: str, arch: int, warp_size: int = 32) -> None:
    """Make Triton compile for this target in this process, with no GPU (the process must launch nothing)."""
    from triton.runtime.driver import driver
    driver.set_active(CompileOnlyTarget(backend, arch, warp_size))


def load_kernel(module_name: str, source_file: str, function_name: str):
    """The JIT function ``function_name`` of ``source_file``, loaded as module ``module_name`` without importing the
    packages above it (the JIT's cache key holds the module's name, so it must be the launcher's)."""
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, source_file)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {module_name} from {source_file}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return getattr(module, function_name)


def job_lock_path(job: dict) -> str:
    """The lock of ``job``'s variant, in Triton's cache directory: the same path for every process that compiles it."""
    from triton import knobs
    digest = hashlib.sha256(json.dumps([job["target"], job["specialization"]]).encode()).hexdigest()
    return os.path.join(knobs.cache.dir, LOCK_FOLDER, f"{digest[:32]}.lock")


@contextlib.contextmanager
def exclusive(path: str):
    """Hold an exclusive lock on ``path`` (POSIX; elsewhere no lock): the ranks of one host each start a worker for
    the same variant, and one compiles it while the others wait, then find it in the cache."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_launcher(compiled, backend: str) -> bool:
    """Build ``compiled``'s launcher into Triton's cache, as the NVIDIA driver's first launch of it would; whether it
    was built. Without the CUDA driver library (a machine without a GPU, compiling for ``--arch``), or for another
    backend, nothing is built and the first launch builds it."""
    if compiled is None or backend != "cuda":
        return False
    try:
        from triton.backends.nvidia.driver import CudaLauncher
        CudaLauncher(compiled.src, compiled.metadata)
    except Exception as error:  # the launch builds what is missing: never fail the compile for it
        # Building needs the CUDA driver library to link against, loading it that library's symbols; a launcher
        # built but not loaded is cached all the same.
        print(f"deform_plugin: the launcher of {compiled.name} is left to its first launch ({error!r})",
              file=sys.stderr)
        return False
    return True


def compile_job(job: dict) -> None:
    """Compile one job's variant, and build its launcher, into Triton's on-disk cache (cache hits where they are
    there already)."""
    kernel = load_kernel(job["module"], job["source_file"], job["function"])
    with exclusive(job_lock_path(job)):
        build_launcher(kernel.preload(job["specialization"]), job["target"][0])


def main(argv: Sequence[str]) -> int:
    if len(argv) != 1:
        raise SystemExit(__doc__)
    jobs = json.loads(argv[0])
    targets = {tuple(job["target"]) for job in jobs}
    if len(targets) != 1:
        raise SystemExit(f"a worker compiles for one target, got {sorted(targets)}")
    use_compile_only_target(*targets.pop())
    for job in jobs:
        compile_job(job)
    return 0


if __name__ == "__main__":
    # Started by path, Python put this file's folder first on sys.path: its files would shadow top-level modules.
    sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or ".") != os.path.dirname(
        os.path.abspath(__file__))]
    sys.exit(main(sys.argv[1:]))
