"""``FastPathsHook``: the model's exact fast paths, switched on before a run starts (``custom_hooks``)."""
from __future__ import annotations

from mmengine.hooks import Hook
from mmengine.logging import print_log
from mmengine.registry import HOOKS


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
    """

    priority = "VERY_HIGH"

    def __init__(self, **switches):
        from deform_plugin.integration.mmdet_fast_paths import FastPaths
        self.fast_paths = FastPaths.from_dict(switches)

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

    def before_run(self, runner) -> None:
        from deform_plugin.integration.mmdet_fast_paths import apply_fast_paths
        from deform_plugin.ops.msda import prepare_triton_in_background
        # The one-time host work of the first Triton call, on a thread, while the run initialises its weights and
        # its data loader's workers start (it would otherwise fall in the first iteration).
        prepare_triton_in_background()
        changed = apply_fast_paths(runner.model, self.fast_paths, gradient_slots=self._gradient_slots(runner.model))
        print_log(f"deform_plugin fast paths: {changed or 'none selected'}", logger="current")


def fast_path_switches_from_config(cfg) -> dict:
    """The switches a config's ``custom_hooks`` give :class:`FastPathsHook`, as they are set there ({} when it has
    none); a key that is no switch is refused."""
    from deform_plugin.integration.mmdet_fast_paths import FastPaths
    switches = {}
    for hook_cfg in cfg.get("custom_hooks", None) or []:
        if hook_cfg.get("type") in ("FastPathsHook", FastPathsHook):
            switches.update({k: None if v is None else bool(v) for k, v in hook_cfg.items()
                             if k not in ("type", "priority")})
    FastPaths.from_dict(switches)
    return switches
