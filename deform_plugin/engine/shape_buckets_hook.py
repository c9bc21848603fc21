"""``ShapeBucketsHook``: training batches padded to a few distinct shapes, and borrowed larger shapes
(``custom_hooks``)."""
from __future__ import annotations

import math
from typing import Dict, Optional, Set, Tuple

from mmengine.hooks import Hook
from mmengine.logging import print_log
from mmengine.registry import HOOKS


@HOOKS.register_module()
class ShapeBucketsHook(Hook):
    """Pad every training batch up to a multiple of ``size_divisor`` pixels per side: few distinct input shapes.

    Random-resize pipelines give nearly every batch a shape of its own, and every new shape costs host time that
    the step does not otherwise pay: cuDNN builds convolution plans per shape (on an H100, ~85 ms per step in fp32
    and ~200 ms in bf16 for a ResNet-50 DETR), cuBLAS picks GEMM kernels per shape, the allocator grows new blocks.
    With a divisor of 128 the DETR pipelines' batches fall into a few dozen shapes that are all seen early in a run.

    The data preprocessor's ``pad_size_divisor`` (mmengine ``ImgDataPreprocessor``, mmdet ``DetDataPreprocessor``)
    becomes the least common multiple of its own and ``size_divisor`` during training; validation and testing keep
    the config's own. This is not an exact fast path: images are padded further, as mmdet pads every image but the
    largest of a batch already (the DETR family masks padding in attention); the extra pixels cost FLOPs (about 15%
    more pixels at the DETR pipelines' sizes with 128) and change border features of the padded images slightly.

    Under distributed training every rank's batch is padded further to the largest of all ranks' padded shapes
    (one all-reduce of two integers per iteration over a gloo group, on the host: no device sync). Without it each
    rank meets its own new shapes, and an iteration in which any rank pays a new shape's cost (cuDNN planning, a
    CUDA-graph warm-up or capture) stalls every other rank at the gradient all-reduce. The data-parallel step
    already waits for the rank with the largest batch, so padding the others up to it costs little wall time.

    A shape's first batches can also borrow a larger shape that has run before (``borrow_until_seen``): a new
    shape costs one slow iteration (its cuDNN planning and, with ``FastPathsHook(cuda_graphs=True)``, its graph
    capture: ~250-400 ms on an H100/H200 for a ResNet-50 DETR, against a 60-110 ms step), while padding a batch up
    to a shape of at most ``borrow_max_pixels`` times its pixels costs at most that fraction more of one step. So a
    batch whose padded shape is new (seen fewer than ``borrow_until_seen`` times) is padded further, to the smallest
    shape that has run before and covers it within ``borrow_max_pixels``; when none does, or from its
    ``borrow_until_seen``-th batch on, it runs as its own shape. Early in a run the first shapes run as themselves
    and most new ones borrow; later every frequent shape has its own. Off by default (``borrow_until_seen=1``).

    Args:
        size_divisor (int): pad the training batch's height and width to a multiple of this (>= 1).
        same_shape_on_every_rank (bool): under distributed training, pad every rank's batch to the largest padded
            shape of all ranks (default True). Ignored in a single process.
        borrow_until_seen (int): a padded shape's first ``borrow_until_seen - 1`` batches borrow a larger shape that
            has run before, where one covers it (>= 1; 1: never borrow).
        borrow_max_pixels (float): the most pixels a borrowed shape may have, as a multiple of the batch's padded
            shape's (>= 1).
    """

    priority = "VERY_HIGH"

    def __init__(self, size_divisor: int = 128, same_shape_on_every_rank: bool = True, borrow_until_seen: int = 1,
                 borrow_max_pixels: float = 1.5):
        if isinstance(size_divisor, bool) or not isinstance(size_divisor, int) or size_divisor < 1:
            raise ValueError(f"ShapeBucketsHook: size_divisor must be an int >= 1, got {size_divisor!r}")
        self.size_divisor = size_divisor
        self.same_shape_on_every_rank = bool(same_shape_on_every_rank)
        self.borrowing = ShapeBorrowing(borrow_until_seen, borrow_max_pixels)
        self._eval_divisor: Optional[int] = None

    @staticmethod
    def _preprocessor(runner):
        model = getattr(runner.model, "module", runner.model)
        preprocessor = getattr(model, "data_preprocessor", None)
        if not isinstance(getattr(preprocessor, "pad_size_divisor", None), int):
            raise TypeError(f"ShapeBucketsHook needs a data preprocessor with an int pad_size_divisor (mmengine's "
                            f"ImgDataPreprocessor, mmdet's DetDataPreprocessor); this model has "
                            f"{type(preprocessor).__name__}")
        return preprocessor

    @staticmethod
    def training_divisor(config_divisor: int, size_divisor: int) -> int:
        """The training batch's padding divisor: a multiple of the config's own and of ``size_divisor``."""
        return math.lcm(config_divisor, size_divisor)

    def _set(self, runner, training: bool) -> None:
        preprocessor = self._preprocessor(runner)
        if self._eval_divisor is None:
            self._eval_divisor = preprocessor.pad_size_divisor
        preprocessor.pad_size_divisor = (self.training_divisor(self._eval_divisor, self.size_divisor) if training
                                         else self._eval_divisor)

    def before_train(self, runner) -> None:
        self._set(runner, training=True)
        preprocessor = self._preprocessor(runner)
        every_rank = self.same_shape_on_every_rank and _world_size() > 1
        borrowing = self.borrowing if self.borrowing.until_seen > 1 else None
        pad_training_batches_further(preprocessor, every_rank, borrowing)
        shared = f"; every rank's batch padded to the largest of the {_world_size()} ranks'" if every_rank else ""
        if borrowing is not None:
            shared += (f"; a shape's first {borrowing.until_seen - 1} batches borrow a shape that ran before, of at "
                       f"most {borrowing.max_pixels:g}x its pixels")
        print_log(f"ShapeBucketsHook: training batches padded to multiples of {preprocessor.pad_size_divisor} px "
                  f"(evaluation: {self._eval_divisor}){shared}", logger="current")

    def before_val_epoch(self, runner) -> None:
        self._set(runner, training=False)

    def after_val_epoch(self, runner, metrics=None) -> None:
        self._set(runner, training=True)

    def before_test_epoch(self, runner) -> None:
        self._set(runner, training=False)

    def after_train(self, runner) -> None:
        self._set(runner, training=False)
        if self.borrowing.until_seen > 1:
            print_log(f"ShapeBucketsHook: {self.borrowing.borrowed} of {self.borrowing.batches} training batches "
                      f"borrowed a larger shape; {len(self.borrowing.running)} shapes ran as themselves",
                      logger="current")


