"""tools/dist_train.sh and tools/dist_test.sh: mmdet's conventions (positional arguments, NNODES/NODE_RANK/
MASTER_ADDR/PORT), checked by running them with PYTHON=echo, which prints the torchrun command line instead."""
import os
import shutil
import subprocess

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(REPO_ROOT, "tools")
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="the launch scripts are bash scripts")


def _run(script, *args, **env):
    return subprocess.run(["bash", os.path.join(TOOLS, script), *args], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHON="echo", **env))


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


@pytest.mark.parametrize("script, args", [("dist_train.sh", ["cfg.py"]), ("dist_test.sh", ["cfg.py", "ckpt.pth"])],
                         ids=["train", "test"])
def test_too_few_arguments_print_usage(script, args):
    completed = _run(script, *args)
    assert completed.returncode == 2 and completed.stderr.startswith("usage: ")
