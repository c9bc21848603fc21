"""The rows of the training benchmark and the overlay config each row trains on.

The overlay inherits the user's config (``_base_`` = its absolute path) and changes only what a benchmark must (see
:mod:`.user_path`); for stock rows it also replaces every deform_plugin piece by the mmengine or
mmdet original (:mod:`.configs` knows which pieces those are).
"""
from __future__ import annotations

import argparse
import copy
import pprint
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ..stock_process import is_plugin_module
from .coco_source import CocoSource
from .configs import MERGED_CONSTRUCTOR, PLUGIN_HOOKS, PLUGIN_TYPE_BASES
from .iteration_timer import validate_windows
from .random_text_encoder import MODULE as RANDOM_TEXT_ENCODER_MODULE
from .random_text_encoder import random_text_encoder_override

TIMER_MODULE = "deform_plugin.benchmarks.detector.iteration_timer"
TIMER_HOOK = "IterationTimerHook"
PROFILER_MODULE = "deform_plugin.benchmarks.detector.step_profiler"
PROFILER_HOOK = "StepProfilerHook"
# The train datasets the synthetic sets serve, and which set each reads (see user_path.synthetic_source).
DETECTION, PANOPTIC = "detection", "panoptic"
SUPPORTED_DATASETS = {"CocoDataset": DETECTION, "CocoPanopticDataset": PANOPTIC}
NEVER = 10 ** 9  # an interval no benchmark reaches
SIDES = ("stock", "ours")
SHAPE_BUCKETS_HOOK = "ShapeBucketsHook"
MODES = ("fp32", "fp16", "bf16")


class UnsupportedConfig(ValueError):
    """The config cannot train on the synthetic COCO source."""


@dataclass(frozen=True)
class Row:
    side: str
    mode: str
    buckets: bool = True  # False: the config's ShapeBucketsHook removed (stock's padding)
    cold_cache: bool = False  # True: an empty Triton cache of its own (every kernel compiles in the row)
    # True: cuDNN's v7 convolution API for the row's process (TORCH_CUDNN_V8_API_DISABLED=1): cheaper planning at a
    # new input shape, slower kernels at a seen one (deform_plugin/conv_planning.py)
    cudnn_v7: bool = False
    # True: under several GPUs each rank pads to its own bucket (ShapeBucketsHook(same_shape_on_every_rank=False))
    # instead of the largest of all ranks'
    own_shapes: bool = False

    @property
    def label(self) -> str:
        return f"{self.side}:{self.mode}" + "".join(f":{option}" for option, on in
                                                   (("no-buckets", not self.buckets), ("cold", self.cold_cache),
                                                    ("cudnn-v7", self.cudnn_v7), ("own-shapes", self.own_shapes))
                                                   if on)

    @property
    def stock(self) -> bool:
        return self.side == "stock"


ROW_OPTIONS = ("no-buckets", "cold", "cudnn-v7", "own-shapes")
ROW_GRAMMAR = "SIDE:MODE" + "".join(f"[:{option}]" for option in ROW_OPTIONS)


def parse_row(text: str) -> Row:
    """``SIDE:MODE[:no-buckets][:cold][:cudnn-v7][:own-shapes]`` (:data:`ROW_GRAMMAR`)."""
    side, mode, *options = text.split(":") + ([""] if ":" not in text else [])
    problems = []
    if side not in SIDES:
        problems.append(f"side {side!r} is not one of {', '.join(SIDES)}")
    if mode not in MODES:
        problems.append(f"mode {mode!r} is not one of {', '.join(MODES)}")
    problems += [f"option {option!r} is not one of {', '.join(ROW_OPTIONS)}" for option in options
                 if option not in ROW_OPTIONS]
    if "own-shapes" in options and ("no-buckets" in options or side == "stock"):
        problems.append("own-shapes sets ShapeBucketsHook's padding across ranks, which a no-buckets or stock row "
                        "does not have")
    if problems:
        raise argparse.ArgumentTypeError(f"row {text!r} is not {ROW_GRAMMAR}: " + "; ".join(problems))
    return Row(side, mode, buckets="no-buckets" not in options, cold_cache="cold" in options,
               cudnn_v7="cudnn-v7" in options, own_shapes="own-shapes" in options)


