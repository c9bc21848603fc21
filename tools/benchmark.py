#!/usr/bin/env python
"""Whole-detector benchmark (and profile) of mmdet configs on synthetic batches, several variants in one run.

A *row* is ``BACKEND:MODE[:FAST]``, timed on every config given:

    BACKEND  stock    mmdet/mmcv untouched: a child process that never imports deform_plugin (drops the config's
                      deform_plugin imports and fast paths); needs mmcv's compiled ops on CUDA
             mmcv | pytorch | triton | auto
                      deform_plugin's MSDA module with that backend (``set_default_backend``)
    MODE     fp32 | fp16 | bf16    (fp16/bf16 = mmengine ``AmpOptimWrapper`` with that dtype; autocast at inference)
    FAST     config (default: whatever the config selects) | none | all | a '+' list of
             optim (merged param groups + fused/foreach optimizer), sdpa (SDPA attention bricks),
             matching (Hungarian matching with fewer host syncs)

The first row is the baseline of the speedup columns. Examples::

    # stock fp32 vs ours fp32 / bf16 with every fast path, three detectors, JSON/CSV/PNG in bench_results/
    python tools/benchmark.py configs/deformable_detr/deformable-detr-refine-twostage_r50_16xb2-50e_coco_deform-plugin.py \\
        configs/dino/dino-4scale_r50_8xb2-12e_coco_deform-plugin.py \\
        --rows stock:fp32 triton:fp32:all triton:bf16:all --out-dir bench_results/h100

    # CPU smoke run
    python tools/benchmark.py configs/demo/deformable-detr-refine_r18_tiny_1xb4-500i_shapes.py \\
        --device cpu --shape 128 160 --steps 2 --warmup 1 --rows pytorch:fp32:none pytorch:fp32:all

Each timed training step is mmengine's ``model.train_step`` (data preprocessor, forward, loss, backward, clip,
optimizer step, zero_grad) on one fixed synthetic batch, bracketed by device synchronisation. ``--profile`` adds a
torch.profiler breakdown per row (see ``tools/profile_step.py``).
"""
from __future__ import annotations

import argparse
import copy
import csv
import importlib.util
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from repo_commit import repo_commit  # noqa: E402  (a sibling in tools/)
if importlib.util.find_spec("deform_plugin") is None:
    # Run from a checkout without `pip install -e .`: import the package from the repository. Finding the spec
    # does not import it, so stock rows stay free of deform_plugin.
    sys.path.insert(0, REPO_ROOT)
BACKEND_CHOICES = ("stock", "mmcv", "pytorch", "triton", "auto")
MODE_CHOICES = ("fp32", "fp16", "bf16")
FAST_PATH_CHOICES = ("optim", "sdpa", "matching")
MERGED_CONSTRUCTOR = "MergedParamGroupsOptimWrapperConstructor"
PROFILE_COMPONENTS = ("MSDA", "GEMM", "convolution", "optimizer", "matching", "elementwise", "memcpy", "other")


# ---------------------------------------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    backend: str
    mode: str
    fast: str = "config"  # 'config', 'none', 'all' or a '+' list of FAST_PATH_CHOICES

    @property
    def label(self) -> str:
        return f"{self.backend}:{self.mode}:{self.fast}"

    def fast_set(self) -> Optional[frozenset]:
        """The fast paths to force, or None to keep what the config selects."""
        if self.fast == "config":
            return None
        if self.fast == "none":
            return frozenset()
        if self.fast == "all":
            return frozenset(FAST_PATH_CHOICES)
        return frozenset(self.fast.split("+"))


def parse_row(text: str) -> Row:
    parts = text.split(":")
    if not 2 <= len(parts) <= 3:
        raise argparse.ArgumentTypeError(f"row {text!r} is not BACKEND:MODE[:FAST]")
    backend, mode = parts[0], parts[1]
    fast = parts[2] if len(parts) == 3 else "config"
    problems = []
    if backend not in BACKEND_CHOICES:
        problems.append(f"backend {backend!r} is not one of {', '.join(BACKEND_CHOICES)}")
    if mode not in MODE_CHOICES:
        problems.append(f"mode {mode!r} is not one of {', '.join(MODE_CHOICES)}")
    if fast not in ("config", "none", "all"):
        unknown = [name for name in fast.split("+") if name not in FAST_PATH_CHOICES]
        if unknown:
            problems.append(f"fast paths {unknown} are not among config, none, all or a '+' list of "
                            f"{', '.join(FAST_PATH_CHOICES)}")
    if backend == "stock" and fast not in ("config", "none"):
        problems.append("a stock row runs without deform_plugin, so it takes no fast paths")
    if problems:
        raise argparse.ArgumentTypeError(f"row {text!r}: " + "; ".join(problems))
    return Row(backend, mode, "none" if backend == "stock" else fast)


def build_rows(args) -> List[Row]:
    if args.rows:
        return list(args.rows)
    return [parse_row(f"{b}:{m}:{f}") for b in args.backends for m in args.modes for f in args.fast]


# ---------------------------------------------------------------------------------------------------------------------
# Config, model and optimizer
# ---------------------------------------------------------------------------------------------------------------------

