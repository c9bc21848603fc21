"""Hooks of the fast training step: the exact fast paths, and loss logging without per-iteration host syncs."""
from __future__ import annotations

import math
from typing import Dict, Optional, Set, Tuple

from mmengine.hooks import Hook, LoggerHook, RuntimeInfoHook
from mmengine.logging import print_log
from mmengine.registry import HOOKS

from .sync_free import DEFERRED_SCALARS


@HOOKS.register_module()
class FastPathsHook(Hook):
    """Switch the model to deform_plugin's exact fast paths before training, validation or testing starts.

    Add to a config::

        custom_hooks = [dict(type='FastPathsHook', sdpa_attention=True, batched_matching=True,
                             sync_free_losses=True)]

    Each switch is off unless set. The switches change classes/methods of existing objects only (no new
    parameters), so checkpoints stay interchangeable with stock runs.

    Args:
        sdpa_attention (bool): mmcv ``MultiheadAttention`` bricks run PyTorch SDPA (``need_weights=False``).
        hungarian_host_syncs (bool): ``HungarianAssigner.assign`` builds its result on the host and copies it once,
            without blocking; DETR-family heads take their positive/negative query indices from that host copy
            instead of two ``nonzero()`` syncs.
        batched_matching (bool): every decoder layer's matching of a step in one cost pass and one copy to the
            host (turns ``hungarian_host_syncs`` on too).
        sync_free_losses (bool): the DETR heads' per-layer loss normalisers without host syncs.
        sync_free_forward (bool): Deformable-DETR's and DINO's forward without host syncs (level tables made on the
            host, the host's sizes walked instead of the device's).
        batched_losses (bool): every decoder layer's DETR loss (focal, L1, GIoU) of a step in one pass over all
            layers, from the assignments solved ahead (turns ``batched_matching`` on too); DINO's denoising losses
            in one pass as well.
        cuda_graphs (bool): the network's training forward and backward replayed from CUDA graphs, per input shape.
        graph_capture_after (int, optional): with ``cuda_graphs``, the call at which an input shape is captured
            (``CapturePolicy.capture_after``). None (the default): 1 where the run pads its batches with
            :class:`ShapeBucketsHook` (shapes recur by construction: a new one is captured at its first call), else
            2 (a random-resize pipeline's shapes rarely recur: a shape seen once runs eagerly).
        max_graphs (int): with ``cuda_graphs``, input shapes captured at most; later new shapes run eagerly.
        max_graph_memory_mb (float, optional): with ``cuda_graphs``, the device memory the captures may add, MiB.
        precompile_triton (bool): compile the model's Triton MSDA kernels in background processes while the run
            starts (default True; see :mod:`deform_plugin.ops.msda.precompile`).
        split_graphs_at_features (bool, optional): with ``cuda_graphs``, the DETRs' backbone and neck captured as a
            region of their own, so that DistributedDataParallel all-reduces the other gradients while the
            backbone's backward replays. None (the default): only under DistributedDataParallel. Unwrapped or
            under ``FlatGradientsDataParallel`` the graphed regions write the gradients into the parameters'
            slots (:mod:`deform_plugin.engine.data_parallel`).
        relu_dropout_fusion (bool): mmcv ``FFN``'s ReLU and dropout keep one activation for backward instead of
            three (less memory; the same outputs, random draws and gradients).
        ffn_recompute (bool): mmcv ``FFN``s without dropout keep only their input and recompute their hidden layer
            in the backward (less memory for two more matmuls per FFN; the same outputs and gradients).
    """

    priority = "VERY_HIGH"

    def __init__(self, sdpa_attention: bool = False, hungarian_host_syncs: bool = False,
                 batched_matching: bool = False, sync_free_losses: bool = False, sync_free_forward: bool = False,
                 batched_losses: bool = False, cuda_graphs: bool = False, relu_dropout_fusion: bool = False,
                 ffn_recompute: bool = False, split_graphs_at_features: Optional[bool] = None,
                 graph_capture_after: Optional[int] = None, max_graphs: int = 64,
                 max_graph_memory_mb: Optional[float] = None, precompile_triton: bool = True):
        from deform_plugin.cuda_graphs import CapturePolicy

        # Checked now, so that a bad value fails when the config is built.
        CapturePolicy(capture_after=graph_capture_after or 1, max_graphs=max_graphs,
                      max_graph_memory_mb=max_graph_memory_mb)
        self.graph_capture_after = graph_capture_after
        self.max_graphs = max_graphs
        self.max_graph_memory_mb = max_graph_memory_mb
        self.precompile_triton = bool(precompile_triton)
        self.switches = dict(sdpa_attention=bool(sdpa_attention), hungarian_host_syncs=bool(hungarian_host_syncs),
                             batched_matching=bool(batched_matching), sync_free_losses=bool(sync_free_losses),
                             sync_free_forward=bool(sync_free_forward), batched_losses=bool(batched_losses),
                             cuda_graphs=bool(cuda_graphs), relu_dropout_fusion=bool(relu_dropout_fusion),
                             ffn_recompute=bool(ffn_recompute))
        self.split_graphs_at_features = (None if split_graphs_at_features is None
                                         else bool(split_graphs_at_features))

    def _gradient_slots(self, model):
        """Where the graphed regions write the gradients: the wrapper's slots under
        :class:`~deform_plugin.engine.data_parallel.FlatGradientsDataParallel`, new slots for an unwrapped model,
        none under another wrapper (DistributedDataParallel's reducer needs autograd's accumulation) or off CUDA."""
        from mmengine.model import is_model_wrapper

        from .data_parallel import ParameterGradientSlots
        if not self.switches["cuda_graphs"]:
            return None
        if is_model_wrapper(model):
            return getattr(model, "gradient_slots", None)
        if not any(parameter.is_cuda for parameter in model.parameters()):
            return None  # no graphs off CUDA: the regions run eagerly
        return ParameterGradientSlots(model.parameters())

    def capture_policy(self, runner):
        """The graphs' capture policy for this run (see ``graph_capture_after``)."""
        from deform_plugin.cuda_graphs import CapturePolicy
        capture_after = self.graph_capture_after
        if capture_after is None:
            padded_to_buckets = any(isinstance(hook, ShapeBucketsHook) for hook in getattr(runner, "hooks", ()))
            capture_after = 1 if padded_to_buckets else 2
        return CapturePolicy(capture_after=capture_after, max_graphs=self.max_graphs,
                             max_graph_memory_mb=self.max_graph_memory_mb)

    def before_run(self, runner) -> None:
        from deform_plugin.integration.mmdet_fast_paths import apply_fast_paths
        from deform_plugin.ops.msda import prepare_triton_in_background
        if self.precompile_triton:
            from .triton_precompile import precompile_model_kernels
            precompile_model_kernels(runner.model, getattr(runner, "optim_wrapper", None))
        # The one-time host work of the first Triton call, on a thread, while the run initialises its weights and
        # its data loader's workers start (it would otherwise fall in the first iteration).
        prepare_triton_in_background()
        policy = self.capture_policy(runner) if self.switches["cuda_graphs"] else None
        changed = apply_fast_paths(runner.model, **self.switches,
                                   split_graphs_at_features=self.split_graphs_at_features,
                                   gradient_slots=self._gradient_slots(runner.model), capture_policy=policy)
        graphs = f"; graphs: {policy}" if policy is not None else ""
        print_log(f"deform_plugin fast paths: {changed or 'none selected'}{graphs}", logger="current")


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


