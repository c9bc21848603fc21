"""Config handling of the detector benchmark: loading (with or without deform_plugin), the edits a benchmark makes,
fast-path resolution, and the synthetic image size (default from the config's pipelines, checked against the
model's data preprocessor).
"""
from __future__ import annotations

import copy
import math
import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from deform_plugin.benchmarks.detector.rows import Row
from deform_plugin.benchmarks.stock_process import is_plugin_module

# What makes a config deform_plugin's rather than stock mmdet's: the package's imports (is_plugin_module), its hooks,
# its optimizer constructor, and its drop-in types with the mmengine types they extend (same arguments), which stock
# runs use.
FAST_PATHS_HOOK = "FastPathsHook"
PLUGIN_HOOKS = (FAST_PATHS_HOOK, "ShapeBucketsHook")
MERGED_CONSTRUCTOR = "MergedParamGroupsOptimWrapperConstructor"
PLUGIN_TYPE_BASES = {"SyncFreeOptimWrapper": "OptimWrapper", "SyncFreeAmpOptimWrapper": "AmpOptimWrapper",
                     "DeferredRuntimeInfoHook": "RuntimeInfoHook"}
# The switches (fields of deform_plugin.integration.mmdet_fast_paths.FastPaths) that each FAST choice of a row turns
# on. Beyond them, 'optim' sets the merged optimizer constructor, 'graph' also replays inference rows from a CUDA
# graph, and 'buckets' pads the training batches as ShapeBucketsHook does.
FAST_PATH_SWITCHES = {"optim": (), "sdpa": ("sdpa_attention",), "matching": ("batched_matching",),
                      "losses": ("sync_free_losses",), "batched": ("batched_losses",),
                      "forward": ("sync_free_forward",), "graph": ("cuda_graphs",),
                      "ffn": ("relu_dropout_fusion", "ffn_recompute"), "nms": ("float32_nms",), "buckets": ()}
# ShapeBucketsHook's default, for rows that force the buckets on a config without the hook.
DEFAULT_BUCKET_DIVISOR = 128
# mmdet's usual COCO test scale, used when a config's pipelines fix no size.
FALLBACK_SHAPE = (800, 1333)


def short_config_name(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0].replace("_deform-plugin", "")


def read_config(path: str, cfg_options: Optional[dict] = None):
    """The config with ``cfg_options`` merged, its custom imports not imported."""
    from mmengine.config import Config
    cfg = Config.fromfile(path, import_custom_modules=False)
    if cfg_options:
        cfg.merge_from_dict(cfg_options)
    return cfg


def load_config(path: str, cfg_options: Optional[dict], plugin: bool):
    """Load a config and import what it needs; with ``plugin=False`` strip every deform_plugin part first. A
    Grounding-DINO whose BERT files are missing gets the random text encoder (for timing only)."""
    from .random_text_encoder import use_random_text_encoder
    cfg = read_config(path, cfg_options)
    use_random_text_encoder(cfg, "auto")
    imports = list((cfg.get("custom_imports") or {}).get("imports", []))
    if not plugin:
        imports = [name for name in imports if not is_plugin_module(name)]
        if cfg.get("custom_hooks"):
            cfg.custom_hooks = [h for h in cfg.custom_hooks if h.get("type") not in PLUGIN_HOOKS]
        if cfg.optim_wrapper.get("constructor") == MERGED_CONSTRUCTOR:
            cfg.optim_wrapper.pop("constructor")
        if cfg.optim_wrapper.get("type") in PLUGIN_TYPE_BASES:
            cfg.optim_wrapper.type = PLUGIN_TYPE_BASES[cfg.optim_wrapper.type]
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


@dataclass(frozen=True)
class RowSpeedups:
    """What a row adds to the config's model: its fast paths (a ``FastPaths``; None for stock rows), graph-replayed
    inference, and the training batch's size divisor of ShapeBucketsHook (None: no further padding)."""

    fast_paths: Optional[object] = None
    graph_inference: bool = False
    bucket_divisor: Optional[int] = None