def install_cpu_stock_standin() -> None:
    """Let mmdet import with mmcv-lite in a CPU stock run (mmcv's MSDA has a pure-PyTorch CPU path).

    Only for ``--device cpu`` stock rows: any compiled op reached would raise, so a result is never faked.
    """
    import importlib.machinery
    import types
    if "mmcv._ext" in sys.modules or importlib.util.find_spec("mmcv._ext") is not None:
        return
    standin = types.ModuleType("mmcv._ext")
    # No loader: mmengine's mmcv_full_available() then reports False, as it should.
    standin.__spec__ = importlib.machinery.ModuleSpec("mmcv._ext", None)

    def missing(name):
        if name.startswith("__"):
            raise AttributeError(name)

        def unavailable(*args, **kwargs):
            raise RuntimeError(f"mmcv compiled op {name} is not installed (CPU stock run with mmcv-lite)")
        return unavailable
    standin.__getattr__ = missing
    sys.modules["mmcv._ext"] = standin


def load_config(path: str, cfg_options: Optional[dict], plugin: bool):
    """Load a config without importing its custom modules; with ``plugin=False`` strip every deform_plugin part."""
    from mmengine.config import Config
    cfg = Config.fromfile(path, import_custom_modules=False)
    if cfg_options:
        cfg.merge_from_dict(cfg_options)
    imports = list((cfg.get("custom_imports") or {}).get("imports", []))
    if not plugin:
        imports = [name for name in imports if not name.startswith("deform_plugin")]
        if cfg.get("custom_hooks"):
            cfg.custom_hooks = [h for h in cfg.custom_hooks if h.get("type") != "FastPathsHook"]
        if cfg.optim_wrapper.get("constructor") == MERGED_CONSTRUCTOR:
            cfg.optim_wrapper.pop("constructor")
    else:
        for name in ("deform_plugin", "deform_plugin.engine"):
            if name not in imports:
                imports.append(name)
    if imports:
        from mmengine.utils import import_modules_from_strings
        import_modules_from_strings(imports, allow_failed_imports=False)
    from mmdet.utils import register_all_modules
    register_all_modules(init_default_scope=True)
    return cfg


def drop_pretrained_init(node) -> int:
    """Remove ``init_cfg=dict(type='Pretrained', ...)`` entries (no downloads; random init is as fast to time)."""
    removed = 0
    if isinstance(node, dict):
        init_cfg = node.get("init_cfg")
        if isinstance(init_cfg, dict) and init_cfg.get("type") == "Pretrained":
            node["init_cfg"] = None
            removed += 1
        for value in node.values():
            removed += drop_pretrained_init(value)
    elif isinstance(node, (list, tuple)):
        for value in node:
            removed += drop_pretrained_init(value)
    return removed


def resolve_fast_paths(cfg, row: Row) -> Dict[str, bool]:
    """Set the optimizer constructor in ``cfg`` for ``row``; return the model-level switches to apply."""
    if row.backend == "stock":
        return {}
    from deform_plugin.engine import fast_path_switches_from_config
    forced = row.fast_set()
    if forced is None:
        switches = fast_path_switches_from_config(cfg)
        return {"sdpa_attention": switches.get("sdpa_attention", False),
                "hungarian_host_syncs": switches.get("hungarian_host_syncs", False)}
    if "optim" in forced:
        cfg.optim_wrapper["constructor"] = MERGED_CONSTRUCTOR
    elif cfg.optim_wrapper.get("constructor") == MERGED_CONSTRUCTOR:
        cfg.optim_wrapper.pop("constructor")
    return {"sdpa_attention": "sdpa" in forced, "hungarian_host_syncs": "matching" in forced}


def optim_wrapper_config(cfg, mode: str):
    ow = copy.deepcopy(cfg.optim_wrapper)
    if mode == "fp32":
        if ow.get("type") == "AmpOptimWrapper":
            ow["type"] = "OptimWrapper"
            ow.pop("dtype", None)
            ow.pop("loss_scale", None)
        return ow
    ow["type"] = "AmpOptimWrapper"
    ow["dtype"] = "float16" if mode == "fp16" else "bfloat16"
    ow.setdefault("loss_scale", "dynamic")
    return ow


def autocast_for(mode: str, device: torch.device):
    if mode == "fp32":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.float16 if mode == "fp16" else torch.bfloat16)


# ---------------------------------------------------------------------------------------------------------------------
# Synthetic data
# ---------------------------------------------------------------------------------------------------------------------

def detector_label_spaces(model) -> Dict[str, int]:
    """num_classes for box heads; things/stuff for MaskFormer-style heads."""
    head = getattr(model, "panoptic_head", None)
    if head is not None and hasattr(head, "num_things_classes"):
        return {"things": head.num_things_classes, "stuff": head.num_stuff_classes, "masks": True}
    head = getattr(model, "bbox_head", None)
    num_classes = getattr(head, "num_classes", 80)
    return {"things": num_classes, "stuff": 0, "masks": hasattr(model, "roi_head") and
            getattr(model.roi_head, "with_mask", False)}


