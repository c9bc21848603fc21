"""The configs the AP parity tool (:mod:`.ap_parity`) trains: one overlay per (config, row, seed), derived from the
shipped configs.

A parity config names two shipped files: the *stock* one (``configs/<family>/..._deform-plugin.py``, which is stock
mmdet plus the plugin import) and the *fast* one (``configs/fast/...-fast.py``, every fast path as shipped). A stock
row's overlay inherits the stock file with every deform_plugin import removed (mmdet and mmcv as they are); an
``ours`` row's overlay inherits the fast file unchanged, less its ``ShapeBucketsHook`` for ``:no-buckets``; bf16 and
fp16 come from the training script's own switch (``tools/train.py --amp-dtype``), as for users.

:func:`prepare_data` finds (or generates) the shapes set and writes the val subset of ``--val-images``.

Every overlay then changes the same things, identically for every row:

- data: the embedded shapes set (docs/dataset.md) read by mmdet's own ``CocoDataset`` and ``CocoMetric`` (paths and
  classes written out, so that stock runs need nothing of deform_plugin), a random-resize train pipeline over
  square ``scales`` (sizes vary, so batches pad and ``ShapeBucketsHook`` pads further), a fixed test scale;
- model: 4 classes; no pretrained weights (nothing is downloaded); with ``backbone='trainable'`` the ResNet trains
  from scratch (no frozen stages, BatchNorm learning its statistics; the shipped configs freeze the stem and every
  BatchNorm because they start from ImageNet weights, which from random weights would leave the residual branches
  at their zero initialisation forever);
- schedule: an ``IterBasedTrainLoop`` of ``iters`` (with ``auto``, decided during the run: the same for every row
  of a config), linear warm-up then the learning rate divided by 10 at 80%,
  ``lr`` and the backbone's ``lr_mult`` overridable, validation at the end and every ``val_every`` (halfway by
  default: a comparison at equal iterations even where a deadline cuts the second half), one checkpoint at the end
  (weights only);
- the same initial weights per seed (``load_from``, built by :mod:`.initial_weights` while the runs start: each
  run waits for its file before loading it) and ``randomness.seed``;
- two benchmark hooks: :class:`.iteration_timer.IterationTimerHook` (peak memory, padding, graph captures, which
  MSDA ran, a check that stock stays stock) and :class:`.parity_hook.ParityRunHook` (time limit, progress,
  evaluations).
"""
from __future__ import annotations

import copy
import json
import math
import pprint
import runpy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ..common import REPO_ROOT
from ..stock_process import is_plugin_module
from .train_overlay import (
    SHAPE_BUCKETS_HOOK,
    TIMER_HOOK,
    TIMER_MODULE,
    Row,
    custom_import_names,
    plugin_references,
    pretrained_overrides,
    read_base_config,
)

SHAPES_SCRIPT = Path(__file__).resolve().parents[2] / "datasets" / "shapes.py"
PARITY_HOOK = "ParityRunHook"
PARITY_MODULE = "deform_plugin.benchmarks.detector.parity_hook"
BACKBONE_MODES = ("trainable", "as-config")
LR_DECAY_AT = 0.8  # the learning rate drops 10x after this fraction of the iterations
NUM_CLASSES = 4


@dataclass(frozen=True)
class ParityConfig:
    """A model family as the tool trains it: the shipped stock-plus-import config and its fast variant."""

    name: str
    title: str
    stock: Path
    fast: Path

    def base_for(self, row: Row) -> Path:
        return self.stock if row.stock else self.fast


def _config(name: str, title: str, stock: str, fast: str) -> ParityConfig:
    return ParityConfig(name, title, REPO_ROOT / "configs" / stock, REPO_ROOT / "configs" / fast)


PARITY_CONFIGS: Dict[str, ParityConfig] = {c.name: c for c in (
    _config("ddetr", "Deformable-DETR refine two-stage R50",
            "deformable_detr/deformable-detr-refine-twostage_r50_16xb2-50e_coco_deform-plugin.py",
            "fast/deformable-detr-refine-twostage_r50_16xb2-50e_coco_deform-plugin-fast.py"),
    _config("dino", "DINO-4scale R50", "dino/dino-4scale_r50_8xb2-12e_coco_deform-plugin.py",
            "fast/dino-4scale_r50_8xb2-12e_coco_deform-plugin-fast.py"),
    # The demo's tiny Deformable-DETR R18: seconds per run on a CPU (the tool's tests).
    _config("demo", "tiny Deformable-DETR refine R18 (demo)",
            "demo/deformable-detr-refine_r18_tiny_1xb4-500i_shapes.py",
            "fast/deformable-detr-refine_r18_tiny_1xb4-500i_shapes-fast.py"),
)}


