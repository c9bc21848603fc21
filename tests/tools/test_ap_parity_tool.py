"""tools/ap_parity.py: the command line. A bad value ends it with one ``error:`` line naming the value (exit status
2) before anything runs; ``--dry-run`` prints the plan and the derived configs and writes nothing. (The studies
themselves are tested in tests/benchmarks/detector/test_ap_parity.py.)"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("deform_plugin_tools_ap_parity", REPO_ROOT / "tools" / "ap_parity.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def error_of(tool, capsys, *argv) -> str:
    with pytest.raises(SystemExit) as ended:
        tool.main(list(argv))
    assert ended.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_an_unknown_config_is_named(tool, capsys):
    assert error_of(tool, capsys, "--device", "cpu", "--configs", "detr", "--rows", "stock:fp32") == (
        "error: --configs: unknown config 'detr' (known: ddetr, dino, demo)")


def test_an_unknown_row_is_named(tool, capsys):
    message = error_of(tool, capsys, "--rows", "mmcv:fp32")
    assert "row 'mmcv:fp32' is not SIDE:MODE[:no-buckets][:cold][:cudnn-v7][:own-shapes]: side 'mmcv' is not one of " \
        "stock, ours" in message
    assert "own-shapes pads per rank under several GPUs, and every AP parity run trains on one" in error_of(
        tool, capsys, "--rows", "ours:bf16:own-shapes")


def test_bf16_rows_need_a_gpu(tool, capsys):
    assert error_of(tool, capsys, "--device", "cpu", "--configs", "demo", "--rows", "stock:fp32", "ours:bf16") == (
        "error: --rows ours:bf16: mixed precision (bf16) needs --device cuda (the training scripts' AMP runs on CUDA)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_cuda_without_a_gpu_is_refused(tool, capsys):
    assert error_of(tool, capsys, "--gpus", "0,1") == (
        "error: --device cuda, but no CUDA device is visible here (use --device cpu for a CPU run)")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="checks the GPU indices of a machine with a GPU")
def test_a_gpu_index_that_is_not_there_is_named(tool, capsys):
    count = torch.cuda.device_count()
    assert error_of(tool, capsys, "--gpus", f"0,{count}") == (
        f"error: --gpus: GPU {count} is not available ({count} visible: 0-{count - 1})")


def test_scales_too_small_for_dino_are_refused(tool, capsys):
    assert error_of(tool, capsys, "--dry-run", "--configs", "dino", "--scales", "160", "256") == (
        "error: dino: side 160 gives the encoder 534 tokens, but the model picks its 900 queries among them "
        "(two-stage top-k): use --scales and --test-scale of at least 201")


def test_report_only_needs_a_work_dir_with_a_plan(tool, capsys, tmp_path):
    assert error_of(tool, capsys, "--report-only", str(tmp_path)) == (
        f"error: --report-only '{tmp_path}': no plan.json there (is it an ap_parity --work-dir?)")


def test_dry_run_prints_the_plan_and_the_derived_configs(tool, capsys, tmp_path):
    work = tmp_path / "work"
    assert tool.main(["--dry-run", "--device", "cpu", "--configs", "demo", "--rows", "stock:fp32",
                      "ours:fp32:no-buckets", "--seeds", "0", "1", "--iters", "50", "--warmup-iters", "5",
                      "--work-dir", str(work)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("4 runs: 1 configs x 2 rows x 2 seeds, 4 at a time per CPU; baseline row stock:fp32; "
                          "evaluations after iterations [25, 50]; paced; time limit per run: none; deadline: none")
    assert "demo__stock-fp32__seed1: CPU:" in out and "deform_plugin.benchmarks.detector.stock_train" in out
    assert "derived from configs/demo/deformable-detr-refine_r18_tiny_1xb4-500i_shapes.py:" in out
    assert "derived from configs/fast/deformable-detr-refine_r18_tiny_1xb4-500i_shapes-fast.py:" in out
    assert "custom_hooks: ['FastPathsHook', 'IterationTimerHook', 'ParityRunHook']" in out
    assert "load_from: WORK_DIR/inits/demo/seed0.pth" in out
    assert not work.exists()  # a dry run writes nothing


def test_auto_iterations_need_a_deadline_and_every_run_at_once(tool, capsys):
    assert error_of(tool, capsys, "--device", "cpu", "--configs", "demo", "--rows", "stock:fp32", "--iters",
                    "auto") == "error: --iters auto needs --deadline: the schedule is what fits before it"
    assert error_of(tool, capsys, "--device", "cpu", "--configs", "demo", "--rows", "stock:fp32", "ours:fp32",
                    "--iters", "auto", "--deadline", "300", "--per-gpu", "1") == (
        "error: --iters auto needs every run at once: --per-gpu 1 leaves runs waiting for a slot (drop --per-gpu, "
        "or give --iters N)")
    assert "--iters 'ten' is neither a number of iterations nor 'auto'" in error_of(tool, capsys, "--iters", "ten")