@dataclass(frozen=True)
class Settings:
    """What every row of a run shares."""

    iters: int = 100
    batch_size: int = 2
    workers: int = 4
    first_iters: int = 20
    steady_start: Optional[int] = None  # None: the second half, iters // 2 + 1
    logger_interval: int = 50
    timeout_s: float = 3600.0
    gpus: int = 1  # >1: each row runs under torch.distributed.run, one process per GPU (DDP)
    numa_binding: Optional[str] = None  # with gpus > 1: torch.distributed.run's --numa-binding mode, or none
    profile_first: Optional[int] = None  # profile iterations profile_first.. (StepProfilerHook), or none
    profile_steps: int = 3
    # Grounding-DINO's BERT: 'auto' (a random text encoder where bert-base-uncased's files are missing), 'random'
    # or 'real' (see random_text_encoder.py).
    text_encoder: str = "auto"

    def windows(self) -> Dict[str, Tuple[int, int]]:
        """The timed windows by name: ``first`` (warm-up included), ``first_100`` (the first 100 iterations, or all
        of a shorter run), ``all`` and ``steady``."""
        steady_start = self.steady_start if self.steady_start is not None else self.iters // 2 + 1
        windows = {"first": (1, min(self.first_iters, self.iters)), "first_100": (1, min(100, self.iters)),
                   "all": (1, self.iters), "steady": (steady_start, self.iters)}
        validate_windows(list(windows.values()))
        return windows


# ---------------------------------------------------------------------------------------------------------------------
# The overlay config
# ---------------------------------------------------------------------------------------------------------------------

def read_base_config(path: Path):
    """The user's config as mmengine merges it, without importing its custom modules."""
    from mmengine.config import Config
    return Config.fromfile(str(path), import_custom_modules=False)


def check_supported(base_cfg, path: Path) -> str:
    """The kind of synthetic set the config trains on (:data:`DETECTION` for mmdet's ``CocoDataset``,
    :data:`PANOPTIC` for its ``CocoPanopticDataset``); :class:`UnsupportedConfig` for any other train dataset."""
    loader = base_cfg.get("train_dataloader")
    if not loader or "dataset" not in loader:
        raise UnsupportedConfig(f"{path} has no train_dataloader.dataset to time")
    dataset_type = str(loader["dataset"].get("type"))
    kind = SUPPORTED_DATASETS.get(dataset_type.rpartition(".")[2])
    if kind is None:
        raise UnsupportedConfig(
            f"{path} trains {dataset_type}: the synthetic COCO sets serve configs whose train dataset is mmdet's "
            f"{' or '.join(SUPPORTED_DATASETS)} (detection, instance or panoptic segmentation), not dataset "
            "wrappers or other formats")
    return kind


def is_pretrained(init_cfg) -> bool:
    return isinstance(init_cfg, dict) and init_cfg.get("type") == "Pretrained"


def without_pretrained(node):
    """A copy of ``node`` with every ``init_cfg`` of type ``Pretrained`` removed (a list loses those entries)."""
    if isinstance(node, dict):
        copied = {}
        for key, value in node.items():
            if key == "init_cfg" and is_pretrained(value):
                copied[key] = None
            elif key == "init_cfg" and isinstance(value, (list, tuple)):
                kept = [without_pretrained(v) for v in value if not is_pretrained(v)]
                copied[key] = kept or None
            else:
                copied[key] = without_pretrained(value)
        return copied
    if isinstance(node, (list, tuple)):
        return type(node)(without_pretrained(v) for v in node)
    return node


