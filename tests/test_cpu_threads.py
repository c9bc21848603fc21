"""The tools' CPU thread settings (deform_plugin.cpu_threads): the user's OMP_* variables win, else at most one torch
thread per available CPU, and every tool sets the OpenMP wait policy before torch loads."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deform_plugin import cpu_threads

REPO_ROOT = Path(__file__).resolve().parents[1]
TOOLS = ("train.py", "test.py", "infer.py", "export_onnx.py", "profile_step.py", "benchmark.py", "benchmark_train.py",
         "demo.py")


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("text, cpus", [("max 100000", None), ("150000 100000", 2), ("50000 100000", 1),
                                        ("garbage", None)])
def test_cgroup_quota(tmp_path, text, cpus):
    (tmp_path / "cpu.max").write_text(text + "\n")
    assert cpu_threads.cgroup_cpu_limit(str(tmp_path / "cpu.max")) == cpus


def test_threads_are_capped_by_the_available_cpus(monkeypatch, restore_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "available_cpus", lambda: 1)
    torch.set_num_threads(2)
    assert cpu_threads.configure_cpu_threads() == 1 and torch.get_num_threads() == 1


def test_the_users_thread_count_wins(monkeypatch, restore_threads):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setattr(cpu_threads, "available_cpus", lambda: 1)
    torch.set_num_threads(2)
    assert cpu_threads.configure_cpu_threads() is None and torch.get_num_threads() == 2


def test_gpu_inference_lowers_torch_threads_to_the_limit(monkeypatch, restore_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(3)
    assert cpu_threads.cap_threads_for_gpu_inference(2) == 2 and torch.get_num_threads() == 2
    # At or below the limit, or with no limit, the count stays.
    assert cpu_threads.cap_threads_for_gpu_inference(2) is None and torch.get_num_threads() == 2
    assert cpu_threads.cap_threads_for_gpu_inference(None) is None and torch.get_num_threads() == 2


def test_gpu_inference_keeps_the_users_thread_count(monkeypatch, restore_threads):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    torch.set_num_threads(3)
    assert cpu_threads.cap_threads_for_gpu_inference(1) is None and torch.get_num_threads() == 3


@pytest.mark.parametrize("limit", [0, -2, 1.5, "4", True])
def test_a_bad_thread_limit_is_refused_by_value(limit):
    with pytest.raises(ValueError, match=f"got {limit!r}"):
        cpu_threads.cap_threads_for_gpu_inference(limit)


@pytest.mark.parametrize("tool", TOOLS)
def test_each_tool_sets_the_wait_policy_before_it_imports_torch(tool):
    source = (REPO_ROOT / "tools" / tool).read_text()
    assert 'os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")' in source
    before = source.split('os.environ.setdefault("OMP_WAIT_POLICY"')[0]
    assert "import torch" not in before and "import deform_plugin" not in before and "from deform_plugin" not in before


# Records the wait policy in the environment at the moment something first imports torch, then runs the tool's
# module without its command line (run_name is not "__main__").
TORCH_IMPORT_PROBE = """
import os, runpy, sys
seen = []
class Probe:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not seen:
            seen.append(os.environ.get("OMP_WAIT_POLICY"))
sys.meta_path.insert(0, Probe())
runpy.run_path(sys.argv[1], run_name="tool_under_test")
print(seen)
"""


def test_the_policy_is_in_the_environment_when_torch_loads():
    env = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}
    completed = subprocess.run([sys.executable, "-c", TORCH_IMPORT_PROBE, str(REPO_ROOT / "tools" / "infer.py")],
                               capture_output=True, text=True, env=env, timeout=300)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert completed.stdout.strip().splitlines()[-1] == "['PASSIVE']"
