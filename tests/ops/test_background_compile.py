"""Background compiles: one worker process per kernel variant, started once; a variant's first launch through Triton
waits for its worker (and only for its own), and a failed or hung worker only means the launch compiles it itself.

Worker processes are stand-ins here; the one test that compiles a real variant for sm_90 in a real worker is marked
slow (a worker process and a Triton compile).
"""
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from deform_plugin.ops import background_compile, compile_worker
from deform_plugin.ops.background_compile import (CompileJob, start_background_compiles, variant_signature,
                                                  wait_for_background_compile)
from deform_plugin.ops.triton_support import DirectLaunches

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Kernel:
    """Stands for a JIT function: its constexpr parameters are the last two of five arguments."""

    constexprs = [3, 4]

    def __init__(self, log=None):
        self.log = log if log is not None else []

    def __getitem__(self, grid):
        def launch(*args, **options):
            self.log.append("triton launch")
        return launch


class _Process:
    """Stands for a worker process: ``wait`` returns ``returncode`` (or times out) and is logged."""

    def __init__(self, log, returncode=0, hangs=False):
        self.log, self.returncode, self.hangs = log, returncode, hangs
        self.args = ["worker"]

    def wait(self, timeout=None):
        self.log.append("waited for the worker")
        if self.hangs:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode


TENSORS = (torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.float32))
SCALARS = (7, 4, True)  # one size, then the constexprs


def _job(kernel, tensors=TENSORS, scalars=SCALARS, name="kernel"):
    return CompileJob(kernel=kernel, variant=variant_signature(kernel, tensors, scalars, 1, 1), module="m",
                      source_file="/m.py", function=name, specialization="{}", target=("cuda", 90, 32))


@pytest.fixture
def workers(monkeypatch):
    """Stand-in worker processes: the Popen calls made, and every wait, in one log."""
    monkeypatch.setattr(background_compile, "_in_flight", {})
    log, started = [], []

    def popen(command, **options):
        started.append((command, options))
        process = _Process(log, **popen.behaviour)
        return process
    popen.behaviour = {}
    monkeypatch.setattr(background_compile.subprocess, "Popen", popen)
    return dict(log=log, started=started, popen=popen)


def test_the_signature_tells_variants_apart_by_dtypes_constexprs_and_options_never_by_sizes():
    kernel = _Kernel()
    base = variant_signature(kernel, TENSORS, SCALARS, 1, 1)
    assert variant_signature(kernel, TENSORS, (9999,) + SCALARS[1:], 1, 1) == base  # a new size: same variant
    assert variant_signature(kernel, TENSORS, (7, 2, True), 1, 1) != base
    assert variant_signature(kernel, (TENSORS[1], TENSORS[1]), SCALARS, 1, 1) != base
    assert variant_signature(kernel, TENSORS, SCALARS, 2, 1) != base


def test_one_worker_per_job_started_once_without_the_interpreter_on_this_processs_cache(workers, monkeypatch,
                                                                                        tmp_path):
    from triton import knobs
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(knobs.cache, "dir", str(tmp_path))  # set through Triton's knobs, not the environment
    forward, backward = _Kernel(), _Kernel()
    jobs = [_job(forward, name="forward"), _job(backward, name="backward")]
    assert len(start_background_compiles(jobs)) == 2
    assert start_background_compiles(jobs) == []  # the same variants: their workers run already
    for command, options in workers["started"]:
        assert command[:2] == [sys.executable, background_compile.WORKER_FILE]
        assert json.loads(command[2])[0]["target"] == ["cuda", 90, 32]
        assert "TRITON_INTERPRET" not in options["env"] and options["start_new_session"]
        assert options["env"]["TRITON_CACHE_DIR"] == str(tmp_path)
    assert background_compile.in_flight_count() == 2


def test_a_first_launch_waits_for_its_own_variants_worker_once(workers):
    kernel = _Kernel(workers["log"])
    start_background_compiles([_job(kernel)])
    other_variant = (TENSORS[1], TENSORS[1])
    wait_for_background_compile(kernel, other_variant, SCALARS, 1, 1)
    wait_for_background_compile(_Kernel(), TENSORS, SCALARS, 1, 1)  # another kernel
    assert workers["log"] == []
    wait_for_background_compile(kernel, TENSORS, (123,) + SCALARS[1:], 1, 1)  # its variant, at another size
    wait_for_background_compile(kernel, TENSORS, SCALARS, 1, 1)
    assert workers["log"] == ["waited for the worker"]
    assert background_compile.in_flight_count() == 0