def make_batch(model, batch_size: int, height: int, width: int, num_gts: int, seed: int) -> dict:
    """A packed batch as mmdet's dataloader yields it: uint8 images and DetDataSamples with random targets.

    Boxes are random xyxy boxes of 5-50% of the image side; masks (MaskFormer-style models) fill each box's
    inscribed ellipse; panoptic models also get a semantic map of stuff classes.
    """
    import numpy as np
    from mmdet.structures import DetDataSample
    from mmdet.structures.mask import BitmapMasks
    from mmengine.structures import InstanceData, PixelData

    generator = torch.Generator().manual_seed(seed)
    spaces = detector_label_spaces(model)
    inputs, samples = [], []
    for index in range(batch_size):
        inputs.append(torch.randint(0, 256, (3, height, width), dtype=torch.uint8, generator=generator))
        sizes = torch.rand(num_gts, 2, generator=generator) * 0.45 + 0.05
        centres = torch.rand(num_gts, 2, generator=generator)
        wh = sizes * torch.tensor([width, height])
        cxcy = centres * torch.tensor([width, height])
        boxes = torch.cat([cxcy - wh / 2, cxcy + wh / 2], dim=1)
        boxes[:, 0::2] = boxes[:, 0::2].clamp(0, width - 1)
        boxes[:, 1::2] = boxes[:, 1::2].clamp(0, height - 1)
        boxes[:, 2:] = torch.maximum(boxes[:, 2:], boxes[:, :2] + 2)
        labels = torch.randint(0, spaces["things"], (num_gts,), generator=generator)
        sample = DetDataSample(metainfo=dict(
            img_id=index, img_path="", ori_shape=(height, width), img_shape=(height, width),
            scale_factor=(1.0, 1.0), flip=False, flip_direction=None))
        gt = InstanceData(bboxes=boxes, labels=labels)
        if spaces["masks"]:
            ys = np.arange(height)[:, None] + 0.5
            xs = np.arange(width)[None, :] + 0.5
            masks = np.zeros((num_gts, height, width), dtype=np.uint8)
            for k, (x1, y1, x2, y2) in enumerate(boxes.tolist()):
                cx, cy, rx, ry = (x1 + x2) / 2, (y1 + y2) / 2, max((x2 - x1) / 2, 1), max((y2 - y1) / 2, 1)
                masks[k] = (((xs - cx) / rx) ** 2 + ((ys - cy) / ry) ** 2) <= 1
            gt.masks = BitmapMasks(masks, height, width)
        sample.gt_instances = gt
        sample.ignored_instances = InstanceData(bboxes=torch.zeros(0, 4), labels=torch.zeros(0, dtype=torch.long))
        if spaces["stuff"]:
            stuff = torch.randint(spaces["things"], spaces["things"] + spaces["stuff"], (1,), generator=generator)
            sem = torch.full((1, height, width), int(stuff), dtype=torch.long)
            sample.gt_sem_seg = PixelData(sem_seg=sem)
        samples.append(sample)
    return {"inputs": inputs, "data_samples": samples}


# ---------------------------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------------------------

def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def progress(iterable, desc: str, enabled: bool):
    if not enabled:
        return iterable
    from tqdm import tqdm
    return tqdm(iterable, desc=desc, leave=False, dynamic_ncols=True, file=sys.stderr)


def summarize_ms(samples_s: Sequence[float]) -> dict:
    ms = sorted(s * 1e3 for s in samples_s)

    def quantile(q):
        if len(ms) == 1:
            return ms[0]
        pos = q * (len(ms) - 1)
        lo = int(math.floor(pos))
        hi = min(lo + 1, len(ms) - 1)
        return ms[lo] + (ms[hi] - ms[lo]) * (pos - lo)
    return {"median_ms": statistics.median(ms), "p20_ms": quantile(0.2), "p80_ms": quantile(0.8),
            "min_ms": ms[0], "max_ms": ms[-1], "std_ms": statistics.pstdev(ms), "n": len(ms)}


def peak_memory_mb(device: torch.device) -> Optional[dict]:
    if device.type != "cuda":
        return None
    return {"allocated_mb": torch.cuda.max_memory_allocated(device) / 2 ** 20,
            "reserved_mb": torch.cuda.max_memory_reserved(device) / 2 ** 20}


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def mmdet_line(kind: str, img_per_s: float, mem: Optional[dict]) -> str:
    mem_text = f"{mem['allocated_mb']:.0f}" if mem else "n/a"
    return (f"[{kind}] fps: {img_per_s:.2f} img/s, times per image: {1000.0 / img_per_s:.2f} ms/img, "
            f"cuda memory: {mem_text} MB")


def loss_values(log_vars) -> Dict[str, float]:
    return {k: float(v) for k, v in log_vars.items() if k == "loss" or k.endswith("loss_cls") or k == "loss_bbox"}


def time_training(model, optim_wrapper, batch, device, warmup: int, steps: int, show_progress: bool,
                  label: str) -> dict:
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


def time_inference(model, batch1, device, mode: str, warmup: int, steps: int, show_progress: bool,
                   label: str) -> dict:
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


# ---------------------------------------------------------------------------------------------------------------------
# Profiling
# ---------------------------------------------------------------------------------------------------------------------

