"""The AP parity study's child processes (:mod:`.ap_parity_study` runs the study): starting one with its log in a
process group of its own, ending it with its workers, the stock process that builds each config's initial weights,
the Triton warm-up beside the runs, and the SIGTERM that ends a study early."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Dict, Optional, Sequence

from ..common import REPO_ROOT
from ..stock_process import stock_command
from .ap_parity_config import ParityConfig, Schedule, ShapesData, init_overlay_settings, write_overlay
from .user_path import child_environment

INIT_MODULE = "deform_plugin.benchmarks.detector.initial_weights"

def init_dir(work_dir: Path, config: ParityConfig) -> Path:
    return Path(work_dir) / "inits" / config.name

def start_initial_weights(config: ParityConfig, stock_cfg, seeds: Sequence[int], schedule: Schedule,
                          data: ShapesData, work_dir: Path, threads: int) -> subprocess.Popen:
    """Build the config's initial weights per seed in a stock process (on the CPU: they are only saved);
    ``stock_cfg`` is the config's stock file as mmengine merges it."""
    folder = init_dir(work_dir, config)
    overlay = folder / "init_config.py"
    write_overlay(overlay, config.stock, init_overlay_settings(stock_cfg, schedule),
                  f"{config.name} initial weights", stock=True)
    command = [sys.executable, *stock_command(INIT_MODULE), str(overlay), "--seeds", *map(str, seeds),
               "--out-dir", str(folder)]
    return launch(command, folder / "init.log", dict(CUDA_VISIBLE_DEVICES="", **thread_env(threads)))

def thread_env(threads: int) -> Dict[str, str]:
    return dict(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads),
                OMP_WAIT_POLICY="PASSIVE")

def launch(command: Sequence[str], log_path: Path, env: Dict[str, str]) -> subprocess.Popen:
    """Start ``command`` with its output in ``log_path``, in a process group of its own (a kill ends its dataloader
    workers too) but in this session (whatever ends this session's processes ends it too)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(command) + "\n")
        log.flush()
        # Python < 3.11 has no process_group: a session of its own there.
        group = dict(process_group=0) if sys.version_info >= (3, 11) else dict(start_new_session=True)
        return subprocess.Popen(command, cwd=REPO_ROOT, env=child_environment(env), stdout=log,
                                stderr=subprocess.STDOUT, **group)

def kill(process: subprocess.Popen) -> None:
    """End ``process`` and its process group (started by :func:`launch`)."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()

class Interrupted(Exception):
    """SIGTERM (an outer ``timeout``): stop the runs and write the report of what finished."""

def raise_interrupted(signum, frame):
    raise Interrupted()


class TritonWarmup:
    """``python -m deform_plugin warmup`` of each config's fast file, one after another (the DETRs share their kernel
    variants: the second finds them compiled), in a background thread; a failure only leaves the runs to compile
    their kernels themselves."""

    def __init__(self, configs: Sequence[ParityConfig], gpu: int, bf16: bool, work_dir: Path, threads: int):
        self.commands = [([sys.executable, "-m", "deform_plugin", "warmup", str(c.fast)]
                          + (["--amp-dtype", "bfloat16"] if bf16 else []), Path(work_dir) / f"warmup_{c.name}.log")
                         for c in configs]
        self.env = dict(CUDA_VISIBLE_DEVICES=str(gpu), **thread_env(threads))
        self.process: Optional[subprocess.Popen] = None
        self.stopped = False
        self.thread = threading.Thread(target=self._run_all, name="triton-warmup", daemon=True)
        self.thread.start()

    def _run_all(self) -> None:
        for command, log in self.commands:
            if self.stopped:
                return
            self.process = launch(command, log, self.env)
            self.process.wait()

    def stop(self) -> None:
        self.stopped = True
        if self.process is not None:
            kill(self.process)
