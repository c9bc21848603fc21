"""Training throughput measured inside mmengine's own loop: an ``IterationTimerHook`` for ``custom_hooks``.

The hook adds no host synchronisation to an ordinary iteration. It synchronises the device (where there is one)
and reads the clock only at window boundaries: once in ``before_train`` (after every other hook's, so the first
window counts worker start-up and the first batch, as a user waits for them), and after the iterations that end a
window or precede one. A window ``(a, b)`` (1-based, inclusive) spans from the end of iteration ``a - 1`` (for
``a = 1``, the start of training) to the end of iteration ``b``, every hook of those iterations included.

Where ``deform_plugin`` is already imported (never imported from here), it also records how many Triton kernel
variants our ops have compiled: after ``warmup_iters`` iterations and at the end. It counts the distinct padded
input shapes of the batches (each new one costs cuDNN/cuBLAS plan selection) and the pixels computed against the
images' own.

It also keeps each iteration's end on the host clock (read without a device sync: a step's own syncs, such as
the fast paths' one copy for matching, keep the host within about an iteration of the device) and, for graphed
training, what the iteration ran: ``eager`` (a new shape's warm-up), ``capture`` or ``replay``. The report splits
the first iterations' time by those kinds: where a slow start goes.

Under a model wrapper that times its steps (``FlatGradientsDataParallel``, through ``enable_step_times``; found
by that method's name, so that a stock run needs nothing of deform_plugin), the hook turns that on before training
and, at its end, gathers every rank's per-step compute, all-reduce and step milliseconds to rank 0
(``data_parallel_steps``; see :mod:`.rank_steps` for what the report makes of them).

The result goes to a JSON file: ``out_file``, else ``$DEFORM_PLUGIN_TIMING_JSON``, else
``<work_dir>/iteration_timing.json``. Usable from any config (a stock run imports it without deform_plugin through
:mod:`deform_plugin.benchmarks.stock_process`)::

    custom_imports = dict(imports=['deform_plugin.benchmarks.detector.iteration_timer'], allow_failed_imports=False)
    custom_hooks = [dict(type='IterationTimerHook', windows=[(1, 20), (1, 100), (51, 100)])]
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from mmengine.dist import all_gather_object, get_world_size, is_main_process
from mmengine.hooks import Hook
from mmengine.logging import print_log
from mmengine.registry import HOOKS

from deform_plugin.benchmarks.stock_process import plugin_imported

TIMING_FILE_ENV = "DEFORM_PLUGIN_TIMING_JSON"
DEFAULT_WINDOWS = ((1, 20), (1, 100), (51, 100))


def validate_windows(windows: Sequence[Sequence[int]]) -> List[Tuple[int, int]]:
    """Windows as ``(first, last)`` int pairs, 1-based and inclusive; a ValueError names any bad one."""
    checked = []
    for window in windows:
        if len(window) != 2 or not all(isinstance(v, int) for v in window) or not 1 <= window[0] <= window[1]:
            raise ValueError(f"window {window!r} is not (first, last) iterations with 1 <= first <= last")
        checked.append((int(window[0]), int(window[1])))
    if not checked:
        raise ValueError("at least one window is needed")
    return checked


def images_in_batch(data_batch) -> int:
    """How many images a batch from mmengine's collate holds (``dict(inputs=[...], ...)``)."""
    inputs = data_batch.get("inputs") if isinstance(data_batch, dict) else data_batch
    if isinstance(inputs, torch.Tensor):
        return int(inputs.shape[0])
    if isinstance(inputs, (list, tuple)):
        return len(inputs)
    raise TypeError(f"cannot count the images of a batch of type {type(data_batch).__name__}: expected "
                    "mmengine's dict(inputs=list or tensor, ...)")