@dataclass(frozen=True)
class Schedule:
    """What every run of a parity study shares (the tool's options)."""

    iters: int = 300
    batch_size: int = 4
    scales: Tuple[int, ...] = (288, 320, 352, 384, 416, 448, 480)
    test_scale: int = 384
    lr: float = 2e-4
    backbone_lr_mult: float = 1.0
    warmup_iters: int = 50
    workers: int = 1
    val_batch_size: int = 8
    logger_interval: int = 10
    val_every: Optional[int] = None  # also validate every this many iterations; None: halfway; 0: at the end only
    backbone: str = "trainable"
    # True: ``iters`` is an upper bound; the tool decides each config's iterations, learning rate step and halfway
    # validation during the run (ParityRunHook's schedule file), from the speed its runs reach.
    auto: bool = False

    def problems(self) -> List[str]:
        """What is wrong with these settings, one message per value (empty when nothing is)."""
        found = []
        iters = "--max-iters" if self.auto else "--iters"
        for name in ("iters", "batch_size", "test_scale", "val_batch_size", "logger_interval"):
            if getattr(self, name) < 1:
                option = iters if name == "iters" else f"--{name.replace('_', '-')}"
                found.append(f"{option} {getattr(self, name)} must be at least 1")
        if not self.scales or any(s < 1 for s in self.scales):
            found.append(f"--scales {' '.join(map(str, self.scales))}: each must be a positive side length")
        for name in ("workers", "warmup_iters", "val_every"):
            if (getattr(self, name) or 0) < 0:
                found.append(f"--{name.replace('_', '-')} {getattr(self, name)} must not be negative")
        if self.auto and self.val_every:
            found.append(f"--val-every {self.val_every} with --iters auto: the schedule decided during the run "
                         "validates halfway (or, with --val-every 0, at the end only)")
        elif (self.val_every or 0) > self.iters:
            found.append(f"--val-every {self.val_every} is more than --iters {self.iters}")
        if self.warmup_iters >= self.iters:
            found.append(f"--warmup-iters {self.warmup_iters} must be less than {iters} {self.iters}")
        if not self.lr > 0:
            found.append(f"--lr {self.lr} must be positive")
        if not self.backbone_lr_mult > 0:
            found.append(f"--backbone-lr-mult {self.backbone_lr_mult} must be positive")
        if self.backbone not in BACKBONE_MODES:
            found.append(f"--backbone {self.backbone!r} is not one of {', '.join(BACKBONE_MODES)}")
        return found

    @property
    def decay_iteration(self) -> int:
        return max(1, int(round(LR_DECAY_AT * self.iters)))

    @property
    def val_interval(self) -> int:
        """Iterations between validations (the last iteration always validates; with ``auto``, until the
        schedule is decided, that one only)."""
        every = self.iters // 2 if self.val_every is None else self.val_every
        return every if every > 0 and not self.auto else self.iters

    def eval_iterations(self) -> List[int]:
        """The iterations after which a complete run validates."""
        return list(range(self.val_interval, self.iters, self.val_interval)) + [self.iters]


@dataclass(frozen=True)
class ShapesData:
    """Where the shapes set is, as mmdet's ``CocoDataset`` and ``CocoMetric`` read it."""

    root: Path
    classes: Tuple[str, ...]
    palette: Tuple[Tuple[int, int, int], ...]
    val_ann_file: Path  # absolute: the whole val split, or the subset the tool wrote
    val_images: int

    def dataset(self, split: str, pipeline: list, test_mode: bool) -> dict:
        ann_file = f"annotations/instances_{split}.json" if split == "train" else str(self.val_ann_file)
        return dict(type="CocoDataset", data_root=str(self.root), ann_file=ann_file,
                    data_prefix=dict(img=f"{split}/"),
                    metainfo=dict(classes=list(self.classes), palette=[list(c) for c in self.palette]),
                    filter_cfg=dict(filter_empty_gt=False), test_mode=test_mode, pipeline=pipeline,
                    backend_args=None)


class ToolError(Exception):
    """A bad value in the command line or the work dir: one message that names it."""


def shapes_module() -> dict:
    """deform_plugin/datasets/shapes.py run by path (numpy and OpenCV only): this process stays plugin-free."""
    return runpy.run_path(str(SHAPES_SCRIPT))