def fast_path_switches_from_config(cfg) -> dict:
    """The switches a config's ``custom_hooks`` give :class:`FastPathsHook` ({} when it has none)."""
    switches = {}
    for hook_cfg in cfg.get("custom_hooks", None) or []:
        if hook_cfg.get("type") in ("FastPathsHook", FastPathsHook):
            switches.update({k: None if v is None else bool(v) for k, v in hook_cfg.items()
                             if k not in ("type", "priority")})
    return switches


def training_size_divisor_from_config(cfg) -> Optional[int]:
    """The ``size_divisor`` of a config's :class:`ShapeBucketsHook` (None when it has none)."""
    for hook_cfg in cfg.get("custom_hooks", None) or []:
        if hook_cfg.get("type") in ("ShapeBucketsHook", ShapeBucketsHook):
            return int(hook_cfg.get("size_divisor", 128))
    return None


@HOOKS.register_module()
class DeferredRuntimeInfoHook(RuntimeInfoHook):
    """mmengine's ``RuntimeInfoHook`` that hands the losses to the message hub once per logging interval.

    The stock hook calls ``.item()`` on every loss every iteration. This one keeps them (and the gradient norm of a
    ``SyncFree*OptimWrapper``) on the device and copies them in one transfer right before the ``LoggerHook`` of the
    same run reads them: at its interval, at the end of an epoch and at the end of training. The logged values are
    the same; between logging iterations the hub's ``train/*`` scalars lag behind. Select it in a config with::

        default_hooks = dict(runtime_info=dict(type='DeferredRuntimeInfoHook'))

    Args:
        interval (int, optional): Flush every this many iterations; None takes the run's ``LoggerHook`` interval.
    """

    def __init__(self, interval: Optional[int] = None):
        super().__init__()
        self.interval = interval

    def before_train(self, runner) -> None:
        super().before_train(runner)
        if self.interval is None:
            loggers = [hook for hook in runner.hooks if isinstance(hook, LoggerHook)]
            self.interval = loggers[0].interval if loggers else 1
        DEFERRED_SCALARS.active = True

    def after_train_iter(self, runner, batch_idx: int, data_batch=None, outputs: Optional[dict] = None) -> None:
        DEFERRED_SCALARS.end_iteration(outputs)
        if (self.every_n_train_iters(runner, self.interval) or self.end_of_epoch(runner.train_dataloader, batch_idx)
                or self.is_last_train_iter(runner)):
            DEFERRED_SCALARS.flush(runner.message_hub)

    def after_train(self, runner) -> None:
        DEFERRED_SCALARS.flush(runner.message_hub)
        DEFERRED_SCALARS.active = False
