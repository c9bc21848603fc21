"""The checks that tools/ make of what users pass (deform_plugin.cli): paths, --cfg-options keys, and what each
--launcher needs (the launches themselves: tests/tools/test_two_nodes.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mmengine.config import Config

from deform_plugin.cli import (TORCHRUN_VARIABLES, enable_resume_by_parameter_name, path_problem, prepare_launcher,
                               read_config, unknown_cfg_option_warnings, wrap_model_on_cpu)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEMO_CONFIG = REPO_ROOT / "configs" / "demo" / "deformable-detr-refine_r18_tiny_1xb4-500i_shapes.py"


def test_a_misspelt_top_level_key_names_the_closest_one():
    cfg = Config.fromfile(str(DEMO_CONFIG), import_custom_modules=False)
    keys = ["trian_cfg.max_iters", "train_cfg.max_iters", "model.bbox_head.num_classes", "randomness.seed",
            "load_from", "work_dir", "zzzz"]
    assert unknown_cfg_option_warnings(cfg, keys) == [
        "--cfg-options trian_cfg.max_iters: the config has no key 'trian_cfg' (did you mean 'train_cfg'?); it is "
        "added as a new key",
        "--cfg-options zzzz: the config has no key 'zzzz'; it is added as a new key",
    ]


def test_path_problems_name_the_path(tmp_path):
    (tmp_path / "file.py").write_text("x = 1\n")
    assert path_problem("config", str(tmp_path / "file.py")) is None
    assert path_problem("images", str(tmp_path), folder=True) is None
    assert path_problem("config", "nowhere.py") == "config 'nowhere.py' does not exist"
    assert path_problem("config", str(tmp_path)) == f"config {str(tmp_path)!r} is a folder, not a file"
    assert path_problem("images", str(tmp_path / "file.py"), folder=True) == (
        f"images {str(tmp_path / 'file.py')!r} is not a folder")
    assert path_problem("checkpoint", "x.pth", hint=" (pass 'none')") == (
        "checkpoint 'x.pth' does not exist (pass 'none')")


@pytest.mark.parametrize("text, message", [
    ("x = (\n", "SyntaxError"),
    ("_base_ = 'missing_base.py'\n", "missing_base.py"),
], ids=["syntax-error", "missing-base"])
def test_a_broken_config_is_one_line(tmp_path, capsys, text, message):
    config = tmp_path / "broken.py"
    config.write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        read_config(str(config))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith(f"error: config {str(config)!r} cannot be loaded: ") and message in err


def test_every_training_run_gets_the_optimizer_state_by_name_hook_once():
    cfg = Config(dict(custom_hooks=[dict(type="FastPathsHook", sdpa_attention=True)]))
    enable_resume_by_parameter_name(cfg)
    enable_resume_by_parameter_name(cfg)
    assert [hook["type"] for hook in cfg.custom_hooks] == ["FastPathsHook", "OptimizerStateByNameHook"]
    bare = Config(dict())
    enable_resume_by_parameter_name(bare)
    assert bare.custom_hooks == [dict(type="OptimizerStateByNameHook")]


def test_launcher_pytorch_outside_torchrun_names_the_missing_variables(monkeypatch, capsys):
    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(SystemExit) as exit_info:
        prepare_launcher(Config(dict(launcher="pytorch")))
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "error: --launcher pytorch reads RANK, WORLD_SIZE, MASTER_PORT from the environment, which torchrun sets for "
        "each rank: start the tool with tools/dist_train.sh or tools/dist_test.sh (or torchrun)\n")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's answer to a launcher that binds GPUs")
@pytest.mark.parametrize("launcher", ["slurm", "mpi"])
def test_launchers_that_bind_gpus_say_so_on_the_cpu(launcher, capsys):
    with pytest.raises(SystemExit) as exit_info:
        prepare_launcher(Config(dict(launcher=launcher)))
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith(
        f"error: --launcher {launcher} binds each task to a CUDA device and this machine has none")


def test_no_launcher_needs_nothing():
    cfg = Config(dict(launcher="none"))
    prepare_launcher(cfg)
    assert "model_wrapper_cfg" not in cfg


@pytest.mark.parametrize("wrapper, expected", [
    (None, dict(type="MMDistributedDataParallel", broadcast_buffers=False, find_unused_parameters=True,
                device_ids=None)),
    (dict(type="MMDistributedDataParallel", static_graph=True),
     dict(type="MMDistributedDataParallel", static_graph=True, device_ids=None)),
    (dict(type="FlatGradientsDataParallel"), dict(type="FlatGradientsDataParallel")),
], ids=["mmengine-default", "ddp-from-config", "flat-gradients"])
def test_cpu_ranks_wrap_the_model_without_devices(wrapper, expected):
    import deform_plugin.engine  # noqa: F401  (registers FlatGradientsDataParallel)
    cfg = Config(dict(find_unused_parameters=True, **({} if wrapper is None else dict(model_wrapper_cfg=wrapper))))
    wrap_model_on_cpu(cfg)
    assert cfg.model_wrapper_cfg == expected