def prepare_data(cache_root: Optional[Path], val_images: Optional[int], work_dir: Path,
                 generate: bool = True) -> ShapesData:
    """The shapes set (generated if missing) and the val annotations evaluated against (the split's first
    ``val_images`` images, written into the work dir, or the whole split)."""
    shapes = shapes_module()
    root = (shapes["ensure_shapes_dataset"] if generate else shapes["shapes_dataset_dir"])(cache_root)
    split_images = shapes["SPLIT_SIZES"]["val"]
    val_ann = Path(root) / "annotations" / "instances_val.json"
    count = split_images if val_images is None else val_images
    if count > split_images:
        raise ToolError(f"--val-images {val_images}: the val split has {split_images} images")
    if count < split_images and generate:
        coco = json.loads(val_ann.read_text())
        images = sorted(coco["images"], key=lambda image: image["id"])[:count]
        kept = {image["id"] for image in images}
        coco.update(images=images, annotations=[a for a in coco["annotations"] if a["image_id"] in kept])
        val_ann = Path(work_dir) / "data" / f"instances_val_first{count}.json"
        val_ann.parent.mkdir(parents=True, exist_ok=True)
        val_ann.write_text(json.dumps(coco))
    elif count < split_images:
        val_ann = Path(work_dir) / "data" / f"instances_val_first{count}.json"
    return ShapesData(root=Path(root), classes=tuple(shapes["SHAPES_CLASSES"]),
                      palette=tuple(tuple(c) for c in shapes["SHAPES_PALETTE"]), val_ann_file=val_ann.resolve(),
                      val_images=count)


@dataclass(frozen=True)
class RunFiles:
    """The files one run writes besides mmengine's own."""

    work_dir: Path
    result: Path = field(init=False)
    status: Path = field(init=False)
    timing: Path = field(init=False)
    overlay: Path = field(init=False)
    log: Path = field(init=False)
    run: Path = field(init=False)

    def __post_init__(self):
        for name, file_name in (("result", "parity.json"), ("status", "status.json"), ("timing", "timing.json"),
                                ("overlay", "config.py"), ("log", "train.log"), ("run", "run.json")):
            object.__setattr__(self, name, Path(self.work_dir) / file_name)


def encoder_tokens(side: int, levels: int) -> int:
    """Tokens of the transformer encoder for a square ``side`` image: the ResNet's levels of stride 8, 16, 32 and the
    neck's extra stride-2 levels (each convolution rounds up)."""
    return sum(math.ceil(side / (8 * 2 ** level)) ** 2 for level in range(levels))


def scale_problems(name: str, base_cfg, schedule: Schedule) -> List[str]:
    """Why the scales cannot train or test ``base_cfg``'s model: a two-stage DETR picks its queries as the top-k of
    the encoder's tokens (``torch.topk`` fails with 'selected index k out of range' when there are fewer)."""
    model = base_cfg.model
    if not model.get("as_two_stage") or not model.get("num_queries"):
        return []
    levels = model.get("num_feature_levels") or (model.get("neck") or {}).get("num_outs") or 4
    queries = int(model.num_queries)
    smallest = min(min(schedule.scales), schedule.test_scale)
    if encoder_tokens(smallest, levels) >= queries:
        return []
    enough = next(side for side in range(smallest, 8 * 4096) if encoder_tokens(side, levels) >= queries)
    return [f"{name}: side {smallest} gives the encoder {encoder_tokens(smallest, levels)} tokens, but the model "
            f"picks its {queries} queries among them (two-stage top-k): use --scales and --test-scale of at least "
            f"{enough}"]


def train_pipeline(schedule: Schedule) -> list:
    return [dict(type="LoadImageFromFile", backend_args=None),
            dict(type="LoadAnnotations", with_bbox=True),
            dict(type="RandomFlip", prob=0.5),
            dict(type="RandomChoiceResize", scales=[(s, s) for s in schedule.scales], keep_ratio=True),
            dict(type="PackDetInputs")]


def test_pipeline(schedule: Schedule) -> list:
    return [dict(type="LoadImageFromFile", backend_args=None),
            dict(type="Resize", scale=(schedule.test_scale, schedule.test_scale), keep_ratio=True),
            dict(type="LoadAnnotations", with_bbox=True),
            dict(type="PackDetInputs", meta_keys=("img_id", "img_path", "ori_shape", "img_shape", "scale_factor"))]