def test_direct_launches_wait_for_the_worker_before_triton_compiles(workers):
    kernel = _Kernel(workers["log"])
    start_background_compiles([_job(kernel)])
    DirectLaunches(kernel).launch((1, 1, 1), "v", torch.device("cpu"), TENSORS, (0, 0), SCALARS, num_warps=1,
                                  num_stages=1)
    assert workers["log"] == ["waited for the worker", "triton launch"]


@pytest.mark.parametrize("behaviour,message", [
    (dict(returncode=1),
     r"failed \(exit status 1\); compiling it here. Its error output ends:\nTraceback \.\.\.\nboom$"),
    (dict(hangs=True), "still running after 120 s; compiling it here"),
], ids=["failed", "hung"])
def test_a_failed_or_hung_worker_is_reported_and_the_launch_goes_on(workers, behaviour, message, caplog):
    workers["popen"].behaviour = behaviour
    kernel = _Kernel(workers["log"])
    start_background_compiles([_job(kernel)])
    stderr = background_compile._in_flight[kernel][_job(kernel).variant].stderr
    stderr.write(b"Traceback ...\nboom")
    with caplog.at_level(logging.WARNING, logger=background_compile.__name__):
        DirectLaunches(kernel).launch((1, 1, 1), "v", torch.device("cpu"), TENSORS, (0, 0), SCALARS, num_warps=1,
                                      num_stages=1)
    assert workers["log"] == ["waited for the worker", "triton launch"]
    assert len(caplog.records) == 1
    assert re.search(message, caplog.records[0].getMessage())


def test_the_worker_needs_its_jobs_and_one_target():
    with pytest.raises(SystemExit, match="compile_worker.py JOBS"):
        compile_worker.main([])
    jobs = [dict(target=["cuda", 90, 32]), dict(target=["cuda", 80, 32])]
    with pytest.raises(SystemExit, match="a worker compiles for one target"):
        compile_worker.main([json.dumps(jobs)])


def test_the_worker_imports_neither_torch_nor_the_package(tmp_path):
    # Its own imports at start-up (its jobs' kernel files import triton only).
    probe = ("import runpy, sys; runpy.run_path(sys.argv[1]); "
             "print(sorted(m for m in ('torch', 'deform_plugin', 'mmdet') if m in sys.modules))")
    completed = subprocess.run([sys.executable, "-c", probe, background_compile.WORKER_FILE], capture_output=True,
                               text=True, cwd=tmp_path, timeout=60)
    assert completed.stdout.strip() == "[]", completed.stderr


def test_the_worker_loads_a_kernel_file_under_its_module_name_without_its_package(tmp_path, monkeypatch):
    source = tmp_path / "kernels.py"
    source.write_text("LOADED_AS = __name__\n")
    name = "some_package_not_importable.sub.kernels"
    monkeypatch.delitem(sys.modules, name, raising=False)
    try:
        assert compile_worker.load_kernel(name, str(source), "LOADED_AS") == name
        assert "some_package_not_importable" not in sys.modules
    finally:
        sys.modules.pop(name, None)


_NVIDIA_BACKEND = importlib.util.find_spec("triton") is not None and \
    importlib.util.find_spec("triton.backends.nvidia") is not None


# Run without the interpreter, which the test session sets (a JIT function's helpers must be JIT functions too).
_END_TO_END = """
import sys
from triton import knobs
from deform_plugin.ops import background_compile
from deform_plugin.ops.compile_worker import use_compile_only_target
from deform_plugin.ops.msda.precompile import MSDAVariant, compile_jobs, variant_launches
use_compile_only_target("cuda", 90)
variant = MSDAVariant(num_heads=1, head_dim=4, num_levels=1, num_points=1)
(job,) = compile_jobs([variant], backward=False)
assert job.target == ("cuda", 90, 32) and job.function == "msda_forward_kernel", job
(process,) = background_compile.start_background_compiles([job])
(launch,) = variant_launches(variant, backward=False)
hits = []
knobs.compilation.listener = lambda src, metadata, metadata_group, times, cache_hit: hits.append(cache_hit)
background_compile.wait_for_background_compile(launch.kernel, launch.tensors, launch.scalars, launch.num_warps,
                                               launch.num_stages)
assert process.returncode == 0, process.returncode
launch.kernel.warmup(*launch.tensors, *launch.scalars, grid=launch.grid, num_warps=launch.num_warps,
                     num_stages=launch.num_stages)
print("cache hits", hits)
"""


