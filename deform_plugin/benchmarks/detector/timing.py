"""Timing of whole training steps and batch-1 inference, each call bracketed by device synchronisation."""
from __future__ import annotations

import math
import sys
import time
from typing import Dict, Optional

import torch

from deform_plugin.benchmarks.common import peak_memory_mb, reset_peak_memory, summarize_ms
from deform_plugin.benchmarks.detector.configs import autocast_for
from deform_plugin.benchmarks.detector.iteration_timer import padded_batch_shape


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def progress(iterable, desc: str, enabled: bool):
    if not enabled:
        return iterable
    from tqdm import tqdm
    return tqdm(iterable, desc=desc, leave=False, dynamic_ncols=True, file=sys.stderr)


def mmdet_line(kind: str, img_per_s: float, mem: Optional[dict]) -> str:
    """mmdet's ``InferenceBenchmark`` format, which mmdet users read."""
    mem_text = f"{mem['allocated_mb']:.0f}" if mem else "n/a"
    return (f"[{kind}] fps: {img_per_s:.2f} img/s, times per image: {1000.0 / img_per_s:.2f} ms/img, "
            f"cuda memory: {mem_text} MB")


def loss_values(log_vars) -> Dict[str, float]:
    return {k: float(v) for k, v in log_vars.items() if k == "loss" or k.endswith("loss_cls") or k == "loss_bbox"}


def time_training(model, optim_wrapper, batch, device, warmup: int, steps: int, show_progress: bool,
                  label: str) -> dict:
    """mmengine's ``model.train_step`` on one fixed batch: ``warmup`` steps, then ``steps`` timed ones."""
    model.train()
    reset_peak_memory(device)
    first_losses = None
    for index in progress(range(warmup), f"{label} warm-up", show_progress):
        log_vars = model.train_step(batch, optim_wrapper)
        if index == 0:
            first_losses = loss_values(log_vars)
    times = []
    last_losses = None
    for index in progress(range(steps), f"{label} train", show_progress):
        synchronize(device)
        start = time.perf_counter()
        log_vars = model.train_step(batch, optim_wrapper)
        synchronize(device)
        times.append(time.perf_counter() - start)
        if index == steps - 1:
            last_losses = loss_values(log_vars)
    if first_losses is None:
        first_losses = last_losses
    summary = summarize_ms(times)
    batch_size = len(batch["inputs"])
    summary.update(img_per_s=batch_size * 1e3 / summary["median_ms"], memory=peak_memory_mb(device),
                   first_step_losses=first_losses, last_step_losses=last_losses,
                   losses_finite=all(math.isfinite(v) for v in (last_losses or {}).values()))
    return summary


def time_variable_sizes(model, optim_wrapper, batches, device, show_progress: bool, label: str) -> dict:
    """Training steps over batches of sizes never seen before, then over the same batches again.

    The first pass pays whatever a new input size costs (kernel compilation, cuDNN/cuBLAS plan selection, allocator
    growth); the second pass runs the same sizes warm. Their difference per step is the cost of a new size. With the
    ``cuda_graphs`` fast path the second pass also holds each size's capture (graphs are captured at a size's
    second step), so it is warm but not yet replayed.
    """
    model.train()
    passes = {}
    for name in ("new_sizes", "seen_sizes"):
        times = []
        for batch in progress(batches, f"{label} {name.replace('_', ' ')}", show_progress):
            synchronize(device)
            start = time.perf_counter()
            model.train_step(batch, optim_wrapper)
            synchronize(device)
            times.append(time.perf_counter() - start)
        images = sum(len(batch["inputs"]) for batch in batches)
        passes[name] = dict(summarize_ms(times), img_per_s=images / sum(times), total_s=sum(times))
    passes["new_size_cost_ms"] = (passes["new_sizes"]["total_s"] - passes["seen_sizes"]["total_s"]) * 1e3 / len(
        batches)
    divisor = getattr(model.data_preprocessor, "pad_size_divisor", 1)
    passes["distinct_batch_shapes"] = len({padded_batch_shape(batch, divisor)[0] for batch in batches})
    return passes


def time_inference(model, batch1, device, mode: str, warmup: int, steps: int, show_progress: bool,
                   label: str) -> dict:
    """``model.test_step`` at batch 1 under no_grad (and autocast in fp16/bf16 rows)."""
    model.eval()
    reset_peak_memory(device)
    times = []
    with torch.no_grad(), autocast_for(mode, device):
        for index in progress(range(warmup + steps), f"{label} infer", show_progress):
            synchronize(device)
            start = time.perf_counter()
            model.test_step(batch1)
            synchronize(device)
            if index >= warmup:
                times.append(time.perf_counter() - start)
    summary = summarize_ms(times)
    summary.update(fps=1e3 / summary["median_ms"], memory=peak_memory_mb(device))
    model.train()
    return summary
