"""A hook that turns on the exact fast paths of ``deform_plugin.integration.mmdet_fast_paths`` for a Runner's model."""
from __future__ import annotations

from mmengine.hooks import Hook
from mmengine.logging import print_log
from mmengine.registry import HOOKS


@HOOKS.register_module()
class FastPathsHook(Hook):
    """Switch the model to deform_plugin's exact fast paths before training, validation or testing starts.

    Add to a config::

        custom_hooks = [dict(type='FastPathsHook', sdpa_attention=True, hungarian_host_syncs=True)]

    Each switch is off unless set. The switches change classes/methods of existing objects only (no new
    parameters), so checkpoints stay interchangeable with stock runs.

    Args:
        sdpa_attention (bool): mmcv ``MultiheadAttention`` bricks run PyTorch SDPA (``need_weights=False``).
        hungarian_host_syncs (bool): ``HungarianAssigner.assign`` builds its result on the host and copies it once,
            without blocking; DETR-family heads take their positive/negative query indices from that host copy
            instead of two ``nonzero()`` syncs.
    """

    priority = "VERY_HIGH"

    def __init__(self, sdpa_attention: bool = False, hungarian_host_syncs: bool = False):
        self.switches = dict(sdpa_attention=bool(sdpa_attention), hungarian_host_syncs=bool(hungarian_host_syncs))

    def before_run(self, runner) -> None:
        from deform_plugin.integration.mmdet_fast_paths import apply_fast_paths
        changed = apply_fast_paths(runner.model, **self.switches)
        print_log(f"deform_plugin fast paths: {changed or 'none selected'}", logger="current")


def fast_path_switches_from_config(cfg) -> dict:
    """The switches a config's ``custom_hooks`` give :class:`FastPathsHook` ({} when it has none)."""
    switches = {}
    for hook_cfg in cfg.get("custom_hooks", None) or []:
        if hook_cfg.get("type") in ("FastPathsHook", FastPathsHook):
            switches.update({k: bool(v) for k, v in hook_cfg.items() if k not in ("type", "priority")})
    return switches