def pretrained_overrides(node: dict) -> dict:
    """The smallest override that mmengine merges into ``node`` to drop its pretrained ``init_cfg`` entries.

    Dicts merge key by key and lists are replaced whole, so a changed list is written out in full.
    """
    stripped = without_pretrained(node)
    overrides = {}
    for key, value in node.items():
        if stripped[key] == value:
            continue
        recurse = isinstance(value, dict) and key != "init_cfg"
        overrides[key] = pretrained_overrides(value) if recurse else stripped[key]
    return overrides


def custom_import_names(cfg) -> List[str]:
    """The module names a config's ``custom_imports`` lists (a single name given as a string included)."""
    imports = (cfg.get("custom_imports") or {}).get("imports", [])
    return [imports] if isinstance(imports, str) else list(imports)


def plugin_references(node, path: str = "") -> List[str]:
    """Where a config still names deform_plugin: its modules, its hook or its optimizer constructor (paths that merely
    contain the name, such as a cache folder, do not count)."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            found.extend(plugin_references(value, f"{path}.{key}" if path else str(key)))
    elif isinstance(node, (list, tuple)):
        for index, value in enumerate(node):
            found.extend(plugin_references(value, f"{path}[{index}]"))
    elif isinstance(node, str) and (is_plugin_module(node) or node in PLUGIN_HOOKS
                                    or node == MERGED_CONSTRUCTOR
                                    or node in PLUGIN_TYPE_BASES):
        found.append(f"{path}={node!r}")
    return found


# The keys whose deform_plugin pieces the stock overlay replaces piece by piece (the rest of each is kept).
RUNNER_KEYS_HANDLED = ("custom_imports", "custom_hooks", "optim_wrapper", "default_hooks", "model", "model_wrapper_cfg")


def timer_hook(row: Row, settings: Settings, timing_file: Path) -> dict:
    return dict(type=TIMER_HOOK, windows=[list(w) for w in settings.windows().values()],
                warmup_iters=settings.windows()["first"][1], out_file=str(timing_file),
                expect_plugin=not row.stock, label=row.label)


def profiler_hook(settings: Settings, profile_dir: Path) -> dict:
    return dict(type=PROFILER_HOOK, first=settings.profile_first, steps=settings.profile_steps,
                out_dir=str(profile_dir))


def overlay_settings(base_cfg, row: Row, source: CocoSource, settings: Settings, timing_file: Path,
                     profile_dir: Optional[Path] = None) -> dict:
    """The top-level keys the overlay config sets on top of ``base_cfg`` (the user's config) for ``row``; with
    ``settings.profile_first``, a step profile of the row goes to ``profile_dir``."""
    base = base_cfg.to_dict()

    def replacing(key_exists: bool, value: dict) -> dict:
        # `_delete_` replaces the base dict instead of merging; mmengine only removes the flag when the key exists.
        return dict(_delete_=True, **value) if key_exists else value

    loader = base["train_dataloader"]
    overlay: Dict[str, object] = {}
    overlay["train_dataloader"] = dict(
        batch_size=settings.batch_size,
        num_workers=settings.workers,
        persistent_workers=settings.workers > 0,
        sampler=replacing("sampler" in loader, dict(type="InfiniteSampler", shuffle=True)),
        dataset=dict(data_root=source.data_root, ann_file=source.ann_file, data_prefix=_data_prefix(source)))
    overlay["train_cfg"] = replacing("train_cfg" in base,
                                     dict(type="IterBasedTrainLoop", max_iters=settings.iters, val_interval=NEVER))
    for stage in ("val", "test"):
        for part in ("dataloader", "evaluator", "cfg"):
            overlay[f"{stage}_{part}"] = None
    default_hooks = base.get("default_hooks") or {}
    overlay["default_hooks"] = dict(
        logger=dict(interval=settings.logger_interval),
        checkpoint=replacing("checkpoint" in default_hooks,
                             dict(type="CheckpointHook", by_epoch=False, interval=NEVER, save_last=False)))
    overlay["log_processor"] = dict(by_epoch=False)
    overlay["randomness"] = dict(seed=0)
    overlay["load_from"] = None
    overlay["resume"] = False
    model_overrides = pretrained_overrides(base.get("model") or {})
    text_encoder = random_text_encoder_override(base, settings.text_encoder)
    if text_encoder is not None:  # the same random text encoder, for timing only, in every row
        model_overrides["language_model"] = dict(_delete_=True, **text_encoder)
    if model_overrides:
        overlay["model"] = model_overrides

    imports = custom_import_names(base)
    hooks = copy.deepcopy(list(base.get("custom_hooks") or []))
    if not row.buckets:
        hooks = [hook for hook in hooks if hook.get("type") != SHAPE_BUCKETS_HOOK]
    if row.own_shapes:
        if not any(hook.get("type") == SHAPE_BUCKETS_HOOK for hook in hooks):
            raise UnsupportedConfig(f"row {row.label}: the config has no {SHAPE_BUCKETS_HOOK} to pad per rank")
        hooks = [dict(hook, same_shape_on_every_rank=False) if hook.get("type") == SHAPE_BUCKETS_HOOK else hook
                 for hook in hooks]
    if row.stock:
        imports = [name for name in imports if not is_plugin_module(name)]
        hooks = [hook for hook in hooks if hook.get("type") not in PLUGIN_HOOKS]
        optim_wrapper = base.get("optim_wrapper") or {}
        if (optim_wrapper.get("constructor") == MERGED_CONSTRUCTOR
                or optim_wrapper.get("type") in PLUGIN_TYPE_BASES):
            stripped = {k: v for k, v in optim_wrapper.items() if k != "constructor"}
            stripped["type"] = PLUGIN_TYPE_BASES.get(stripped.get("type"), stripped.get("type", "OptimWrapper"))
            overlay["optim_wrapper"] = dict(_delete_=True, **stripped)
        runtime_info = default_hooks.get("runtime_info") or {}
        if runtime_info.get("type") in PLUGIN_TYPE_BASES:
            overlay["default_hooks"]["runtime_info"] = dict(
                _delete_=True, **dict(runtime_info, type=PLUGIN_TYPE_BASES[runtime_info["type"]]))
        # Values a config keeps under names of its own for its keys to refer to (configs/fast/_base_/): unread by
        # mmengine, but a stock run's config names deform_plugin nowhere.
        for key, value in base.items():
            if key not in overlay and key not in RUNNER_KEYS_HANDLED and plugin_references(value):
                overlay[key] = None
    if text_encoder is not None:
        imports.append(RANDOM_TEXT_ENCODER_MODULE)
    imports, hooks = imports + [TIMER_MODULE], hooks + [timer_hook(row, settings, timing_file)]
    if settings.profile_first is not None:
        if profile_dir is None:
            raise ValueError("settings.profile_first needs a profile_dir")
        imports, hooks = imports + [PROFILER_MODULE], hooks + [profiler_hook(settings, profile_dir)]
    overlay["custom_imports"] = dict(imports=imports, allow_failed_imports=False)
    overlay["custom_hooks"] = hooks
    return overlay


def _data_prefix(source: CocoSource) -> dict:
    """The dataset's ``data_prefix``: the images, and a panoptic set's PNGs (``seg``) where it has them."""
    return dict(img=source.image_dir) if source.seg_dir is None else dict(img=source.image_dir, seg=source.seg_dir)


def render_overlay(base_path: Path, overlay: dict, row: Row) -> str:
    lines = [f"# Benchmark overlay ({row.label}) written by deform_plugin/benchmarks/detector/user_path.py: the "
             "config below, timed on the synthetic COCO source.",
             f"_base_ = {str(base_path)!r}", ""]
    for key, value in overlay.items():
        lines.append(f"{key} = {pprint.pformat(value, width=110, sort_dicts=False)}")
    return "\n".join(lines) + "\n"
