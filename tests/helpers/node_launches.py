"""Several "nodes" on one host: one launch of a tools/ launch script per node, each with its own NODE_RANK, joined
over localhost as torchrun joins real nodes (node 0's agent hosts the rendezvous at MASTER_ADDR:PORT)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence

TOOLS = Path(__file__).resolve().parents[2] / "tools"
# How long the other nodes may run on once one has failed: they would wait for it at the next collective.
FAILED_NODE_GRACE_S = 10.0


@dataclass
class NodeRun:
    node_rank: int
    returncode: int  # -9 (SIGKILL) where the launch was stopped
    log: str  # stdout and stderr together

    def describe(self) -> str:
        return f"node {self.node_rank} ended with {self.returncode}; its log ends:\n{self.log[-6000:]}"


def free_port() -> int:
    """A TCP port free on localhost now (another process may take it before node 0 binds it: rare)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _descendants(pid: int) -> List[int]:
    """The processes below ``pid``, from /proc (empty where there is none)."""
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                # "pid (command) state ppid ...": the command may hold spaces and parentheses.
                parent = int(handle.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), ()):
            found.append(child)
            stack.append(child)
    return found


def _kill_launch(process: subprocess.Popen) -> None:
    """SIGKILL a launch that is still running and every process it started: its process group, and the ranks, which
    torchrun starts in sessions of their own (found before anything is killed, while they are still the launch's
    descendants). A launch that has ended has ended its ranks (torchrun waits for them), and its pid, reaped, may
    already be another process's."""
    if process.poll() is not None:
        return
    ranks = _descendants(process.pid)
    for kill, target in [(os.killpg, process.pid)] + [(os.kill, pid) for pid in ranks]:
        try:
            kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


def launch_nodes(script: str, args_of_node: Sequence[Sequence[str]], log_dir: Path, env: Dict[str, str],
                 timeout_s: float, env_of_node: Sequence[Dict[str, str]] = ()) -> List[NodeRun]:
    """Run ``bash tools/<script> *args_of_node[r]`` for each node ``r`` at once, with ``NNODES``, ``NODE_RANK``,
    ``MASTER_ADDR=127.0.0.1`` and a free ``PORT`` added to ``env`` (and ``env_of_node[r]``, where given); return
    each node's exit status and log.

    A launch still running when the call returns is killed with every process it started: once ``timeout_s`` has
    passed, ``FAILED_NODE_GRACE_S`` after a node failed, or on any error here (an interrupted test included). No
    rank outlives the call.
    """
    nodes = len(args_of_node)
    shared = dict(env, NNODES=str(nodes), MASTER_ADDR="127.0.0.1", PORT=str(free_port()))
    shared.pop("MASTER_PORT", None)
    log_dir.mkdir(parents=True, exist_ok=True)
    processes, logs = [], []
    try:
        for rank, args in enumerate(args_of_node):
            log_path = log_dir / f"node{rank}.log"
            logs.append(log_path)
            node_env = dict(shared, NODE_RANK=str(rank), **(env_of_node[rank] if env_of_node else {}))
            with open(log_path, "wb") as log:
                processes.append(subprocess.Popen(["bash", str(TOOLS / script), *args], env=node_env, stdout=log,
                                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                  start_new_session=True))
        deadline = time.monotonic() + timeout_s
        while any(process.poll() is None for process in processes) and time.monotonic() < deadline:
            if any(process.poll() not in (None, 0) for process in processes):
                deadline = min(deadline, time.monotonic() + FAILED_NODE_GRACE_S)
            time.sleep(0.2)
    finally:
        for process in processes:
            _kill_launch(process)
    return [NodeRun(rank, process.returncode, path.read_text(errors="replace"))
            for rank, (process, path) in enumerate(zip(processes, logs))]