RANGE_PREFIX = "deform_plugin::"
# Work launched inside these profile-only ranges is charged to the component, whatever the kernel's name.
RANGE_COMPONENT = {"matching": "matching", "optimizer": "optimizer", "msda": "MSDA"}
_CONV = re.compile(r"conv|cudnn|fprop|dgrad|wgrad|winograd|implicit_convolve|implicit_gemm|nhwc|nchw", re.I)
_GEMM = re.compile(r"gemm|gemv|cutlass|cublas|matmul|xmma|nvjet|sgemm|hgemm|splitk|aten::mm\b|aten::addmm|aten::bmm|"
                   r"aten::baddbmm|aten::_scaled_dot|flash|fmha|attention", re.I)
_ELEMENTWISE = re.compile(r"elementwise|vectorized|unrolled|pointwise|triton_poi|fill|copy|aten::(add|mul|sub|div|"
                          r"sigmoid|relu|exp|log|where|clamp|pow|sqrt|neg|abs|rsub|lt|gt|le|ge|eq|ne|masked_fill|"
                          r"fill_|copy_|zero_|zeros|ones|cat|stack|index|gather|scatter|sign|floor|ceil|minimum|"
                          r"maximum|tanh|gelu|erf|reciprocal|rsqrt|bitwise)", re.I)
_MEMCPY = re.compile(r"^memcpy|^memset|Memcpy|Memset", re.I)


def classify_name(name: str, msda_pattern: re.Pattern) -> str:
    if msda_pattern.search(name):
        return "MSDA"
    if _MEMCPY.search(name):
        return "memcpy"
    if _CONV.search(name):
        return "convolution"
    if _GEMM.search(name):
        return "GEMM"
    if _ELEMENTWISE.search(name):
        return "elementwise"
    return "other"


@contextmanager
def profiling_ranges(model, optim_wrapper):
    """Wrap matching, the optimizer (clip + step + zero_grad) and backward in named ranges, for this run only."""
    from torch.profiler import record_function

    def wrap(obj, attr, range_name):
        original = getattr(obj, attr)

        def wrapped(*args, **kwargs):
            with record_function(RANGE_PREFIX + range_name):
                return original(*args, **kwargs)
        setattr(obj, attr, wrapped)
        return obj, attr, attr in vars(obj), original

    patched = [wrap(optim_wrapper, "step", "optimizer"), wrap(optim_wrapper, "zero_grad", "optimizer"),
               wrap(optim_wrapper, "backward", "backward")]
    msda_module = sys.modules.get("deform_plugin.models.msda")
    if msda_module is not None and hasattr(msda_module, "fused_multi_scale_deformable_attn"):
        # Module globals are looked up at call time, so this catches every call of our MSDA op's forward.
        patched.append(wrap(msda_module, "fused_multi_scale_deformable_attn", "msda"))
    try:
        from mmdet.models.task_modules.assigners.base_assigner import BaseAssigner
        seen = set()
        for module in getattr(model, "module", model).modules():
            for value in list(vars(module).values()):
                if isinstance(value, BaseAssigner) and id(value) not in seen:
                    seen.add(id(value))
                    patched.append(wrap(value, "assign", "matching"))
    except ImportError:
        pass
    try:
        yield
    finally:
        for obj, attr, was_instance_attr, original in reversed(patched):
            if was_instance_attr:
                setattr(obj, attr, original)
            else:
                delattr(obj, attr)


def analyse_profile(events, steps: int, device: torch.device, msda_pattern: re.Pattern) -> dict:
    """Time per component per step, GPU-busy fraction, kernels per step and host time in named ranges."""
    from torch.autograd import DeviceType
    cpu_events = [e for e in events if e.device_type == DeviceType.CPU and not e.is_async]
    ranges = defaultdict(list)
    for e in cpu_events:
        if e.name.startswith(RANGE_PREFIX):
            ranges[e.name[len(RANGE_PREFIX):]].append((e.time_range.start, e.time_range.end))
    step_ranges = ranges.get("train_step", [])
    wall_us = sum(end - start for start, end in step_ranges)
    window = (min(s for s, _ in step_ranges), max(e for _, e in step_ranges)) if step_ranges else None

    def enclosing_range(t_us: float) -> Optional[str]:
        for name in ("matching", "optimizer", "msda"):
            for start, end in ranges.get(name, ()):
                if start <= t_us <= end:
                    return name
        return None

    host_ms = {name: sum(end - start for start, end in spans) / 1e3 / steps
               for name, spans in ranges.items() if name != "train_step"}
    per_component = defaultdict(float)
    kernel_count = 0
    busy_us = 0.0
    if device.type == "cuda":
        launch_time = {}
        for e in cpu_events:
            launch_time.setdefault(e.id, e.time_range.start)
        intervals = []
        for e in events:
            if e.device_type != DeviceType.CUDA or e.name.startswith(RANGE_PREFIX) or e.name.startswith("ProfilerStep"):
                continue
            start, end = e.time_range.start, e.time_range.end
            if window and not (window[0] <= start <= window[1] + 1e6):
                continue
            kernel_count += 1
            intervals.append((start, end))
            # Older torch names the launching CPU event by linked_correlation_id; torch 2.11 drops the attribute.
            # Without a launch time the kernel is classified by its name alone.
            launched = launch_time.get(getattr(e, "linked_correlation_id", None)) or launch_time.get(e.id)
            component = enclosing_range(launched) if launched is not None else None
            per_component[RANGE_COMPONENT.get(component) or classify_name(e.name, msda_pattern)] += end - start
        intervals.sort()
        cursor = -math.inf
        for start, end in intervals:
            if end > cursor:
                busy_us += end - max(start, cursor)
                cursor = end
        time_kind = "CUDA"
    else:
        for e in cpu_events:
            if e.name.startswith(RANGE_PREFIX) or e.name.startswith("ProfilerStep"):
                continue
            component = enclosing_range(e.time_range.start)
            per_component[RANGE_COMPONENT.get(component) or classify_name(e.name, msda_pattern)] += \
                e.self_cpu_time_total
            kernel_count += 1
        busy_us = sum(per_component.values())
        time_kind = "CPU"
    components_ms = {name: per_component.get(name, 0.0) / 1e3 / steps for name in PROFILE_COMPONENTS}
    return {
        "time_kind": time_kind,
        "components_ms_per_step": components_ms,
        "total_ms_per_step": sum(components_ms.values()),
        "step_wall_ms": wall_us / 1e3 / steps if steps else None,
        "busy_fraction": (busy_us / wall_us) if wall_us else None,
        ("kernels_per_step" if device.type == "cuda" else "ops_per_step"): kernel_count / steps,
        "host_ms_per_step": host_ms,
    }