@pytest.mark.slow
@pytest.mark.skipif(not _NVIDIA_BACKEND, reason="compiles for sm_90 with the triton wheel's NVIDIA backend and ptxas")
def test_a_worker_compiles_the_variant_that_tritons_own_launch_path_then_loads(tmp_path):
    """End to end, without a GPU: a job captured from Triton's JIT for sm_90 and compiled by a real worker process
    is a cache hit for Triton's own path in the capturing process (``warmup``: a launch's compile, no launch)."""
    environment = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    environment["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    completed = subprocess.run([sys.executable, "-c", _END_TO_END], capture_output=True, text=True, timeout=600,
                               env=environment, cwd=ROOT)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert completed.stdout.strip().splitlines()[-1] == "cache hits [True]"
    assert os.listdir(tmp_path / "cache")


_LAUNCHER_CACHED = """
import sys, sysconfig, hashlib
from triton.backends.nvidia.driver import make_launcher
from triton.runtime.build import platform_key
from triton.runtime.cache import get_cache_manager
from deform_plugin.ops import background_compile
from deform_plugin.ops.compile_worker import use_compile_only_target
from deform_plugin.ops.msda.precompile import MSDAVariant, compile_jobs, variant_launches
use_compile_only_target("cuda", 90)
variant = MSDAVariant(num_heads=1, head_dim=4, num_levels=1, num_points=1)
(job,) = compile_jobs([variant], backward=False)
(process,) = background_compile.start_background_compiles([job])
assert process.wait() == 0
(launch,) = variant_launches(variant, backward=False)
# The launching process's own path to the variant (a cache hit), and the launcher source its driver would build.
compiled = launch.kernel.warmup(*launch.tensors, *launch.scalars, grid=launch.grid, num_warps=launch.num_warps,
                                num_stages=launch.num_stages)
source = compiled.src
arg_index = lambda name: (source.fn.arg_names.index(name),) if isinstance(name, str) else name
constants = {arg_index(index): value for index, value in source.constants.items()}
launcher_source = make_launcher(constants, dict(source.signature), getattr(compiled.metadata, "tensordesc_meta", None))
key = hashlib.sha256((launcher_source + platform_key()).encode("utf-8")).hexdigest()
name = "__triton_launcher" + sysconfig.get_config_var("EXT_SUFFIX")
print("launcher cached", get_cache_manager(key).get_file(name) is not None)
"""


@pytest.mark.slow
@pytest.mark.skipif(not _NVIDIA_BACKEND, reason="compiles for sm_90 with the triton wheel's NVIDIA backend and ptxas")
@pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("clang") is None,
                    reason="Triton builds launchers with the host's C compiler (gcc or clang), and there is none")
def test_a_worker_builds_the_launcher_that_the_launching_process_looks_up(tmp_path):
    """The worker also builds the variant's launcher (Triton's C extension for the kernel's signature, which a
    process's first launch otherwise compiles with the C compiler) under the key that the launching process's
    driver computes from its own compiled kernel. Without a GPU the CUDA driver library is a stub to link against:
    the launcher is built and cached, and only loading it fails."""
    stub = tmp_path / "libcuda"
    stub.mkdir()
    (stub / "stub.c").write_text("void deform_plugin_stub(void) {}\n")
    compiler = shutil.which("gcc") or shutil.which("clang")
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(stub / "libcuda.so.1"), str(stub / "stub.c")], check=True)
    environment = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    environment.update(TRITON_CACHE_DIR=str(tmp_path / "cache"), TRITON_LIBCUDA_PATH=str(stub))
    completed = subprocess.run([sys.executable, "-c", _LAUNCHER_CACHED], capture_output=True, text=True, timeout=600,
                               env=environment, cwd=ROOT)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert completed.stdout.strip().splitlines()[-1] == "launcher cached True"


def test_no_launcher_is_built_for_another_backend_or_a_failed_compile():
    assert compile_worker.build_launcher(None, "cuda") is False
    assert compile_worker.build_launcher(object(), "hip") is False