def padded_batch_shape(data_batch, size_divisor: int, fixed_size: Optional[Tuple[int, int]] = None
                       ) -> Optional[Tuple[Tuple[int, int], int, int]]:
    """((height, width) the data preprocessor pads the batch to, padded pixels, image pixels), or None.

    mmengine's ``ImgDataPreprocessor`` pads a list of CHW images to the largest height and width, rounded up to
    ``size_divisor``; a ``fixed_size`` (mmdet's ``BatchFixedSizePad`` batch augment, as in Mask2Former's LSJ configs)
    then pads each side up to at least its size.
    """
    inputs = data_batch.get("inputs") if isinstance(data_batch, dict) else None
    if not isinstance(inputs, (list, tuple)) or not inputs or not all(
            isinstance(i, torch.Tensor) and i.dim() == 3 for i in inputs):
        return None
    heights = [int(i.shape[-2]) for i in inputs]
    widths = [int(i.shape[-1]) for i in inputs]
    divisor = max(int(size_divisor), 1)
    shape = (-(-max(heights) // divisor) * divisor, -(-max(widths) // divisor) * divisor)
    if fixed_size is not None:
        shape = (max(shape[0], int(fixed_size[0])), max(shape[1], int(fixed_size[1])))
    return shape, len(inputs) * shape[0] * shape[1], sum(h * w for h, w in zip(heights, widths))


def fixed_pad_size(preprocessor) -> Optional[Tuple[int, int]]:
    """The size of mmdet's ``BatchFixedSizePad`` among the preprocessor's batch augments, or None."""
    for augment in getattr(preprocessor, "batch_augments", None) or ():
        if type(augment).__name__ == "BatchFixedSizePad":
            return tuple(augment.size)
    return None


def _graphed_regions(model) -> list:
    """The graphed training regions of ``model`` (empty without graphed training)."""
    regions = []
    for module in (model.modules() if model is not None else ()):
        if getattr(module, "graphed_training_region", None) is not None:
            regions.extend(getattr(module, "graphed_training_regions", None) or (module.graphed_training_region,))
    return regions


def _graphed_training_stats(model=None, regions=None) -> Optional[dict]:
    """What the graph-replayed training did (captures, their host seconds and where those went, eager calls,
    replays, captures made at a shape's first call and those that failed there), summed over the model's graphed
    regions (or the ``regions`` given); None without any. Host seconds count every region; the counts only those
    that report signatures (a region that always runs beside another, such as a detector's separately graphed
    backbone, would count each shape twice)."""
    regions = _graphed_regions(model) if regions is None else regions
    if not regions:
        return None
    phases: Dict[str, float] = {}
    for region in regions:
        for phase, seconds in region.capture_phase_seconds.items():
            phases[phase] = phases.get(phase, 0.0) + seconds
    counted = [region for region in regions if getattr(region, "reports_signatures", True)]
    return dict(captures=sum(len(region.captured) for region in counted),
                capture_seconds=sum(region.capture_seconds for region in regions),
                capture_phase_seconds=phases,
                eager_calls=sum(region.eager_calls for region in counted),
                replays=sum(region.replays for region in counted),
                fallbacks=sum(len(region.eager_reasons) for region in regions),
                first_call_captures=sum(region.first_call_captures for region in counted),
                first_call_capture_failures=sum(len(region.first_call_capture_failures) for region in regions))


def compiled_variants_if_loaded() -> Optional[Dict[str, int]]:
    """Compiled Triton variants per deform_plugin kernel, or None where deform_plugin is not imported."""
    if not plugin_imported():
        return None
    from deform_plugin.ops.compile_stats import compiled_variants
    return compiled_variants()


def mmcv_ext_kind() -> str:
    """What serves mmcv's compiled ops in this process: compiled, a stand-in, a placeholder, or nothing yet."""
    module = sys.modules.get("mmcv._ext")
    if module is None:
        return "not loaded"
    if getattr(module, "__deform_plugin_standin__", False):
        return "deform_plugin stand-in (mmcv-lite)"
    spec = getattr(module, "__spec__", None)
    if spec is None or spec.loader is None:
        return "placeholder without ops (mmcv-lite)"
    return "compiled"


@HOOKS.register_module()
class IterationTimerHook(Hook):
    """Images per second over windows of training iterations, with device syncs at window boundaries only.

    Args:
        windows: ``(first, last)`` iteration pairs, 1-based and inclusive. A window the run does not reach is
            reported with ``img_per_s=None``.
        warmup_iters: after this iteration, the compiled-kernel count is read (no sync: compiling is host work);
            new compiles after it show kernels that recompile in the steady state.
        out_file: the JSON file to write; ``None`` uses ``$DEFORM_PLUGIN_TIMING_JSON`` or the work dir.
        expect_plugin: ``False`` fails the run if deform_plugin was imported (a stock run must stay stock);
            ``True`` fails it if deform_plugin was not; ``None`` checks nothing.
        label: a name carried into the JSON (the benchmark row).
        clock: seconds as a float; ``time.perf_counter`` unless a test passes its own.
    """

    priority = "VERY_LOW"  # last among the hooks of an iteration, so a window holds all of their work

    def __init__(self, windows: Sequence[Sequence[int]] = DEFAULT_WINDOWS, warmup_iters: int = 20,
                 out_file: Optional[str] = None, expect_plugin: Optional[bool] = None, label: Optional[str] = None,
                 clock: Optional[Callable[[], float]] = None) -> None:
        self.windows = validate_windows(windows)
        self.warmup_iters = int(warmup_iters)
        self.out_file = out_file
        self.expect_plugin = expect_plugin
        self.label = label
        self.clock = clock or time.perf_counter
        self.boundaries = sorted({first - 1 for first, _ in self.windows} | {last for _, last in self.windows})
        self._boundary_set = frozenset(self.boundaries)
        self._reset()

    def _reset(self) -> None:
        self._uses_cuda = False
        self._images = 0
        self._last_iter = 0
        self._marks: Dict[int, Tuple[float, int]] = {}  # iteration -> (clock, images so far)
        self._compiles_after_warmup: Optional[Dict[str, int]] = None
        self._peak_allocated = 0
        self._peak_reserved = 0
        self._shapes: set = set()
        self._iteration_shapes: List[Optional[list]] = []
        self._iteration_run_shapes: List[Optional[list]] = []
        self._shapes_after_warmup = 0
        self._padded_pixels = 0
        self._image_pixels = 0
        self._iteration_ends: List[float] = []
        self._iteration_kinds: List[Optional[str]] = []
        self._iteration_reserved_mib: List[Optional[float]] = []
        self._iteration_graphs: List[Optional[int]] = []
        # Iterations whose loss was NaN or inf: a tensor loss counted on its device (read once, at the summary: no
        # sync per step), a float one here.
        self._nonfinite_losses = None
        self._nonfinite_float_losses = 0
        self._checked_losses = 0
        self._graph_counters: Optional[Tuple[int, int, int]] = None
        self._regions: Optional[list] = None  # found at the first iteration's end (hooks set them up before)
        self._step_times = None  # the model wrapper's per-step times, where it keeps them

    def _check_plugin(self, when: str) -> None:
        loaded = plugin_imported()
        if self.expect_plugin is False and loaded:
            raise RuntimeError(f"deform_plugin was imported {when} in a run that must stay stock mmdet/mmcv")
        if self.expect_plugin is True and not loaded:
            raise RuntimeError(f"deform_plugin was not imported {when} in a run that should use it")

    def _mark(self, iteration: int) -> None:
        if self._uses_cuda:
            torch.cuda.synchronize()
        self._marks[iteration] = (self.clock(), self._images)

    def before_train(self, runner) -> None:
        self._check_plugin("before training")
        if runner.iter != 0:
            raise RuntimeError(f"IterationTimerHook times runs from iteration 0; this one resumes at {runner.iter}")
        self._reset()
        self._uses_cuda = torch.cuda.is_available()
        if self._uses_cuda:
            torch.cuda.reset_peak_memory_stats()
        enable_step_times = getattr(runner.model, "enable_step_times", None)
        self._step_times = enable_step_times() if callable(enable_step_times) else None
        self._mark(0)

    def after_train_iter(self, runner, batch_idx: int, data_batch=None, outputs=None) -> None:
        iteration = batch_idx + 1
        # Under DDP every rank trains a batch of the same size per iteration: the run's images are world-size times
        # this rank's.
        self._images += images_in_batch(data_batch) * get_world_size()
        self._last_iter = iteration
        if self._uses_cuda:
            # mmengine's log processor resets the peak statistics at every logging iteration: keep our own maximum,
            # read after each iteration (allocator statistics, no device sync).
            self._peak_allocated = max(self._peak_allocated, torch.cuda.max_memory_allocated())
            self._peak_reserved = max(self._peak_reserved, torch.cuda.max_memory_reserved())
        model = getattr(runner.model, "module", runner.model)
        preprocessor = getattr(model, "data_preprocessor", None)
        padded = padded_batch_shape(data_batch, getattr(preprocessor, "pad_size_divisor", 1),
                                    fixed_pad_size(preprocessor))
        # ShapeBucketsHook may pad further (the ranks' common shape, a borrowed shape): the shape the batch ran at.
        ran_at = getattr(preprocessor, "deform_plugin_training_shape", None)
        self._iteration_shapes.append(None if padded is None else list(padded[0]))
        self._iteration_run_shapes.append(None if ran_at is None else list(ran_at))
        if padded is not None:
            shape, padded_pixels, image_pixels = padded
            if ran_at is not None:
                padded_pixels = images_in_batch(data_batch) * int(ran_at[0]) * int(ran_at[1])
            if shape not in self._shapes and iteration > self.warmup_iters:
                self._shapes_after_warmup += 1
            self._shapes.add(shape)
            self._padded_pixels += padded_pixels
            self._image_pixels += image_pixels
        if iteration in self._boundary_set:
            self._mark(iteration)
        self._iteration_ends.append(self.clock())
        self._iteration_kinds.append(self._graphed_kind(model))
        self._iteration_reserved_mib.append(torch.cuda.memory_reserved() / 2 ** 20 if self._uses_cuda else None)
        self._iteration_graphs.append(None if self._graph_counters is None else self._graph_counters[0])
        self._count_nonfinite_loss(outputs)
        if iteration == self.warmup_iters:
            self._compiles_after_warmup = compiled_variants_if_loaded()

    def _count_nonfinite_loss(self, outputs) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else None
        if isinstance(loss, torch.Tensor):
            bad = (~torch.isfinite(loss.detach())).any().to(torch.int64)
            self._nonfinite_losses = bad if self._nonfinite_losses is None else self._nonfinite_losses + bad
            self._checked_losses += 1
        elif isinstance(loss, (int, float)):
            self._nonfinite_float_losses += not math.isfinite(loss)
            self._checked_losses += 1

    def _graphed_kind(self, model) -> Optional[str]:
        """What the model's graphed regions ran in the iteration that just ended (None without graphed training):
        ``capture`` if one captured, else ``eager`` if one ran eagerly, else ``replay``."""
        if self._regions is None:
            self._regions = _graphed_regions(model)
        stats = _graphed_training_stats(regions=self._regions)
        if stats is None:
            return None
        counters = (stats["captures"], stats["eager_calls"], stats["replays"])
        before = self._graph_counters or (0, 0, 0)
        self._graph_counters = counters
        if counters[0] > before[0]:
            return "capture"
        if counters[1] > before[1]:
            return "eager"
        return "replay" if counters[2] > before[2] else None

    def per_iteration(self) -> List[dict]:
        """Each iteration's host seconds (from the previous iteration's end, the first from training's start), what
        its graphed regions ran, its batch's padded shape (``shape``, the data preprocessor's own padding), the
        shape it ran at (``run_shape``: after ShapeBucketsHook's further padding, where it pads; else None), the
        device memory the caching allocator reserved at its end (``reserved_mib``, CUDA only) and the graphs
        captured so far (``graphs``, graphed training only)."""
        start = self._marks.get(0, (None, 0))[0]
        entries, previous = [], start
        for index, (end, kind, shape, run_shape, reserved, graphs) in enumerate(zip(
                self._iteration_ends, self._iteration_kinds, self._iteration_shapes, self._iteration_run_shapes,
                self._iteration_reserved_mib, self._iteration_graphs)):
            entries.append(dict(iteration=index + 1, seconds=None if previous is None else end - previous,
                                kind=kind, shape=shape, run_shape=run_shape, reserved_mib=reserved, graphs=graphs))
            previous = end
        return entries

    def window_results(self) -> List[dict]:
        """One dict per window: iterations, images, seconds, img/s and ms/iter (None where not reached)."""
        results = []
        for first, last in self.windows:
            start, end = self._marks.get(first - 1), self._marks.get(last)
            entry = dict(first=first, last=last, iterations=last - first + 1, images=None, seconds=None,
                         img_per_s=None, ms_per_iter=None)
            if start is not None and end is not None:
                seconds = end[0] - start[0]
                images = end[1] - start[1]
                entry.update(images=images, seconds=seconds, img_per_s=images / seconds if seconds > 0 else None,
                             ms_per_iter=1000.0 * seconds / entry["iterations"])
            results.append(entry)
        return results

    def data_parallel_steps(self) -> Optional[dict]:
        """Every rank's per-step figures (``ranks``: one list per rank, in rank order, of ``StepTimes.records()``
        dicts) and what timed them, or None where the model wrapper kept none. A collective: every rank calls it
        (every rank's wrapper is of one type, so all of them or none keep figures)."""
        if self._step_times is None:
            return None
        ranks = all_gather_object(self._step_times.records())
        return dict(world_size=len(ranks), clock="cuda events" if self._step_times.uses_events else "host",
                    ranks=ranks)

    def summary(self, runner, data_parallel_steps: Optional[dict] = None) -> dict:
        compiles_end = compiled_variants_if_loaded()
        after_warmup = self._compiles_after_warmup
        optim_wrapper = getattr(runner, "optim_wrapper", None)
        cast_dtype = getattr(optim_wrapper, "cast_dtype", None)
        return dict(
            label=self.label,
            iterations_run=self._last_iter,
            images_run=self._images,
            windows=self.window_results(),
            warmup_iters=self.warmup_iters,
            deform_plugin_loaded=plugin_imported(),
            compiled_variants_after_warmup=after_warmup,
            compiled_variants_end=compiles_end,
            compiled_total=None if compiles_end is None else sum(compiles_end.values()),
            compiled_after_warmup=(None if compiles_end is None or after_warmup is None
                                   else sum(compiles_end.values()) - sum(after_warmup.values())),
            batch_shapes=len(self._shapes),
            batch_shapes_after_warmup=self._shapes_after_warmup,
            padded_over_image_pixels=(self._padded_pixels / self._image_pixels if self._image_pixels else None),
            optim_wrapper=None if optim_wrapper is None else type(optim_wrapper).__name__,
            amp_dtype=None if cast_dtype is None else str(cast_dtype).replace("torch.", ""),
            msda_modules=_msda_module_classes(getattr(runner, "model", None)),
            mmcv_ext=mmcv_ext_kind(),
            torch=torch.__version__,
            device="cuda" if self._uses_cuda else "cpu",
            device_name=torch.cuda.get_device_name() if self._uses_cuda else "cpu",
            cuda=torch.version.cuda if self._uses_cuda else None,
            peak_allocated_mib=self._peak_allocated / 2 ** 20 if self._uses_cuda else None,
            peak_reserved_mib=self._peak_reserved / 2 ** 20 if self._uses_cuda else None,
            graphed_training=_graphed_training_stats(getattr(runner, "model", None)),
            per_iteration=self.per_iteration(),
            losses_checked=self._checked_losses,
            nonfinite_losses=(None if not self._checked_losses else self._nonfinite_float_losses
                              + (0 if self._nonfinite_losses is None else int(self._nonfinite_losses))),
            data_parallel_steps=data_parallel_steps,
        )

    def output_path(self, runner) -> Path:
        named = self.out_file or os.environ.get(TIMING_FILE_ENV)
        return Path(named) if named else Path(runner.work_dir) / "iteration_timing.json"

    def after_train(self, runner) -> None:
        self._check_plugin("after training")
        result = self.summary(runner, self.data_parallel_steps())
        if is_main_process():
            path = self.output_path(runner)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(result, indent=2))
            print_log(f"IterationTimerHook: wrote {path}", logger="current")
        for window in result["windows"]:
            if window["img_per_s"] is not None:
                print_log(f"IterationTimerHook: iterations {window['first']}-{window['last']}: "
                          f"{window['img_per_s']:.2f} img/s, {window['ms_per_iter']:.1f} ms/iter", logger="current")


def _msda_module_classes(model) -> Dict[str, int]:
    """How many modules of each multi-scale deformable attention class the model holds (which MSDA ran)."""
    counts: Dict[str, int] = {}
    if model is None:
        return counts
    for module in model.modules():
        cls = type(module)
        if "MultiScaleDeformableAttention" in cls.__name__:
            name = f"{cls.__module__}.{cls.__qualname__}"
            counts[name] = counts.get(name, 0) + 1
    return counts