class ShapeBorrowing:
    """Which shape a training batch runs at: its own, or a larger one that has run before (see ShapeBucketsHook).

    Deterministic in the sequence of shapes it is given, so that ranks given the same shapes agree.
    """

    def __init__(self, until_seen: int = 1, max_pixels: float = 1.5):
        if isinstance(until_seen, bool) or not isinstance(until_seen, int) or until_seen < 1:
            raise ValueError(f"ShapeBucketsHook: borrow_until_seen must be an int >= 1, got {until_seen!r}")
        if isinstance(max_pixels, bool) or not isinstance(max_pixels, (int, float)) or not max_pixels >= 1:
            raise ValueError(f"ShapeBucketsHook: borrow_max_pixels must be a number >= 1, got {max_pixels!r}")
        self.until_seen = until_seen
        self.max_pixels = float(max_pixels)
        self.seen: Dict[Tuple[int, int], int] = {}
        self.running: Set[Tuple[int, int]] = set()  # shapes that have run as themselves
        self.batches = 0
        self.borrowed = 0

    def choose(self, shape: Tuple[int, int]) -> Tuple[int, int]:
        self.batches += 1
        self.seen[shape] = self.seen.get(shape, 0) + 1
        if shape in self.running or self.seen[shape] >= self.until_seen:
            self.running.add(shape)
            return shape
        height, width = shape
        covering = [(h, w) for h, w in self.running
                    if h >= height and w >= width and h * w <= self.max_pixels * height * width]
        if not covering:
            self.running.add(shape)
            return shape
        self.borrowed += 1
        return min(covering, key=lambda s: (s[0] * s[1], s))


def _world_size() -> int:
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def pad_training_batches_further(preprocessor, every_rank: bool, borrowing: Optional[ShapeBorrowing]) -> None:
    """Make ``preprocessor`` (mmengine ``ImgDataPreprocessor`` or mmdet ``DetDataPreprocessor``) pad each training
    batch further: with ``every_rank``, to the largest padded batch shape of all ranks of the default process group;
    then, with ``borrowing``, to the shape it chooses. Nothing to do: the preprocessor is left as it is.

    The ranks agree over a gloo group (the default group when it is gloo; else a new one, made here: every rank must
    call this), on the host, once per training call. The extra rows and columns get the preprocessor's own
    ``pad_value`` (padding is added after normalisation, as mmengine pads), ``batch_input_shape`` follows, and gt
    masks and semantic maps are padded again where the preprocessor pads them. Calls with ``training=False``
    (validation, testing) are left alone: ranks may see different numbers of evaluation batches.
    """
    import torch
    import torch.distributed as dist

    if (not every_rank and borrowing is None) or getattr(preprocessor, "_deform_plugin_pads_further", False):
        return
    group = None
    if every_rank and dist.get_backend() != "gloo":
        group = dist.new_group(backend="gloo")
    own_forward = preprocessor.forward

    def forward(data: dict, training: bool = False) -> dict:
        data = own_forward(data, training)
        if not training:
            return data
        height, width = data["inputs"].shape[-2:]
        target = (height, width)
        if every_rank:
            shape = torch.tensor(target, dtype=torch.int64)
            dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=group)
            target = (int(shape[0]), int(shape[1]))
        if borrowing is not None:
            target = borrowing.choose(target)
        if target != (height, width):
            _pad_batch_to(preprocessor, data, target)
        # What the training batch ran at, for timers and reports (the batch's own padding cannot tell).
        preprocessor.deform_plugin_training_shape = target
        return data

    preprocessor.forward = forward
    preprocessor._deform_plugin_pads_further = True


def _pad_batch_to(preprocessor, data: dict, target: Tuple[int, int]) -> None:
    import torch.nn.functional as F

    inputs = data["inputs"]
    height, width = inputs.shape[-2:]
    data["inputs"] = F.pad(inputs, (0, target[1] - width, 0, target[0] - height), "constant", preprocessor.pad_value)
    samples = data.get("data_samples")
    if samples is not None:
        for sample in samples:
            sample.set_metainfo({"batch_input_shape": target})
        if getattr(preprocessor, "pad_mask", False):
            preprocessor.pad_gt_masks(samples)
        if getattr(preprocessor, "pad_seg", False):
            preprocessor.pad_gt_sem_seg(samples)


def training_size_divisor_from_config(cfg) -> Optional[int]:
    """The ``size_divisor`` of a config's :class:`ShapeBucketsHook` (None when it has none)."""
    for hook_cfg in cfg.get("custom_hooks", None) or []:
        if hook_cfg.get("type") in ("ShapeBucketsHook", ShapeBucketsHook):
            return int(hook_cfg.get("size_divisor", 128))
    return None
