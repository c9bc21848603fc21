"""The main job: train the tiny Deformable-DETR demo on the embedded shapes set, evaluate COCO bbox AP, report.

    python tools/demo.py [--config CONFIG] [--work-dir DIR] [--max-iters N] [--data-cache DIR]
                         [--cfg-options KEY=VALUE ...]

1. generates the shapes set on first use (seconds; cached under $DEFORM_PLUGIN_DATA or ~/.cache/deform_plugin);
2. trains for the config's bounded number of iterations, with a progress bar on a terminal and mmengine's log
   lines every few iterations everywhere;
3. evaluates COCO bbox AP on the val split;
4. prints where the checkpoint and the logs are, the first and last logged loss, and the AP.

Exits non-zero if any step fails, if the loss is not finite, or if it did not go down.
"""
from __future__ import annotations

import argparse
import math
import os
import os.path as osp
import sys
import time
from typing import Optional, Sequence

# Threads that wait for work sleep instead of spinning. On a small, shared CPU the spinning OpenMP threads of
# torch's default policy took the cores from the thread doing the work (2x slower per iteration, measured on 2 cores
# with other jobs running); when the machine is idle, passive waiting costs nothing measurable. It must be set
# before torch loads its OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import deform_plugin  # noqa: E402,F401  (before mmdet: installs the mmcv-lite stand-in and the checkpoint fix)
from mmengine.config import DictAction
from mmengine.hooks import Hook
from tqdm import tqdm

from deform_plugin.cli import build_runner, load_config
from deform_plugin.cpu_threads import configure_cpu_threads
from deform_plugin.datasets import ensure_shapes_dataset

REPO_ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
DEFAULT_CONFIG = osp.join(REPO_ROOT, "configs", "demo", "deformable-detr-refine_r18_tiny_1xb4-500i_shapes.py")
DEFAULT_WORK_DIR = osp.join(REPO_ROOT, "work_dirs", "demo")


class TrainProgressHook(Hook):
    """A progress bar over the training iterations (terminals only) that also keeps the val metrics.

    mmengine's LoggerHook lines remain the progress display in logs and pipes, where a bar would only add noise.
    """

    priority = "LOW"

    def __init__(self) -> None:
        self.bar: Optional[tqdm] = None
        self.val_metrics: dict = {}
        self.last_train_iter_end: Optional[float] = None

    def before_train(self, runner) -> None:
        # disable=None: tqdm turns itself off when stderr is not a terminal.
        self.bar = tqdm(total=runner.max_iters, initial=runner.iter, desc="train", unit="it", disable=None,
                        dynamic_ncols=True, mininterval=1.0)

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None) -> None:
        self.last_train_iter_end = time.time()
        if self.bar is None:
            return
        self.bar.update(1)
        if outputs and "loss" in outputs:
            loss = outputs["loss"]
            loss = loss.detach() if hasattr(loss, "detach") else loss  # a graph tensor: read its value only
            self.bar.set_postfix(loss=f"{float(loss):.3f}", refresh=False)

    def after_train(self, runner) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def after_val_epoch(self, runner, metrics=None) -> None:
        self.val_metrics = dict(metrics or {})


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="deform_plugin demo: train + evaluate a tiny Deformable-DETR")
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="the demo config")
    parser.add_argument("--work-dir", default=DEFAULT_WORK_DIR, help="where checkpoints and logs go")
    parser.add_argument("--max-iters", type=int, help="train for this many iterations instead of the config's")
    parser.add_argument("--data-cache", help="cache folder of the shapes set (default: $DEFORM_PLUGIN_DATA or "
                        "~/.cache/deform_plugin/shapes)")
    parser.add_argument("--cfg-options", nargs="+", action=DictAction, help="override settings of the config")
    return parser.parse_args(argv)


