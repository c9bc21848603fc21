"""``FastPathsHook``: the model's exact fast paths, switched on before a run starts (``custom_hooks``)."""
from __future__ import annotations

import inspect
from typing import Optional

from mmengine.hooks import Hook
from mmengine.logging import print_log
from mmengine.registry import HOOKS

from .shape_buckets_hook import ShapeBucketsHook


@HOOKS.register_module()
class FastPathsHook(Hook):
    """Switch the model to deform_plugin's exact fast paths before training, validation or testing starts.

    Add to a config::

        custom_hooks = [dict(type='FastPathsHook', sdpa_attention=True, batched_matching=True,
                             sync_free_losses=True)]

    The keys are the fields of :class:`~deform_plugin.integration.mmdet_fast_paths.FastPaths`, which says what each
    switch does; each is off unless set, and an unknown key is refused with the valid ones. The switches change
    classes/methods of existing objects only (no new parameters), so checkpoints stay interchangeable with stock
    runs. With ``cuda_graphs``, unwrapped models or those under ``FlatGradientsDataParallel`` get their gradients
    written into the parameters' slots (:mod:`deform_plugin.engine.data_parallel`).

    Args:
        graph_capture_after (int, optional): with ``cuda_graphs``, the call at which an input shape is captured
            (``CapturePolicy.capture_after``). None (the default): 1 where the run's batch shapes recur by
            construction (padded with :class:`ShapeBucketsHook`, or to one size by mmdet's ``BatchFixedSizePad``
            as in Mask2Former's LSJ configs: a new shape is captured at its first call), else 2 (a random-resize
            pipeline's shapes rarely recur: a shape seen once runs eagerly).
        max_graphs (int): with ``cuda_graphs``, input shapes captured at most; later new shapes run eagerly.
        max_graph_memory_mb (float, optional): with ``cuda_graphs``, the device memory the captures may add, MiB.
        precompile_triton (bool): compile the model's Triton MSDA kernels while the run starts, one worker process
            per kernel variant, whose first launch then waits for its worker (default True; see
            :mod:`deform_plugin.ops.background_compile`). Started at ``before_run``, or earlier by our
            ``tools/train.py`` (:func:`~deform_plugin.engine.triton_precompile.precompile_runner_kernels`).
        cudnn_v7_api (bool, optional): choose convolution algorithms through cuDNN's v7 API, whose choice for a
            new input shape costs less host time, though its choices run slower once made
            (:mod:`deform_plugin.conv_planning` gives both figures; in bfloat16 the v7 API means PyTorch's own
            convolution kernels, not cuDNN's). None (the default): on for a model on CUDA in a run whose batch
            shapes do not recur by construction (nearly every batch is a new shape), off where they do (see
            ``graph_capture_after``). Takes effect when the process's first convolution comes after this hook's
            ``before_run``, as under ``tools/train.py``; ``TORCH_CUDNN_V8_API_DISABLED`` set by the user wins.
        **switches: the fast paths (fields of ``FastPaths``).
    """

    priority = "VERY_HIGH"

    def __init__(self, graph_capture_after: Optional[int] = None, max_graphs: int = 64,
                 max_graph_memory_mb: Optional[float] = None, precompile_triton: bool = True,
                 cudnn_v7_api: Optional[bool] = None, **switches):
        from deform_plugin.cuda_graphs import CapturePolicy
        from deform_plugin.integration.mmdet_fast_paths import FastPaths

        self.fast_paths = FastPaths.from_dict(switches)
        # Checked now, so that a bad value fails when the config is built.
        CapturePolicy(capture_after=graph_capture_after or 1, max_graphs=max_graphs,
                      max_graph_memory_mb=max_graph_memory_mb)
        self.graph_capture_after = graph_capture_after
        self.max_graphs = max_graphs
        self.max_graph_memory_mb = max_graph_memory_mb
        self.precompile_triton = bool(precompile_triton)
        self.cudnn_v7_api = None if cudnn_v7_api is None else bool(cudnn_v7_api)

    def _gradient_slots(self, model):
        """Where the graphed regions write the gradients: the wrapper's slots under
        :class:`~deform_plugin.engine.data_parallel.FlatGradientsDataParallel`, new slots for an unwrapped model,
        none under another wrapper (DistributedDataParallel's reducer needs autograd's accumulation) or off CUDA."""
        from mmengine.model import is_model_wrapper

        from .data_parallel import ParameterGradientSlots
        if not self.fast_paths.cuda_graphs:
            return None
        if is_model_wrapper(model):
            return getattr(model, "gradient_slots", None)
        if not any(parameter.is_cuda for parameter in model.parameters()):
            return None  # no graphs off CUDA: the regions run eagerly
        return ParameterGradientSlots(model.parameters())

    @staticmethod
    def _padded_to_buckets(runner) -> bool:
        return any(isinstance(hook, ShapeBucketsHook) for hook in getattr(runner, "hooks", ()))

    @staticmethod
    def _padded_to_one_size(model) -> bool:
        """Whether the model's data preprocessor pads every training batch to one size: mmdet's
        ``BatchFixedSizePad`` among its batch augments, after a pipeline that crops to at most that size (the LSJ
        configs of Mask2Former)."""
        from mmdet.models.data_preprocessors import BatchFixedSizePad
        preprocessor = getattr(getattr(model, "module", model), "data_preprocessor", None)
        return any(isinstance(augment, BatchFixedSizePad)
                   for augment in getattr(preprocessor, "batch_augments", None) or ())

    def shapes_recur(self, runner) -> bool:
        """Whether the run's batch shapes recur by construction: padded to buckets or to one size."""
        return self._padded_to_buckets(runner) or self._padded_to_one_size(getattr(runner, "model", None))

    def capture_policy(self, runner):
        """The graphs' capture policy for this run (see ``graph_capture_after``)."""
        from deform_plugin.cuda_graphs import CapturePolicy
        capture_after = self.graph_capture_after
        if capture_after is None:
            capture_after = 1 if self.shapes_recur(runner) else 2
        return CapturePolicy(capture_after=capture_after, max_graphs=self.max_graphs,
                             max_graph_memory_mb=self.max_graph_memory_mb)

    @staticmethod
    def _model_on_cuda(model) -> bool:
        return any(parameter.is_cuda for parameter in model.parameters())

    def run_fast_paths(self, runner):
        """The switches for this run: ``feature_bucket_size`` None becomes 128 px with ``cuda_graphs`` for a model on
        CUDA in a run without :class:`ShapeBucketsHook` (its batch shapes rarely recur, the feature buckets' do), 0
        (off) elsewhere (off CUDA the regions run eagerly: padding would only add work)."""
        import dataclasses

        from deform_plugin.cuda_graphs import DEFAULT_FEATURE_BUCKET_SIZE
        paths = self.fast_paths
        if paths.feature_bucket_size is None:
            size = DEFAULT_FEATURE_BUCKET_SIZE if (paths.cuda_graphs and not self._padded_to_buckets(runner)
                           and self._model_on_cuda(runner.model)) else 0
            paths = dataclasses.replace(paths, feature_bucket_size=size)
        return paths

    def before_run(self, runner) -> None:
        from deform_plugin.integration.mmdet_fast_paths import apply_fast_paths
        from deform_plugin.ops.msda import prepare_triton_in_background
        cudnn_v7_api = self.cudnn_v7_api
        if cudnn_v7_api is None:  # cuDNN matters only to a model on CUDA
            cudnn_v7_api = self._model_on_cuda(runner.model) and not self.shapes_recur(runner)
        if cudnn_v7_api:
            from deform_plugin.conv_planning import prefer_cudnn_v7_api, selected_api_line
            if not prefer_cudnn_v7_api():
                print_log(f"deform_plugin: cudnn_v7_api is on, but the environment keeps {selected_api_line()}",
                          logger="current")
        if self.precompile_triton:
            from .triton_precompile import precompile_model_kernels
            precompile_model_kernels(runner.model, getattr(runner, "optim_wrapper", None))
        # The one-time host work of the first Triton call, on a thread, while the run initialises its weights and
        # its data loader's workers start (it would otherwise fall in the first iteration).
        prepare_triton_in_background()
        policy = self.capture_policy(runner) if self.fast_paths.cuda_graphs else None
        changed = apply_fast_paths(runner.model, self.run_fast_paths(runner),
                                   gradient_slots=self._gradient_slots(runner.model), capture_policy=policy)
        graphs = f"; graphs: {policy}" if policy is not None else ""
        print_log(f"deform_plugin fast paths: {changed or 'none selected'}{graphs}", logger="current")


