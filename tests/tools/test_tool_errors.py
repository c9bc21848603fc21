"""Every tool ends a mistake in its command line with one ``error:`` line naming the path, exit status 2, before it
builds anything; a misspelt --cfg-options key is named with the closest key first. (tools/infer.py and
tools/export_onnx.py have their own cases in their test files.)"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from checkout import checkout_environment

REPO_ROOT = Path(__file__).resolve().parents[2]
DEMO_CONFIG = str(REPO_ROOT / "configs" / "demo" / "deformable-detr-refine_r18_tiny_1xb4-500i_shapes.py")

CASES = {
    "train-missing-config": (["train.py", "nowhere.py"], "error: config 'nowhere.py' does not exist"),
    "train-missing-resume-checkpoint": (["train.py", DEMO_CONFIG, "--resume", "nowhere.pth"],
                                        "error: checkpoint 'nowhere.pth' does not exist"),
    "test-missing-checkpoint": (["test.py", DEMO_CONFIG, "nowhere.pth"],
                                "error: checkpoint 'nowhere.pth' does not exist"),
    "profile-missing-config": (["profile_step.py", "nowhere.py"], "error: config 'nowhere.py' does not exist"),
    "benchmark-missing-config": (["benchmark.py", DEMO_CONFIG, "nowhere.py"],
                                 "error: config 'nowhere.py' does not exist"),
    "benchmark-train-missing-config": (["benchmark_train.py", "nowhere.py"],
                                       "error: config 'nowhere.py' does not exist"),
    "plot-missing-work-dir": (["plot_loss_curves.py", "nowhere", "--out", "loss.png"],
                              "error: no */vis_data/scalars.json under 'nowhere': is it a tools/train.py work dir?"),
}


def _run(tool, *args):
    return subprocess.run([sys.executable, str(REPO_ROOT / "tools" / tool), *args], cwd=REPO_ROOT,
                          env=checkout_environment(), capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("command, message", list(CASES.values()), ids=list(CASES))
def test_a_missing_path_is_one_line(command, message):
    completed = _run(*command)
    assert completed.returncode == 2, completed.stderr[-3000:]
    assert "Traceback" not in completed.stderr
    assert completed.stderr.strip().splitlines()[-1] == message
    assert len(completed.stdout.splitlines()) < 3  # no config dump, no run started


def test_a_misspelt_cfg_option_is_named_before_anything_runs():
    completed = _run("test.py", DEMO_CONFIG, "nowhere.pth", "--cfg-options", "trian_cfg.max_iters=1",
                     "test_cfg.type=TestLoop")
    lines = completed.stderr.strip().splitlines()
    assert lines[-2:] == ["warning: --cfg-options trian_cfg.max_iters: the config has no key 'trian_cfg' (did you "
                          "mean 'train_cfg'?); it is added as a new key",
                          "error: checkpoint 'nowhere.pth' does not exist"]