def param_schedulers(schedule: Schedule) -> list:
    schedulers = []
    if schedule.warmup_iters:
        schedulers.append(dict(type="LinearLR", start_factor=0.001, by_epoch=False, begin=0,
                               end=schedule.warmup_iters))
    schedulers.append(dict(type="MultiStepLR", by_epoch=False, begin=0, end=schedule.iters,
                           milestones=[schedule.decay_iteration], gamma=0.1))
    return schedulers


def model_overrides(base_model: dict, schedule: Schedule) -> dict:
    """4 classes, no pretrained weights, and (``backbone='trainable'``) a ResNet that trains from scratch."""
    overrides = pretrained_overrides(base_model)
    overrides.setdefault("bbox_head", {})["num_classes"] = NUM_CLASSES
    backbone = overrides.setdefault("backbone", {})
    backbone["init_cfg"] = None
    if schedule.backbone == "trainable":
        backbone.update(frozen_stages=-1, norm_eval=False, norm_cfg=dict(type="BN", requires_grad=True))
    return overrides


def overlay_settings(base_cfg, row: Row, seed: int, schedule: Schedule, data: ShapesData, files: RunFiles,
                     init_weights: Optional[Path], time_limit_s: Optional[float] = None,
                     stop_at: Optional[float] = None, pace_file: Optional[Path] = None,
                     schedule_file: Optional[Path] = None) -> dict:
    """The top-level keys one run's overlay sets on top of ``base_cfg`` (the stock or the fast config); the
    run's ParityRunHook paces it by ``pace_file`` and takes its schedule from ``schedule_file``, where given."""
    base = base_cfg.to_dict()

    def replacing(key_exists: bool, value: dict) -> dict:
        # `_delete_` replaces the base dict instead of merging; mmengine only removes the flag when the key exists.
        return dict(_delete_=True, **value) if key_exists else value

    train_loader = base.get("train_dataloader") or {}
    overlay: Dict[str, object] = {}
    overlay["model"] = model_overrides(base.get("model") or {}, schedule)
    overlay["train_dataloader"] = dict(
        batch_size=schedule.batch_size, num_workers=schedule.workers, persistent_workers=schedule.workers > 0,
        sampler=replacing("sampler" in train_loader, dict(type="InfiniteSampler", shuffle=True)),
        batch_sampler=None,
        dataset=replacing("dataset" in train_loader, data.dataset("train", train_pipeline(schedule), False)))
    for stage in ("val", "test"):
        loader = base.get(f"{stage}_dataloader") or {}
        overlay[f"{stage}_dataloader"] = dict(
            batch_size=schedule.val_batch_size, num_workers=schedule.workers, persistent_workers=False,
            drop_last=False, sampler=replacing("sampler" in loader, dict(type="DefaultSampler", shuffle=False)),
            dataset=replacing("dataset" in loader, data.dataset("val", test_pipeline(schedule), True)))
        overlay[f"{stage}_evaluator"] = replacing(
            bool(base.get(f"{stage}_evaluator")),
            dict(type="CocoMetric", ann_file=str(data.val_ann_file), metric="bbox", format_only=False,
                 backend_args=None))
    overlay["train_cfg"] = replacing("train_cfg" in base, dict(
        type="IterBasedTrainLoop", max_iters=schedule.iters, val_interval=schedule.val_interval))
    overlay["val_cfg"] = replacing("val_cfg" in base, dict(type="ValLoop"))
    overlay["test_cfg"] = replacing("test_cfg" in base, dict(type="TestLoop"))
    overlay["param_scheduler"] = param_schedulers(schedule)
    overlay["optim_wrapper"] = dict(optimizer=dict(lr=schedule.lr), paramwise_cfg=dict(
        custom_keys=dict(backbone=dict(lr_mult=schedule.backbone_lr_mult))))
    default_hooks = base.get("default_hooks") or {}
    overlay["default_hooks"] = dict(
        logger=dict(interval=schedule.logger_interval),
        checkpoint=replacing("checkpoint" in default_hooks, dict(
            type="CheckpointHook", by_epoch=False, interval=schedule.iters, save_last=True, save_optimizer=False,
            max_keep_ckpts=1)))
    # Each logged loss is the mean over every iteration since the last one: a non-finite loss anywhere shows.
    overlay["log_processor"] = dict(by_epoch=False, window_size=schedule.logger_interval)
    overlay["randomness"] = dict(seed=seed)
    overlay["load_from"] = None if init_weights is None else str(init_weights)
    overlay["resume"] = False
    overlay["auto_scale_lr"] = dict(enable=False, base_batch_size=schedule.batch_size)

    imports = custom_import_names(base)
    hooks = copy.deepcopy(list(base.get("custom_hooks") or []))
    if not row.buckets:
        hooks = [hook for hook in hooks if hook.get("type") != SHAPE_BUCKETS_HOOK]
    if row.stock:
        imports = [name for name in imports if not is_plugin_module(name)]
    timer = dict(type=TIMER_HOOK, windows=[[1, schedule.iters]], warmup_iters=min(20, schedule.iters),
                 out_file=str(files.timing), expect_plugin=not row.stock, label=row.label)
    parity = dict(type=PARITY_HOOK, result_file=str(files.result), status_file=str(files.status),
                  time_limit_s=time_limit_s, stop_at=stop_at,
                  wait_for=None if init_weights is None else str(init_weights),
                  # Paced runs report often: the tool's pace follows the slowest run's status.
                  status_every_s=0.5 if pace_file else 5.0, pace_file=None if pace_file is None else str(pace_file),
                  schedule_file=None if schedule_file is None else str(schedule_file),
                  label=f"{row.label} seed {seed}")
    overlay["custom_imports"] = dict(imports=imports + [TIMER_MODULE, PARITY_MODULE], allow_failed_imports=False)
    overlay["custom_hooks"] = hooks + [timer, parity]
    return overlay