def resolve_fast_paths(cfg, row: Row) -> RowSpeedups:
    """Set the optimizer constructor in ``cfg`` for ``row``; return what the row adds to the model."""
    if not row.plugin:
        return RowSpeedups()
    from deform_plugin.engine import fast_path_switches_from_config, training_size_divisor_from_config
    from deform_plugin.integration.mmdet_fast_paths import FastPaths
    forced = row.fast_set()
    divisor = training_size_divisor_from_config(cfg)
    if forced is None:
        return RowSpeedups(FastPaths.from_dict(fast_path_switches_from_config(cfg)), bucket_divisor=divisor)
    if "optim" in forced:
        cfg.optim_wrapper["constructor"] = MERGED_CONSTRUCTOR
    elif cfg.optim_wrapper.get("constructor") == MERGED_CONSTRUCTOR:
        cfg.optim_wrapper.pop("constructor")
    switches = {switch: True for choice in forced for switch in FAST_PATH_SWITCHES[choice]}
    return RowSpeedups(FastPaths.from_dict(switches), graph_inference="graph" in forced,
                       bucket_divisor=(divisor or DEFAULT_BUCKET_DIVISOR) if "buckets" in forced else None)


def optim_wrapper_config(cfg, mode: str, plugin: bool = False):
    """The config's optimizer wrapper in ``mode``: fp32 drops AMP; fp16/bf16 make it the AMP wrapper the training
    scripts use (mmengine's ``AmpOptimWrapper`` for stock, ``SyncFreeAmpOptimWrapper`` as tools/train.py sets it)."""
    ow = copy.deepcopy(cfg.optim_wrapper)
    if mode == "fp32":
        if ow.get("type") in ("AmpOptimWrapper", "SyncFreeAmpOptimWrapper"):
            ow["type"] = "OptimWrapper"
            ow.pop("dtype", None)
            ow.pop("loss_scale", None)
        return ow
    ow["type"] = "SyncFreeAmpOptimWrapper" if plugin else "AmpOptimWrapper"
    ow["dtype"] = "float16" if mode == "fp16" else "bfloat16"
    ow.setdefault("loss_scale", "dynamic")
    return ow


@contextmanager
def runner_logging(cfg, row: Row):
    """What the Runner's logging of ``cfg`` does to the steps run inside: with deform_plugin's
    ``DeferredRuntimeInfoHook`` (the configs/fast variants) a ``SyncFree*OptimWrapper`` keeps the gradient norm on
    the device instead of reading it every step, as in the user's run; otherwise nothing changes. Yields whether
    logging is deferred."""
    runtime_info = (cfg.get("default_hooks") or {}).get("runtime_info") or {}
    if not row.plugin or runtime_info.get("type") != "DeferredRuntimeInfoHook":
        yield False
        return
    from deform_plugin.engine import DEFERRED_SCALARS
    DEFERRED_SCALARS.active = True
    try:
        yield True
    finally:
        DEFERRED_SCALARS.active = False
        DEFERRED_SCALARS.discard()


def autocast_for(mode: str, device: torch.device):
    if mode == "fp32":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.float16 if mode == "fp16" else torch.bfloat16)


# ---------------------------------------------------------------------------------------------------------------------
# Synthetic image size
# ---------------------------------------------------------------------------------------------------------------------

def _type_name(transform) -> str:
    return str(transform.get("type", "")).split(".")[-1]


def _dataset_pipeline(dataset) -> Optional[list]:
    # Dataset wrappers (RepeatDataset, ClassBalancedDataset, ConcatDataset) hold the real dataset inside.
    while isinstance(dataset, dict):
        if dataset.get("pipeline"):
            return list(dataset["pipeline"])
        dataset = dataset.get("dataset") or (list(dataset.get("datasets") or []) or [None])[0]
    return None