def shorten_schedule(cfg, max_iters: int) -> None:
    """Scale the iteration-based parts of the demo config (validation, checkpoint, LR steps) to ``max_iters``."""
    old = cfg.train_cfg.max_iters
    cfg.train_cfg.max_iters = max_iters
    cfg.train_cfg.val_interval = max_iters
    cfg.default_hooks.checkpoint.interval = max_iters
    for scheduler in cfg.param_scheduler:
        if scheduler.get("end", 0) >= old:
            scheduler.end = max_iters
        if "milestones" in scheduler:
            scheduler.milestones = [max(1, round(m * max_iters / old)) for m in scheduler.milestones]


def logged_losses(runner) -> tuple[float, float]:
    """The first and the last loss as the logger printed them: means over the first and last logging windows."""
    history, _ = runner.message_hub.get_scalar("train/loss").data
    window = max(1, min(runner.cfg.default_hooks.logger.get("interval", 10), len(history) // 2 or 1))
    return float(history[:window].mean()), float(history[-window:].mean())


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    started = time.time()

    dataset_dir = ensure_shapes_dataset(args.data_cache)
    print(f"[demo] shapes dataset ready at {dataset_dir} ({time.time() - started:.1f}s)", flush=True)

    cfg = load_config(args.config, args.work_dir, args.cfg_options, launcher="none")
    if args.data_cache is not None:
        for section in (cfg.train_dataloader.dataset, cfg.val_dataloader.dataset, cfg.test_dataloader.dataset,
                        cfg.val_evaluator, cfg.test_evaluator):
            section.cache_root = args.data_cache
    if args.max_iters is not None:
        shorten_schedule(cfg, args.max_iters)

    runner = build_runner(cfg)
    progress = TrainProgressHook()
    runner.register_hook(progress)
    print(f"[demo] training {osp.basename(args.config)} for {cfg.train_cfg.max_iters} iterations "
          f"(validation with COCO bbox AP at the end)", flush=True)
    runner.train()
    # Validation runs inside runner.train(), after the last iteration.
    train_done = progress.last_train_iter_end or time.time()

    metrics = progress.val_metrics or runner.val_loop.run()
    first_loss, last_loss = logged_losses(runner)
    checkpoint = _last_checkpoint(runner.work_dir)
    log_file = osp.join(runner.log_dir, f"{runner.timestamp}.log")
    bbox_map = metrics.get("coco/bbox_mAP")

    print("\n[demo] ==== summary ====")
    print(f"[demo] checkpoint : {checkpoint}")
    print(f"[demo] log        : {log_file}")
    print(f"[demo] scalars    : {osp.join(runner.log_dir, 'vis_data', 'scalars.json')}")
    print(f"[demo] loss       : first logged {first_loss:.4f} -> last logged {last_loss:.4f}")
    print(f"[demo] val bbox   : mAP {bbox_map}  mAP_50 {metrics.get('coco/bbox_mAP_50')}  "
          f"mAP_75 {metrics.get('coco/bbox_mAP_75')}")
    print(f"[demo] time       : {train_done - started:.0f}s to set up and train, "
          f"{time.time() - train_done:.0f}s to evaluate, {time.time() - started:.0f}s in all")

    failures = []
    if not (math.isfinite(first_loss) and math.isfinite(last_loss)):
        failures.append(f"the loss is not finite ({first_loss} -> {last_loss})")
    elif last_loss >= first_loss:
        failures.append(f"the loss did not go down ({first_loss:.4f} -> {last_loss:.4f})")
    if bbox_map is None:
        failures.append(f"no coco/bbox_mAP among the val metrics {sorted(metrics)}")
    if checkpoint is None or not osp.isfile(checkpoint):
        failures.append(f"no checkpoint was saved in {runner.work_dir}")
    for failure in failures:
        print(f"[demo] FAILED: {failure}", file=sys.stderr)
    return 1 if failures else 0


def _last_checkpoint(work_dir: str) -> Optional[str]:
    # CheckpointHook records the path of the last checkpoint it saved in this file.
    pointer = osp.join(work_dir, "last_checkpoint")
    if not osp.isfile(pointer):
        return None
    with open(pointer) as f:
        return f.read().strip() or None


if __name__ == "__main__":
    configure_cpu_threads()
    sys.exit(main(sys.argv[1:]))
