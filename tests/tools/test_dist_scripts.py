"""The launch scripts' command lines and checks, without launching anything: tools/dist_train.sh and
tools/dist_test.sh (mmdet's conventions: positional arguments, NNODES/NODE_RANK/MASTER_ADDR/PORT) run with
PYTHON=echo, which prints the torchrun command line instead; tools/slurm_train.sh and tools/slurm_test.sh with a
fake ``srun`` on PATH that prints its arguments and the PYTHONPATH it got. Two real nodes: test_two_nodes.py."""
import os
import shutil
import subprocess

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(REPO_ROOT, "tools")
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="the launch scripts are bash scripts")
LAUNCH_VARIABLES = ("NNODES", "NODE_RANK", "MASTER_ADDR", "PORT", "MASTER_PORT", "GPUS", "GPUS_PER_NODE",
                    "CPUS_PER_TASK", "SRUN_ARGS")


def _run(script, *args, path_first=None, **env):
    base = {name: value for name, value in os.environ.items() if name not in LAUNCH_VARIABLES}
    if path_first is not None:
        base["PATH"] = f"{path_first}{os.pathsep}{base['PATH']}"
    return subprocess.run(["bash", os.path.join(TOOLS, script), *args], capture_output=True, text=True, timeout=60,
                          env=dict(base, PYTHON="echo", **env))


@pytest.fixture
def fake_srun(tmp_path):
    """A folder holding an ``srun`` that prints each argument on a line of its own, then PYTHONPATH."""
    srun = tmp_path / "srun"
    srun.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@"\necho "PYTHONPATH=$PYTHONPATH"\n')
    srun.chmod(0o755)
    return tmp_path


@pytest.mark.parametrize("script, args, tool", [
    pytest.param("dist_train.sh", ["cfg.py", "2", "--amp"], ["cfg.py"], id="train"),
    pytest.param("dist_test.sh", ["cfg.py", "ckpt.pth", "2", "--out", "r.pkl"], ["cfg.py", "ckpt.pth"], id="test"),
])
def test_launch_command_line(script, args, tool):
    completed = _run(script, *args, NNODES="2", NODE_RANK="1", MASTER_ADDR="10.0.0.1", PORT="29501")
    assert completed.returncode == 0, completed.stderr
    name = "train.py" if script == "dist_train.sh" else "test.py"
    assert completed.stdout.split() == [
        "-m", "torch.distributed.run", "--nnodes=2", "--node_rank=1", "--master_addr=10.0.0.1", "--nproc_per_node=2",
        "--master_port=29501", os.path.join(TOOLS, name), *tool, "--launcher", "pytorch", *args[len(tool) + 1:]]


def test_one_node_defaults_and_master_port_as_the_port():
    assert "--nnodes=1 --node_rank=0 --master_addr=127.0.0.1 --nproc_per_node=1 --master_port=29500" in \
        _run("dist_train.sh", "cfg.py", "1").stdout
    assert "--master_port=29600" in _run("dist_train.sh", "cfg.py", "1", MASTER_PORT="29600").stdout
    assert "--master_port=29600" in _run("dist_train.sh", "cfg.py", "1", MASTER_PORT="29600", PORT="29600").stdout


@pytest.mark.parametrize("script, args", [("dist_train.sh", ["cfg.py"]), ("dist_test.sh", ["cfg.py", "ckpt.pth"]),
                                          ("slurm_train.sh", ["p", "job", "cfg.py"]),
                                          ("slurm_test.sh", ["p", "job", "cfg.py"])],
                         ids=["train", "test", "slurm-train", "slurm-test"])
def test_too_few_arguments_print_usage(script, args):
    completed = _run(script, *args)
    assert completed.returncode == 2 and completed.stderr.startswith("usage: ")


@pytest.mark.parametrize("gpus, env, message", [
    ("two", {}, "GPUS must be a whole number >= 1, got 'two'"),
    ("0", {}, "GPUS must be a whole number >= 1, got '0'"),
    ("1", dict(NNODES="2", NODE_RANK="2", MASTER_ADDR="10.0.0.1"),
     "NODE_RANK=2 is not below NNODES=2: the nodes are numbered 0 to 1"),
    ("1", dict(NNODES="2", NODE_RANK="-1"), "NODE_RANK must be a whole number >= 0, got '-1'"),
    ("1", dict(NNODES="0"), "NNODES must be a whole number >= 1, got '0'"),
    ("1", dict(PORT="70000"), "PORT=70000 is not a TCP port (1 to 65535)"),
    ("1", dict(PORT="29500", MASTER_PORT="29501"),
     "PORT=29500 and MASTER_PORT=29501 disagree: set one of them (the port of node 0's rendezvous)"),
    ("1", dict(MASTER_ADDR="10.0.0.1 10.0.0.2"), "MASTER_ADDR='10.0.0.1 10.0.0.2' is not a host name or address"),
], ids=["gpus-word", "gpus-zero", "node-rank-too-high", "node-rank-negative", "no-nodes", "port-range",
        "two-ports", "two-addresses"])