def config_pipelines(cfg) -> List[Tuple[str, list]]:
    """(name, transforms) of the training pipeline, then of the test pipeline, where the config has them."""
    found = []
    for split in ("train", "test"):
        pipeline = _dataset_pipeline((cfg.get(f"{split}_dataloader") or {}).get("dataset"))
        if pipeline is None and cfg.get(f"{split}_pipeline"):
            pipeline = list(cfg.get(f"{split}_pipeline"))
        if pipeline:
            found.append((f"{split} pipeline", pipeline))
    return found


def fixed_size(transform) -> Optional[Tuple[int, int]]:
    """(H, W) of a landscape image after ``transform``, when it fixes one; None for random or relative sizes.

    ``Resize``: ``scale`` (or mmdet 2's ``img_scale``) without ``ratio_range``; with ``keep_ratio`` a landscape
    image fills (short side, long side). ``FixedShapeResize``: (height, width). ``RandomCrop`` of type 'absolute':
    ``crop_size`` is (w, h).
    """
    if not isinstance(transform, dict):
        return None
    kind = _type_name(transform)
    if kind == "Resize":
        scale = transform.get("scale", transform.get("img_scale"))
        if transform.get("ratio_range") is not None or transform.get("scale_factor") is not None:
            return None
        if isinstance(scale, int):
            return scale, scale
        if not (isinstance(scale, (tuple, list)) and len(scale) == 2 and all(isinstance(s, int) for s in scale)):
            return None
        if transform.get("keep_ratio", False):
            return min(scale), max(scale)
        return scale[1], scale[0]
    if kind == "FixedShapeResize":
        return int(transform["height"]), int(transform["width"])
    if kind == "RandomCrop" and transform.get("crop_type", "absolute") == "absolute":
        width, height = transform["crop_size"]
        return int(height), int(width)
    return None


def default_shape(cfg) -> Tuple[Tuple[int, int], str]:
    """The synthetic (H, W) for a config, and where it came from.

    The first fixed size in the training pipeline (e.g. the LSJ crop of Mask2Former's configs: 1024x1024), else in
    the test pipeline (the DETR family's ``Resize(scale=(1333, 800), keep_ratio=True)``: 800x1333), else 800x1333.
    """
    for name, pipeline in config_pipelines(cfg):
        for transform in pipeline:
            size = fixed_size(transform)
            if size is not None:
                return size, f"{name}: {_type_name(transform)}"
    return FALLBACK_SHAPE, "the config's pipelines fix no size: mmdet's usual COCO test scale"


def shape_problems(cfg, shape: Tuple[int, int]) -> List[str]:
    """Why the config's model cannot take a batch of (H, W) images; empty when it can."""
    height, width = shape
    if height < 1 or width < 1:
        return [f"{height}x{width} is not an image size"]
    preprocessor = cfg.model.get("data_preprocessor") or {}
    divisor = preprocessor.get("pad_size_divisor", 1) or 1
    padded = (math.ceil(height / divisor) * divisor, math.ceil(width / divisor) * divisor)
    problems = []
    for augment in preprocessor.get("batch_augments") or []:
        if _type_name(augment) != "BatchFixedSizePad":
            continue
        fixed = tuple(augment["size"])
        smaller = padded[0] < fixed[0] or padded[1] < fixed[1]
        larger = padded[0] > fixed[0] or padded[1] > fixed[1]
        if smaller and larger:
            problems.append(
                f"the data preprocessor pads every batch to {fixed[0]}x{fixed[1]} (BatchFixedSizePad, the training "
                f"crop), but the batch is {padded[0]}x{padded[1]} (after padding to a multiple of {divisor}): larger "
                "on one side and smaller on the other. BatchFixedSizePad then pads the images to "
                f"{max(padded[0], fixed[0])}x{max(padded[1], fixed[1])} but records {fixed[0]}x{fixed[1]} and "
                "reshapes the instance masks to it, which fails ('cannot reshape array ...'). Use a shape within "
                f"{fixed[0]}x{fixed[1]}, or at least as large on both sides")
    return problems
