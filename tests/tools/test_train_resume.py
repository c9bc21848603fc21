"""tools/train.py --resume across configs: a plain (stock-layout) checkpoint under the fast config and a fast one
under the plain config, on the CPU, with the demo detector shrunk.

One chain of short runs, shared by the tests of this module: the plain config trains 2 iterations; its checkpoint,
with the recorded names removed (exactly what stock mmdet writes), resumes under the fast config for iteration 3;
that checkpoint (merged groups, names recorded) resumes under the plain config for iteration 4. A plain resume of
the plain checkpoint is the run that never switched, for iteration 3.
"""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch
from mmengine.optim import OptimWrapper
from mmengine.runner.checkpoint import _load_checkpoint

from deform_plugin.datasets import shapes
from deform_plugin.engine.optimizer_state_layout import IMPLEMENTATION_KEYS

# One pytest-xdist worker runs this whole module, so that its module-scoped fixture (processes) runs once.
pytestmark = pytest.mark.xdist_group("train_resume")

REPO_ROOT = Path(__file__).resolve().parents[2]
PLAIN_CONFIG = REPO_ROOT / "configs" / "demo" / "deformable-detr-refine_r18_tiny_1xb4-500i_shapes.py"
FAST_CONFIG = REPO_ROOT / "configs" / "fast" / "deformable-detr-refine_r18_tiny_1xb4-500i_shapes-fast.py"
# A few images are enough for 4 iterations of batch 1; the set's images do not depend on how many are generated.
SPLIT_SIZES = {"train": 8, "val": 2}


def _options(cache_root: Path, max_iters: int, save: bool) -> list[str]:
    data = [f"{section}.cache_root={cache_root}" for section in (
        "train_dataloader.dataset", "val_dataloader.dataset", "test_dataloader.dataset", "val_evaluator",
        "test_evaluator")]
    checkpoints = (["default_hooks.checkpoint.interval=2"] if save else
                   ["default_hooks.checkpoint.interval=1000", "default_hooks.checkpoint.save_last=False"])
    return [
        "--cfg-options", f"train_cfg.max_iters={max_iters}", "train_cfg.val_begin=1000",
        # The demo detector, smaller: one image per batch, one encoder layer, 10 queries.
        "train_dataloader.batch_size=1", "model.encoder.num_layers=1", "model.num_queries=10",
        "default_hooks.logger.interval=1", "log_processor.window_size=1", *checkpoints, *data]


class LoadedOptimizerState:
    """Records what each ``OptimWrapper.load_state_dict`` call left in the optimizer, before any step changes it."""

    def __init__(self):
        self.by_tensor = []

    def __call__(self, real_load):
        def load_state_dict(wrapper, state_dict):
            real_load(wrapper, state_dict)
            self.by_tensor.append((
                {id(p): {k: v.clone() for k, v in state.items()} for p, state in wrapper.optimizer.state.items()},
                {id(p): {k: v for k, v in group.items() if k not in IMPLEMENTATION_KEYS | {"params"}}
                 for group in wrapper.optimizer.param_groups for p in group["params"]}))
        return load_state_dict

    def by_name(self, runner):
        """(state, hyper-parameters) per parameter name, as loaded into the last resumed ``runner``."""
        (states, hyper), = self.by_tensor
        self.by_tensor.clear()
        names = {id(p): n for n, p in runner.model.named_parameters()}
        return ({names[i]: s for i, s in states.items()}, {names[i]: h for i, h in hyper.items()})


def _saved_by_name(checkpoint_path: Path):
    """(state, hyper-parameters) per parameter name in a checkpoint whose groups record their names."""
    saved = _load_checkpoint(str(checkpoint_path), map_location="cpu")["optimizer"]
    states, hyper = {}, {}
    for group in saved["param_groups"]:
        for position, name in zip(group["params"], group["param_names"]):
            if position in saved["state"]:
                states[name] = saved["state"][position]
            hyper[name] = {k: v for k, v in group.items() if k not in IMPLEMENTATION_KEYS | {"params", "param_names"}}
    return states, hyper


def _assert_loaded_as_saved(loaded, saved):
    loaded_states, loaded_hyper = loaded
    saved_states, saved_hyper = saved
    assert loaded_states.keys() == saved_states.keys()
    for name, state in saved_states.items():
        for key, value in state.items():
            torch.testing.assert_close(loaded_states[name][key], value, rtol=0, atol=0, msg=f"{name} {key}")
    # lr and initial_lr as the schedulers left them, weight_decay, lr_mult: each parameter's own.
    assert loaded_hyper == saved_hyper


