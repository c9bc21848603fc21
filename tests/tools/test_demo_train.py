"""The demo config through the tools: a few CPU training iterations, a checkpoint, resume, and evaluation.

One short training run is shared by the tests of this module (module-scoped fixtures) to keep the suite fast.
"""
from __future__ import annotations

import importlib.util
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from mmengine.runner.checkpoint import _load_checkpoint

# One pytest-xdist worker runs this whole module, so that its module-scoped fixture (processes) runs once.
pytestmark = pytest.mark.xdist_group("demo_train")

REPO_ROOT = Path(__file__).resolve().parents[2]
DEMO_CONFIG = REPO_ROOT / "configs" / "demo" / "deformable-detr-refine_r18_tiny_1xb4-500i_shapes.py"
TRAIN_ITERS = 4
RESUMED_ITERS = 6
EVAL_IMAGES = 8


def _load_tool(name: str):
    spec = importlib.util.spec_from_file_location(f"deform_plugin_tools_{name}", REPO_ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _data_options(cache_root: Path) -> list[str]:
    sections = ("train_dataloader.dataset", "val_dataloader.dataset", "test_dataloader.dataset", "val_evaluator",
                "test_evaluator")
    return [f"{section}.cache_root={cache_root}" for section in sections]


def _train_options(cache_root: Path, max_iters: int) -> list[str]:
    return [
        "--cfg-options",
        f"train_cfg.max_iters={max_iters}",
        # The loop validates after its last iteration unless validation has not begun; tools/test.py covers it below.
        "train_cfg.val_begin=1000",
        "default_hooks.checkpoint.interval=2",
        "default_hooks.logger.interval=1",
        "log_processor.window_size=1",
        *_data_options(cache_root),
    ]


def _losses(runner) -> list[float]:
    history, _ = runner.message_hub.get_scalar("train/loss").data
    return [float(v) for v in history]


@pytest.fixture(scope="module", autouse=True)
def single_intra_op_thread():
    """One torch thread for this module: the model's ops are small, and on a 2-core machine shared with other jobs
    two OpenMP threads spin at every barrier waiting for each other (iterations measured 10x slower)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shapes_cache")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, cache_root):
    """Train the demo for a few iterations with tools/train.py; returns (runner, work_dir)."""
    work_dir = tmp_path_factory.mktemp("work_dir")
    train = _load_tool("train")
    runner = train.main([str(DEMO_CONFIG), "--work-dir", str(work_dir), *_train_options(cache_root, TRAIN_ITERS)])
    return runner, work_dir


def test_demo_trains_with_finite_loss(trained):
    runner, _ = trained
    losses = _losses(runner)
    assert runner.iter == TRAIN_ITERS
    assert len(losses) == TRAIN_ITERS
    assert all(math.isfinite(loss) for loss in losses), losses


def test_demo_model_uses_the_plugin_attention(trained):
    from mmcv.ops import MultiScaleDeformableAttention as StockMSDA

    runner, _ = trained
    msda = [m for m in runner.model.modules() if isinstance(m, StockMSDA)]
    assert msda, "the demo model has no multi-scale deformable attention"
    assert all(type(m).__module__.startswith("deform_plugin") for m in msda), {type(m).__module__ for m in msda}


def test_checkpoint_saved_and_needs_the_allow_list(trained):
    _, work_dir = trained
    checkpoint = work_dir / f"iter_{TRAIN_ITERS}.pth"
    assert checkpoint.is_file()
    assert (work_dir / "last_checkpoint").read_text().strip() == str(checkpoint)
    # What makes this test meaningful: the file holds non-tensor objects that a bare weights-only load refuses.
    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(str(checkpoint))
    assert "mmengine.logging.history_buffer.HistoryBuffer" in unsafe


def test_resume_continues_from_the_checkpoint(trained, cache_root, tmp_path):
    # A copy of the shared run: resuming writes new checkpoints, which the other tests must not see.
    work_dir = tmp_path / "resumed"
    shutil.copytree(trained[1], work_dir)
    train = _load_tool("train")
    runner = train.main([str(DEMO_CONFIG), "--work-dir", str(work_dir), "--resume",
                         *_train_options(cache_root, RESUMED_ITERS)])
    assert runner.iter == RESUMED_ITERS
    # The message hub came back from the checkpoint: the loss history spans the first run too.
    losses = _losses(runner)
    assert len(losses) == RESUMED_ITERS
    assert all(math.isfinite(loss) for loss in losses), losses


def test_tools_test_evaluates_coco_bbox(trained, cache_root, tmp_path):
    _, work_dir = trained
    checkpoint = work_dir / f"iter_{TRAIN_ITERS}.pth"
    out = tmp_path / "predictions.pkl"
    test = _load_tool("test")
    metrics = test.main([
        str(DEMO_CONFIG), str(checkpoint), "--work-dir", str(tmp_path), "--out", str(out),
        "--cfg-options", f"test_dataloader.dataset.indices={EVAL_IMAGES}", *_data_options(cache_root)
    ])
    assert "coco/bbox_mAP" in metrics
    assert -1.0 <= metrics["coco/bbox_mAP"] <= 1.0
    assert out.is_file() and os.path.getsize(out) > 0


def test_load_from_restores_the_weights(trained, cache_root, tmp_path):
    """``load_from`` (what tools/test.py sets) gives back exactly the trained weights."""
    _, work_dir = trained
    checkpoint = work_dir / f"iter_{TRAIN_ITERS}.pth"
    train = _load_tool("train")
    cfg = train.load_config(str(DEMO_CONFIG), str(tmp_path), None, "none")
    cfg.load_from = str(checkpoint)
    fresh = train.build_runner(cfg)
    fresh.load_or_resume()
    state = _load_checkpoint(str(checkpoint), map_location="cpu")["state_dict"]
    restored = fresh.model.state_dict()
    assert state.keys() == restored.keys()
    for key, value in state.items():
        torch.testing.assert_close(restored[key], value, rtol=0, atol=0, msg=key)


def test_demo_shortens_the_schedule_consistently():
    """tools/demo.py --max-iters scales validation, checkpointing and the LR step with the iteration count."""
    demo = _load_tool("demo")
    cfg = demo.load_config(str(DEMO_CONFIG), None, None, "none")
    full = cfg.train_cfg.max_iters
    demo.shorten_schedule(cfg, full // 5)
    assert cfg.train_cfg.max_iters == cfg.train_cfg.val_interval == cfg.default_hooks.checkpoint.interval == full // 5
    step = next(s for s in cfg.param_scheduler if s.type == "MultiStepLR")
    assert step.end == full // 5
    assert step.milestones == [round(0.8 * full / 5)]


def test_no_shape_buckets_drops_only_the_bucket_hook(tmp_path, monkeypatch):
    """``tools/train.py --no-shape-buckets`` leaves a fast config's other hooks as they are; on a config without
    the hook it changes nothing and says so."""
    train = _load_tool("train")
    logged = []
    monkeypatch.setattr(train, "print_log", lambda message, **kwargs: logged.append(message))
    fast = REPO_ROOT / "configs" / "fast" / "dino-4scale_r50_8xb2-12e_coco_deform-plugin-fast.py"
    shipped = train.build_train_config(train.parse_args([str(fast), "--work-dir", str(tmp_path)]))
    stripped = train.build_train_config(train.parse_args([str(fast), "--work-dir", str(tmp_path),
                                                          "--no-shape-buckets"]))
    shipped_types = [hook["type"] for hook in shipped.custom_hooks]
    assert "ShapeBucketsHook" in shipped_types
    assert [hook["type"] for hook in stripped.custom_hooks] == [t for t in shipped_types if t != "ShapeBucketsHook"]
    plain = train.build_train_config(train.parse_args([str(DEMO_CONFIG), "--work-dir", str(tmp_path),
                                                       "--no-shape-buckets"]))
    assert "ShapeBucketsHook" not in [hook["type"] for hook in plain.get("custom_hooks", [])]
    assert len(logged) == 1 and "has no ShapeBucketsHook" in logged[0] and str(DEMO_CONFIG) in logged[0]


def test_cudnn_api_selects_the_process_api_and_the_fast_paths_hooks_choice(tmp_path, monkeypatch, capsys):
    """``tools/train.py --cudnn-api`` sets cuDNN's API for the process (read at its first convolution) and the
    config's FastPathsHook's ``cudnn_v7_api`` to match; a clash with the variable as the user set it is a usage
    error naming both."""
    from deform_plugin.conv_planning import CUDNN_V8_API_DISABLED
    train = _load_tool("train")
    fast = REPO_ROOT / "configs" / "fast" / "dino-4scale_r50_8xb2-12e_coco_deform-plugin-fast.py"
    monkeypatch.delenv(CUDNN_V8_API_DISABLED, raising=False)
    cfg = train.build_train_config(train.parse_args([str(fast), "--work-dir", str(tmp_path), "--cudnn-api", "v7"]))
    assert os.environ[CUDNN_V8_API_DISABLED] == "1"
    hooks = [hook for hook in cfg.custom_hooks if hook["type"] == "FastPathsHook"]
    assert len(hooks) == 1 and hooks[0]["cudnn_v7_api"] is True
    monkeypatch.delenv(CUDNN_V8_API_DISABLED)
    cfg = train.build_train_config(train.parse_args([str(fast), "--work-dir", str(tmp_path), "--cudnn-api", "v8"]))
    assert os.environ[CUDNN_V8_API_DISABLED] == "0"
    assert [hook["cudnn_v7_api"] for hook in cfg.custom_hooks if hook["type"] == "FastPathsHook"] == [False]
    unchanged = train.build_train_config(train.parse_args([str(fast), "--work-dir", str(tmp_path)]))
    assert all("cudnn_v7_api" not in hook for hook in unchanged.custom_hooks if hook["type"] == "FastPathsHook")
    monkeypatch.setenv(CUDNN_V8_API_DISABLED, "1")
    with pytest.raises(SystemExit) as ended:
        train.parse_args([str(fast), "--cudnn-api", "v8"])
    assert ended.value.code == 2
    assert (f"--cudnn-api v8: the environment sets {CUDNN_V8_API_DISABLED}='1', which selects cuDNN's v7 API"
            in capsys.readouterr().err)
    assert os.environ[CUDNN_V8_API_DISABLED] == "1"
