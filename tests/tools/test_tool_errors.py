"""Every tool ends a mistake in its command line with one ``error:`` line naming the path, exit status 2, before it
builds anything; a misspelt --cfg-options key is named with the closest key first. (tools/infer.py and
tools/export_onnx.py have their own cases in their test files.)

Each command line runs in this process (tests/helpers/tool_main.py): an error of the command line needs no fresh
interpreter. What would build a runner or start a benchmark is replaced by a stub that fails the test if reached.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from tool_main import run_tool_main

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


@pytest.fixture
def run(monkeypatch, capsys):
    import deform_plugin.cli
    monkeypatch.chdir(REPO_ROOT)  # where a user runs the tools from
    from deform_plugin.benchmarks.detector import run as benchmark_run
    from deform_plugin.benchmarks.detector import user_path

    def reached(*args, **kwargs):
        raise AssertionError("the tool went on to build or run something")
    for module, name in ((deform_plugin.cli, "build_runner"), (benchmark_run, "main"), (user_path, "main")):
        monkeypatch.setattr(module, name, reached)
    return lambda tool, *args: run_tool_main(tool, args, monkeypatch, capsys)


@pytest.mark.parametrize("command, message", list(CASES.values()), ids=list(CASES))
def test_a_missing_path_is_one_line(run, command, message):
    status, stdout, stderr = run(*command)
    assert status == 2, stderr[-3000:]
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == message
    assert len(stdout.splitlines()) < 3  # no config dump, no run started


def test_a_misspelt_cfg_option_is_named_before_anything_runs(run):
    status, _, stderr = run("test.py", DEMO_CONFIG, "nowhere.pth", "--cfg-options", "trian_cfg.max_iters=1",
                            "test_cfg.type=TestLoop")
    lines = stderr.strip().splitlines()
    assert status == 2
    assert lines[-2:] == ["warning: --cfg-options trian_cfg.max_iters: the config has no key 'trian_cfg' (did you "
                          "mean 'train_cfg'?); it is added as a new key",
                          "error: checkpoint 'nowhere.pth' does not exist"]