# The hook's own options, beside the switches.
HOOK_OPTIONS = tuple(name for name, parameter in inspect.signature(FastPathsHook.__init__).parameters.items()
                     if name != "self" and parameter.kind is not inspect.Parameter.VAR_KEYWORD)


def fast_paths_hook_entries(cfg) -> list:
    """The config's ``custom_hooks`` entries that build a :class:`FastPathsHook` (named or given as the class)."""
    return [hook_cfg for hook_cfg in cfg.get("custom_hooks", None) or [] if hook_cfg.get("type") in (
        "FastPathsHook", FastPathsHook)]


def set_cudnn_api_in_config(cfg, v7: bool) -> int:
    """Set ``cudnn_v7_api`` of the config's :class:`FastPathsHook` entries (``tools/train.py --cudnn-api``), so that
    the hook's choice agrees with the API the tool selected for the process; returns how many it set."""
    entries = fast_paths_hook_entries(cfg)
    for hook_cfg in entries:
        hook_cfg["cudnn_v7_api"] = bool(v7)
    return len(entries)


def fast_path_switches_from_config(cfg) -> dict:
    """The switches a config's ``custom_hooks`` give :class:`FastPathsHook`, as they are set there ({} when it has
    none; the hook's own options are left out); a key that is neither is refused."""
    from deform_plugin.integration.mmdet_fast_paths import FastPaths
    switches = {}
    for hook_cfg in fast_paths_hook_entries(cfg):
        switches.update({k: v for k, v in hook_cfg.items() if k not in ("type", "priority") + HOOK_OPTIONS})
    paths = FastPaths.from_dict(switches)  # checks the names and values, and normalises them (1 -> True)
    return {name: getattr(paths, name) for name in switches}