def render_overlay(base_path: Path, overlay: dict, title: str) -> str:
    lines = [f"# AP parity run ({title}) written by deform_plugin/benchmarks/detector/ap_parity.py: the config "
             "below, trained on the embedded shapes set.", f"_base_ = {str(base_path)!r}", ""]
    for key, value in overlay.items():
        lines.append(f"{key} = {pprint.pformat(value, width=110, sort_dicts=False)}")
    return "\n".join(lines) + "\n"


def init_overlay_settings(base_cfg, schedule: Schedule) -> dict:
    """The stock overlay the initial weights are built from: the model as every run of the config has it."""
    imports = custom_import_names(base_cfg)
    return dict(model=model_overrides(base_cfg.to_dict().get("model") or {}, schedule),
                custom_imports=dict(imports=[n for n in imports if not is_plugin_module(n)],
                                    allow_failed_imports=False))


def write_overlay(path: Path, base_path: Path, overlay: dict, title: str, stock: bool) -> None:
    """Write the overlay; a stock one that still names a deform_plugin piece is refused (it would not be stock)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_overlay(base_path, overlay, title))
    if stock:
        leftovers = plugin_references(read_base_config(path).to_dict())
        if leftovers:
            raise ValueError(f"the stock config {path} still names deform_plugin: " + ", ".join(leftovers))


def key_fields(cfg) -> Dict[str, object]:
    """The fields of a merged run config that the dry run prints: what differs between rows, and the schedule."""
    loader = cfg.train_dataloader
    resize = [t for t in loader.dataset.pipeline if t["type"] == "RandomChoiceResize"]
    optim = cfg.optim_wrapper
    backbone = cfg.model.get("backbone", {})
    return dict(
        custom_imports=list(cfg.custom_imports.imports),
        custom_hooks=[h["type"] + (f"({h.get('size_divisor')})" if h["type"] == SHAPE_BUCKETS_HOOK else "")
                      for h in cfg.custom_hooks],
        optim_wrapper=f"{optim.get('type', 'OptimWrapper')}, constructor {optim.get('constructor', 'default')}, "
                      f"{optim.optimizer.type} lr {optim.optimizer.lr}, "
                      f"backbone lr_mult {optim.paramwise_cfg.custom_keys.backbone.lr_mult}",
        num_classes=cfg.model.bbox_head.num_classes,
        backbone=f"frozen_stages {backbone.get('frozen_stages')}, norm_eval {backbone.get('norm_eval')}, "
                 f"BN requires_grad {backbone.get('norm_cfg', {}).get('requires_grad')}, "
                 f"init_cfg {backbone.get('init_cfg')}",
        train=f"batch {loader.batch_size}, {loader.num_workers} workers, scales "
              f"{[s[0] for s in resize[0]['scales']] if resize else '?'}",
        max_iters=cfg.train_cfg.max_iters,
        val_interval=cfg.train_cfg.val_interval,
        param_scheduler=[f"{s['type']}(end {s.get('end')}" + (f", milestones {list(s['milestones'])}"
                                                              if s.get("milestones") else "") + ")"
                         for s in cfg.param_scheduler],
        randomness=dict(cfg.randomness),
        load_from=cfg.load_from,
    )