def profile_training(model, optim_wrapper, batch, device, steps: int, trace_path: Optional[str],
                     msda_pattern: re.Pattern) -> dict:
    from torch.profiler import ProfilerActivity, profile, record_function
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    model.train()
    model.train_step(batch, optim_wrapper)  # a step outside the profile: no first-call effects inside it
    synchronize(device)
    with profiling_ranges(model, optim_wrapper), profile(activities=activities) as prof:
        for _ in range(steps):
            with record_function(RANGE_PREFIX + "train_step"):
                model.train_step(batch, optim_wrapper)
                synchronize(device)
    if trace_path:
        prof.export_chrome_trace(trace_path)
    result = analyse_profile(prof.events(), steps, device, msda_pattern)
    result["trace"] = trace_path
    return result


def plot_profiles(results: List[dict], path: str) -> Optional[str]:
    profiled = [r for r in results if r.get("profile")]
    if not profiled:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [f"{short_config_name(r['config'])}\n{r['row']}" for r in profiled]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(profiled) + 2), 5.5))
    bottoms = [0.0] * len(profiled)
    colors = plt.get_cmap("tab10").colors
    for index, component in enumerate(PROFILE_COMPONENTS):
        values = [r["profile"]["components_ms_per_step"][component] for r in profiled]
        ax.bar(range(len(profiled)), values, bottom=bottoms, label=component, color=colors[index % len(colors)])
        bottoms = [b + v for b, v in zip(bottoms, values)]
    for x, r in enumerate(profiled):
        wall = r["profile"].get("step_wall_ms")
        busy = r["profile"].get("busy_fraction")
        if wall:
            ax.plot([x - 0.4, x + 0.4], [wall, wall], color="black", linewidth=1.5)
            ax.text(x, wall, f"step {wall:.0f} ms" + (f"\nbusy {100 * busy:.0f}%" if busy else ""),
                    ha="center", va="bottom", fontsize=7)
    kind = profiled[0]["profile"]["time_kind"]
    ax.set_xticks(range(len(profiled)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel(f"{kind} time per training step (ms)")
    ax.set_title(f"{kind} time by component (bars) vs step wall time (lines)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------------------------------
# One row
# ---------------------------------------------------------------------------------------------------------------------

def short_config_name(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0].replace("_deform-plugin", "")


def run_row_in_process(config_path: str, row: Row, args) -> dict:
    device = torch.device(args.device)
    result = {"config": config_path, "row": row.label, "backend": row.backend, "mode": row.mode, "fast": row.fast,
              "status": "ok"}
    if row.mode != "fp32" and device.type != "cuda":
        result.update(status="skipped", error="AMP modes need CUDA (mmengine AmpOptimWrapper)")
        return result
    if row.mode == "bf16" and not torch.cuda.is_bf16_supported():
        result.update(status="skipped", error="this GPU has no bf16 support")
        return result
    plugin = row.backend != "stock"
    if not plugin and device.type == "cpu":
        install_cpu_stock_standin()
    cfg = load_config(config_path, args.cfg_options, plugin=plugin)
    switches = resolve_fast_paths(cfg, row)
    if plugin:
        from deform_plugin.ops import set_default_backend
        set_default_backend(row.backend)
    from mmdet.registry import MODELS
    from mmengine.optim import build_optim_wrapper
    drop_pretrained_init(cfg.model)
    torch.manual_seed(args.seed)
    model = MODELS.build(cfg.model)
    # Modules such as DeformableDETR.level_embed are torch.empty until init_weights(): without it every row would
    # start from different (possibly non-finite) garbage.
    model.init_weights()
    model.to(device)
    result["fast_path_sites"] = {}
    if plugin and any(switches.values()):
        from deform_plugin.integration.mmdet_fast_paths import apply_fast_paths
        result["fast_path_sites"] = apply_fast_paths(model, **switches)
    model.train()
    optim_wrapper = build_optim_wrapper(model, optim_wrapper_config(cfg, row.mode))
    optimizer = optim_wrapper.optimizer
    result["optimizer"] = {"constructor": cfg.optim_wrapper.get("constructor", "DefaultOptimWrapperConstructor"),
                           "param_groups": len(optimizer.param_groups),
                           "fused": bool(optimizer.defaults.get("fused")),
                           "foreach": optimizer.defaults.get("foreach")}
    height, width = args.shape
    batch = make_batch(model, args.batch_size, height, width, args.num_gts, args.seed)
    label = f"{short_config_name(config_path)} {row.label}"
    if not args.profile_only:
        if args.steps > 0:
            result["train"] = time_training(model, optim_wrapper, batch, device, args.warmup, args.steps,
                                            not args.no_progress, label)
            print(f"{label} " + mmdet_line("train", result["train"]["img_per_s"], result["train"]["memory"]),
                  flush=True)
        if args.inference_steps > 0:
            batch1 = make_batch(model, 1, height, width, args.num_gts, args.seed)
            result["inference"] = time_inference(model, batch1, device, row.mode, args.inference_warmup,
                                                 args.inference_steps, not args.no_progress, label)
            print(f"{label} " + mmdet_line("inference", result["inference"]["fps"],
                                           result["inference"]["memory"]), flush=True)
    if args.profile or args.profile_only:
        trace = None
        if args.trace and args.out_dir:
            trace = os.path.join(args.out_dir, f"trace_{short_config_name(config_path)}_{row.label.replace(':', '-')}"
                                               ".json")
        result["profile"] = profile_training(model, optim_wrapper, batch, device, args.profile_steps, trace,
                                             re.compile(args.msda_kernel_regex, re.I))
        p = result["profile"]
        parts = ", ".join(f"{k} {v:.1f}" for k, v in p["components_ms_per_step"].items())
        busy = f"{100 * p['busy_fraction']:.0f}%" if p["busy_fraction"] is not None else "n/a"
        print(f"{label} [profile] {p['time_kind']} ms/step: {parts}; step wall {p['step_wall_ms']:.1f} ms, "
              f"busy {busy}, host ms/step {json.dumps({k: round(v, 2) for k, v in p['host_ms_per_step'].items()})}",
              flush=True)
    del model, optim_wrapper, optimizer, batch
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def run_row_in_child(config_path: str, row: Row, args) -> dict:
    """Run one row in a fresh interpreter (stock rows must never see deform_plugin imported)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        command = [sys.executable, os.path.abspath(__file__), config_path, "--rows", row.label,
                   "--child-json", out] + child_passthrough_args(args)
        completed = subprocess.run(command, cwd=os.getcwd())
        if completed.returncode != 0 or not os.path.exists(out):
            return {"config": config_path, "row": row.label, "backend": row.backend, "mode": row.mode,
                    "fast": row.fast, "status": "failed",
                    "error": f"child process exited with {completed.returncode}"}
        with open(out) as f:
            return json.load(f)


def child_passthrough_args(args) -> List[str]:
    passthrough = ["--device", args.device, "--shape", str(args.shape[0]), str(args.shape[1]),
                   "--batch-size", str(args.batch_size), "--num-gts", str(args.num_gts), "--warmup", str(args.warmup),
                   "--steps", str(args.steps), "--inference-warmup", str(args.inference_warmup),
                   "--inference-steps", str(args.inference_steps), "--seed", str(args.seed),
                   "--profile-steps", str(args.profile_steps), "--msda-kernel-regex", args.msda_kernel_regex]
    for flag in ("profile", "profile_only", "trace", "no_progress", "tf32"):
        if getattr(args, flag):
            passthrough.append("--" + flag.replace("_", "-"))
    if args.out_dir:
        passthrough += ["--out-dir", args.out_dir]
    if args.cfg_options:
        passthrough += ["--cfg-options"] + [f"{k}={json.dumps(v) if not isinstance(v, str) else v}"
                                            for k, v in args.cfg_options.items()]
    return passthrough


def run_row(config_path: str, row: Row, args) -> dict:
    try:
        if row.backend == "stock" and not args.child_json:
            return run_row_in_child(config_path, row, args)
        return run_row_in_process(config_path, row, args)
    except Exception as error:  # one failing row (OOM, unsupported dtype) must not lose the others
        if args.fail_fast:
            raise
        traceback.print_exc()
        return {"config": config_path, "row": row.label, "backend": row.backend, "mode": row.mode, "fast": row.fast,
                "status": "failed", "error": f"{type(error).__name__}: {error}"[:500]}


# ---------------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------------

def package_version(name: str) -> Optional[str]:
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:
        return None


def machine_info(device: torch.device) -> dict:
    commit = repo_commit()
    mmcv_ops = importlib.util.find_spec("mmcv") is not None and any(
        name.startswith("_ext") for name in os.listdir(os.path.dirname(importlib.util.find_spec("mmcv").origin)))
    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else
            (platform.processor() or platform.machine()) + f" ({os.cpu_count()} cores)",
            "cuda": torch.version.cuda, "torch": torch.__version__, "triton": package_version("triton"),
            "mmcv": package_version("mmcv") or package_version("mmcv-lite"), "mmcv_compiled_ops": mmcv_ops,
            "mmdet": package_version("mmdet"), "mmengine": package_version("mmengine"),
            "python": platform.python_version(), "commit": commit,
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    return info


def machine_line(info: dict) -> str:
    return (f"machine: {info['device']}, CUDA {info['cuda']}, torch {info['torch']}, triton {info['triton']}, "
            f"mmcv {info['mmcv']} (compiled ops: {'yes' if info['mmcv_compiled_ops'] else 'no'}), "
            f"mmdet {info['mmdet']}, commit {info['commit']}, {info['date_utc']} UTC")


def add_speedups(results: List[dict]) -> None:
    """Speedups and memory ratios of every row against the first successful row of the same config."""
    by_config = defaultdict(list)
    for r in results:
        by_config[r["config"]].append(r)
    for rows in by_config.values():
        base = rows[0]
        for r in rows:
            r["baseline_row"] = base["row"]
            if r.get("train") and base.get("train"):
                r["train"]["speedup"] = r["train"]["img_per_s"] / base["train"]["img_per_s"]
                mem, base_mem = r["train"].get("memory"), base["train"].get("memory")
                if mem and base_mem:
                    r["train"]["memory_ratio"] = mem["allocated_mb"] / base_mem["allocated_mb"]
            if r.get("inference") and base.get("inference"):
                r["inference"]["speedup"] = r["inference"]["fps"] / base["inference"]["fps"]


def format_table(results: List[dict], info: dict) -> str:
    lines = [machine_line(info)]
    header = ("| row | train ms/step median (p20-p80) | img/s | speedup | peak MiB | mem ratio | "
              "infer ms (bs1) | FPS | speedup | first loss | status |")
    by_config = defaultdict(list)
    for r in results:
        by_config[r["config"]].append(r)

    def fmt(value, spec):
        return format(value, spec) if value is not None else "-"
    for config, rows in by_config.items():
        lines += ["", f"config: {config} (baseline: {rows[0]['row']})", header, "|" + "---|" * 11]
        for r in rows:
            t, i = r.get("train") or {}, r.get("inference") or {}
            mem = (t.get("memory") or {}).get("allocated_mb")
            timing = (f"{t['median_ms']:.1f} ({t['p20_ms']:.1f}-{t['p80_ms']:.1f})" if t else "-")
            loss = (t.get("first_step_losses") or {}).get("loss")
            status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r.get('error', '')}"
            if t and not t.get("losses_finite", True):
                status += " (non-finite loss)"
            lines.append(f"| {r['row']} | {timing} | {fmt(t.get('img_per_s'), '.2f')} | "
                         f"{fmt(t.get('speedup'), '.2f')}x | {fmt(mem, '.0f')} | {fmt(t.get('memory_ratio'), '.2f')} | "
                         f"{fmt(i.get('median_ms'), '.1f')} | {fmt(i.get('fps'), '.2f')} | "
                         f"{fmt(i.get('speedup'), '.2f')}x | {fmt(loss, '.4f')} | {status} |")
    return "\n".join(lines)


CSV_FIELDS = ("config", "row", "backend", "mode", "fast", "status", "error", "param_groups", "train_median_ms",
              "train_p20_ms", "train_p80_ms", "train_std_ms", "img_per_s", "train_speedup", "peak_allocated_mb",
              "peak_reserved_mb", "memory_ratio", "first_loss", "infer_median_ms", "infer_fps", "infer_speedup",
              "profile_step_wall_ms", "profile_busy_fraction", "profile_kernels_per_step",
              *[f"profile_{c}_ms" for c in PROFILE_COMPONENTS], "host_matching_ms", "host_optimizer_ms")


def csv_row(r: dict) -> dict:
    t, i, p = r.get("train") or {}, r.get("inference") or {}, r.get("profile") or {}
    mem = t.get("memory") or {}
    row = {"config": r["config"], "row": r["row"], "backend": r["backend"], "mode": r["mode"], "fast": r["fast"],
           "status": r["status"], "error": r.get("error", ""),
           "param_groups": (r.get("optimizer") or {}).get("param_groups"),
           "train_median_ms": t.get("median_ms"), "train_p20_ms": t.get("p20_ms"), "train_p80_ms": t.get("p80_ms"),
           "train_std_ms": t.get("std_ms"), "img_per_s": t.get("img_per_s"), "train_speedup": t.get("speedup"),
           "peak_allocated_mb": mem.get("allocated_mb"), "peak_reserved_mb": mem.get("reserved_mb"),
           "memory_ratio": t.get("memory_ratio"), "first_loss": (t.get("first_step_losses") or {}).get("loss"),
           "infer_median_ms": i.get("median_ms"), "infer_fps": i.get("fps"), "infer_speedup": i.get("speedup"),
           "profile_step_wall_ms": p.get("step_wall_ms"), "profile_busy_fraction": p.get("busy_fraction"),
           "profile_kernels_per_step": p.get("kernels_per_step", p.get("ops_per_step")),
           "host_matching_ms": (p.get("host_ms_per_step") or {}).get("matching"),
           "host_optimizer_ms": (p.get("host_ms_per_step") or {}).get("optimizer")}
    for c in PROFILE_COMPONENTS:
        row[f"profile_{c}_ms"] = (p.get("components_ms_per_step") or {}).get(c)
    return row


def write_outputs(results: List[dict], info: dict, args, table: str) -> Dict[str, str]:
    if not args.out_dir:
        return {}
    os.makedirs(args.out_dir, exist_ok=True)
    paths = {"json": os.path.join(args.out_dir, f"{args.name}.json"),
             "csv": os.path.join(args.out_dir, f"{args.name}.csv"),
             "table": os.path.join(args.out_dir, f"{args.name}.md")}
    settings = {k: v for k, v in vars(args).items() if k not in ("rows", "child_json")}
    settings["rows"] = [r.label for r in build_rows(args)]
    with open(paths["json"], "w") as f:
        json.dump({"machine": info, "settings": settings, "results": results}, f, indent=2, default=str)
    with open(paths["csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for r in results:
            writer.writerow(csv_row(r))
    with open(paths["table"], "w") as f:
        f.write(table + "\n")
    stem = args.name if args.name.endswith("profile") else f"{args.name}_profile"
    chart = plot_profiles(results, os.path.join(args.out_dir, f"{stem}.png"))
    if chart:
        paths["png"] = chart
    return paths


# ---------------------------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------------------------

def parse_cfg_options(items: Optional[List[str]]) -> Optional[dict]:
    if not items:
        return None
    from mmengine.config import DictAction
    parser = argparse.ArgumentParser()
    parser.add_argument("--o", nargs="+", action=DictAction)
    return parser.parse_args(["--o", *items]).o


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configs", nargs="+", help="config files (local files; stock configs via configs/...)")
    parser.add_argument("--rows", nargs="+", type=parse_row, help="BACKEND:MODE[:FAST] rows; the first is the "
                        "baseline. Without --rows: every combination of --backends x --modes x --fast")
    parser.add_argument("--backends", nargs="+", default=["auto"], choices=BACKEND_CHOICES)
    parser.add_argument("--modes", nargs="+", default=["fp32"], choices=MODE_CHOICES)
    parser.add_argument("--fast", nargs="+", default=["config"], help="config | none | all | optim+sdpa+matching")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", nargs=2, type=int, default=[800, 1333], metavar=("H", "W"))
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--num-gts", type=int, default=10, help="ground-truth objects per synthetic image")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="timed training steps (0: skip training)")
    parser.add_argument("--inference-warmup", type=int, default=5)
    parser.add_argument("--inference-steps", type=int, default=20, help="timed batch-1 inferences (0: skip)")
    parser.add_argument("--profile", action="store_true", help="also profile --profile-steps steps per row")
    parser.add_argument("--profile-only", action="store_true", help="profile without the timing runs")
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--trace", action="store_true", help="write a Chrome trace per profiled row (--out-dir)")
    parser.add_argument("--msda-kernel-regex", default=r"ms_?deform|msda|deform_?attn|grid_sampler",
                        help="kernel/op names counted as MSDA in profiles")
    parser.add_argument("--tf32", action="store_true", help="allow TF32 matmuls/convs (PyTorch default: off)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=None, help="write NAME.json, NAME.csv, NAME.md (and NAME_profile.png)")
    parser.add_argument("--name", default="benchmark", help="file stem of the outputs")
    parser.add_argument("--cfg-options", nargs="+", default=None, help="key=value overrides, as in mmdet tools")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    parser.add_argument("--fail-fast", action="store_true", help="stop at the first failing row")
    parser.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                        help="start no new row after this many seconds (they are reported as skipped)")
    parser.add_argument("--child-json", default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from mmengine.logging import MMLogger
    # The per-parameter 'paramwise_options' lines of optimizer construction would bury the results.
    MMLogger.get_instance("deform_plugin_benchmark", log_level="WARNING")
    args.cfg_options = parse_cfg_options(args.cfg_options)
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    torch.backends.cudnn.allow_tf32 = args.tf32
    rows = build_rows(args)
    if args.child_json:
        result = run_row(args.configs[0], rows[0], args)
        with open(args.child_json, "w") as f:
            json.dump(result, f, default=str)
        return 0
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
    device = torch.device(args.device)
    info = machine_info(device)
    print(machine_line(info), flush=True)
    results = []
    started = time.perf_counter()
    for config_path in args.configs:
        for row in rows:
            if args.time_budget is not None and time.perf_counter() - started > args.time_budget:
                results.append({"config": config_path, "row": row.label, "backend": row.backend, "mode": row.mode,
                                "fast": row.fast, "status": "skipped",
                                "error": f"--time-budget {args.time_budget:.0f} s used up"})
                continue
            results.append(run_row(config_path, row, args))
            if args.out_dir:  # partial results survive a run killed by a time limit
                add_speedups(results)
                write_outputs(results, info, args, format_table(results, info))
    add_speedups(results)
    table = format_table(results, info)
    print("\n" + table, flush=True)
    for kind, path in write_outputs(results, info, args, table).items():
        print(f"wrote {kind}: {path}")
    return 0 if all(r["status"] in ("ok", "skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