@pytest.mark.parametrize("script", ["dist_train.sh", "dist_test.sh"], ids=["train", "test"])
def test_a_bad_value_is_named_before_anything_starts(script, gpus, env, message):
    args = ["cfg.py", gpus] if script == "dist_train.sh" else ["cfg.py", "ckpt.pth", gpus]
    completed = _run(script, *args, **env)
    assert (completed.returncode, completed.stdout, completed.stderr) == (2, "", f"error: {message}\n")


def test_several_nodes_without_master_addr_warn_that_only_this_host_is_reached():
    completed = _run("dist_train.sh", "cfg.py", "1", NNODES="2", NODE_RANK="1")
    assert completed.returncode == 0 and "--master_addr=127.0.0.1" in completed.stdout
    assert completed.stderr.startswith("warning: NNODES=2 without MASTER_ADDR")


@pytest.mark.parametrize("script, args, tool, tool_args", [
    pytest.param("slurm_train.sh", ["dev", "ddetr", "cfg.py", "work_dirs/x", "--amp"], "train.py",
                 ["cfg.py", "--work-dir=work_dirs/x", "--launcher=slurm", "--amp"], id="train"),
    pytest.param("slurm_test.sh", ["dev", "ddetr", "cfg.py", "ckpt.pth", "--out", "r.pkl"], "test.py",
                 ["cfg.py", "ckpt.pth", "--launcher=slurm", "--out", "r.pkl"], id="test"),
])
def test_slurm_command_line(fake_srun, script, args, tool, tool_args):
    completed = _run(script, *args, path_first=fake_srun, GPUS="16", SRUN_ARGS="--qos=high  --exclude=node3")
    assert completed.returncode == 0, completed.stderr
    *srun_args, pythonpath = completed.stdout.splitlines()
    assert srun_args == [
        "-p", "dev", "--job-name=ddetr", "--gres=gpu:8", "--ntasks=16", "--ntasks-per-node=8", "--cpus-per-task=5",
        "--kill-on-bad-exit=1", "--qos=high", "--exclude=node3", "echo", "-u", os.path.join(TOOLS, tool), *tool_args]
    assert pythonpath.startswith(f"PYTHONPATH={REPO_ROOT}:")


def test_a_slurm_job_smaller_than_a_node_asks_for_the_gpus_it_uses(fake_srun):
    completed = _run("slurm_train.sh", "dev", "job", "cfg.py", "w", path_first=fake_srun, GPUS="2",
                     CPUS_PER_TASK="10")
    assert completed.returncode == 0, completed.stderr
    assert ["--gres=gpu:2", "--ntasks=2", "--ntasks-per-node=2", "--cpus-per-task=10", "--kill-on-bad-exit=1",
            "echo"] == completed.stdout.splitlines()[3:9]


@pytest.mark.parametrize("env, message", [
    (dict(GPUS="8x"), "GPUS must be a whole number >= 1, got '8x'"),
    (dict(GPUS_PER_NODE="0"), "GPUS_PER_NODE must be a whole number >= 1, got '0'"),
    (dict(CPUS_PER_TASK="five"), "CPUS_PER_TASK must be a whole number >= 1, got 'five'"),
], ids=["gpus", "gpus-per-node", "cpus-per-task"])
def test_a_bad_slurm_value_is_named_before_srun_starts(fake_srun, env, message):
    completed = _run("slurm_train.sh", "dev", "job", "cfg.py", "w", path_first=fake_srun, **env)
    assert (completed.returncode, completed.stdout, completed.stderr) == (2, "", f"error: {message}\n")


def test_slurm_scripts_without_srun_say_where_they_run(tmp_path):
    # A PATH with only the commands the script runs before it looks for srun.
    for command in ("dirname", "basename"):
        (tmp_path / command).symlink_to(shutil.which(command))
    completed = subprocess.run([shutil.which("bash"), os.path.join(TOOLS, "slurm_test.sh"), "dev", "job", "cfg.py",
                                "ckpt.pth"], capture_output=True, text=True, timeout=60,
                               env=dict(os.environ, PATH=str(tmp_path)))
    assert completed.returncode == 2
    assert completed.stderr == ("error: srun is not on PATH: slurm_test.sh runs where slurm's commands are (a "
                                "cluster's login node)\n")