def _history(runner, key: str) -> list[float]:
    values, _ = runner.message_hub.get_scalar(f"train/{key}").data
    return [float(v) for v in values]


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """Run the chain of the module docstring; returns its runners, loaded states and work dirs."""
    spec = importlib.util.spec_from_file_location("deform_plugin_tools_train", REPO_ROOT / "tools" / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    root = tmp_path_factory.mktemp("resume")
    cache_root = root / "shapes_cache"
    loaded = LoadedOptimizerState()
    runs = {}
    previous_threads = torch.get_num_threads()
    # One thread: the ops are small, and two OpenMP threads on a shared 2-core machine wait on each other.
    torch.set_num_threads(1)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(shapes, "SPLIT_SIZES", SPLIT_SIZES)
            patch.setattr(OptimWrapper, "load_state_dict", loaded(OptimWrapper.load_state_dict))

            runs["plain"] = train.main([str(PLAIN_CONFIG), "--work-dir", str(root / "plain"),
                                        *_options(cache_root, 2, save=True)])
            plain_checkpoint = root / "plain" / "iter_2.pth"
            stock_checkpoint = root / "stock_iter_2.pth"
            checkpoint = _load_checkpoint(str(plain_checkpoint), map_location="cpu")
            for group in checkpoint["optimizer"]["param_groups"]:
                group.pop("param_names")
            torch.save(checkpoint, stock_checkpoint)

            runs["plain_to_fast"] = train.main([str(FAST_CONFIG), "--work-dir", str(root / "fast"), "--resume",
                                                str(stock_checkpoint), *_options(cache_root, 3, save=True)])
            runs["plain_to_fast_loaded"] = loaded.by_name(runs["plain_to_fast"])
            runs["fast_to_plain"] = train.main([str(PLAIN_CONFIG), "--work-dir", str(root / "plain_again"),
                                                "--resume", str(root / "fast" / "iter_3.pth"),
                                                *_options(cache_root, 4, save=False)])
            runs["fast_to_plain_loaded"] = loaded.by_name(runs["fast_to_plain"])
            runs["never_switched"] = train.main([str(PLAIN_CONFIG), "--work-dir", str(root / "plain_resumed"),
                                                 "--resume", str(plain_checkpoint),
                                                 *_options(cache_root, 3, save=False)])
            loaded.by_tensor.clear()
    finally:
        torch.set_num_threads(previous_threads)
    runs.update(plain_checkpoint=plain_checkpoint, fast_checkpoint=root / "fast" / "iter_3.pth")
    yield runs
    shutil.rmtree(root, ignore_errors=True)


def test_plain_checkpoint_resumes_under_the_fast_config(chain):
    runner = chain["plain_to_fast"]
    assert runner.iter == 3
    assert len(runner.optim_wrapper.optimizer.param_groups) == 2  # merged: the default lr and the 0.1x lr
    # The stock checkpoint's state, by name, exactly; it recorded no names, so they come from the plain run's file.
    _assert_loaded_as_saved(chain["plain_to_fast_loaded"], _saved_by_name(chain["plain_checkpoint"]))


def test_fast_checkpoint_resumes_under_the_plain_config(chain):
    runner = chain["fast_to_plain"]
    assert runner.iter == 4
    groups = runner.optim_wrapper.optimizer.param_groups
    assert len(groups) == sum(p.requires_grad for p in runner.model.parameters())  # one group per tensor
    saved = _load_checkpoint(str(chain["fast_checkpoint"]), map_location="cpu")["optimizer"]
    assert [len(group["param_names"]) for group in saved["param_groups"]] == [
        len(group["params"]) for group in chain["plain_to_fast"].optim_wrapper.optimizer.param_groups]
    _assert_loaded_as_saved(chain["fast_to_plain_loaded"], _saved_by_name(chain["fast_checkpoint"]))
    # The schedulers' per-group state follows the groups (and mmengine's base_lr entry).
    for scheduler in runner.param_schedulers:
        assert len(scheduler.base_values) == len(scheduler.get_last_value()) == len(groups) + 1


def test_the_switched_run_continues_as_the_run_that_never_switched(chain):
    switched, never_switched = chain["plain_to_fast"], chain["never_switched"]
    # The message hub resumes the history: iterations 1-2 from the checkpoint, 3 from the resumed run.
    for key in ("lr", "base_lr"):
        assert _history(switched, key) == _history(never_switched, key), key
    torch.testing.assert_close(_history(switched, "loss"), _history(never_switched, "loss"), rtol=1e-5, atol=0)
    # The fast paths agree with the plain step to float rounding: compare each tensor's update of iteration 3
    # relative to its size. An optimizer state that went to the wrong tensor, or none, changes it by tens of percent.
    before = _load_checkpoint(str(chain["plain_checkpoint"]), map_location="cpu")["state_dict"]
    expected = dict(never_switched.model.named_parameters())
    for name, parameter in switched.model.named_parameters():
        if not parameter.requires_grad:
            continue
        update = expected[name].detach() - before[name]
        if update.norm() == 0:
            continue
        error = (parameter.detach() - expected[name].detach()).norm() / update.norm()
        assert error < 1e-2, f"{name}: relative update error {error:.2e}"
