"""Put deform_plugin's MSDA wherever mmdet 3.x builds mmcv's ``MultiScaleDeformableAttention``.

mmdet does not build MSDA through the registry: its layer classes call the class by name, imported into their own
module namespace (``from mmcv.ops import MultiScaleDeformableAttention``). Those module globals are the construction
sites; we rebind each of them to our subclass. The detectors' ``init_weights`` (``isinstance(m, mmcv's MSDA)``) keeps
working because ours is a subclass, so those references are left alone.

The same mechanism carries one fix that the DETR family needs for bf16 AMP: mmdet's ``FocalLoss`` sends CUDA
tensors to mmcv's compiled ``sigmoid_focal_loss``, which has no bf16 kernel ("not implemented for 'BFloat16'"); bf16
logits are passed to it in float32 instead (exact: the conversion is lossless). fp32 and fp16 calls are untouched.

Each patch is applied when its module is imported, or at once if it already is: importing ``deform_plugin`` does
not import mmdet by itself. Nothing changes in a process that never imports deform_plugin.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
from typing import Callable, Dict

import torch

# Every mmdet 3.3 module that constructs MSDA by class name (found by grepping mmdet for
# ``MultiScaleDeformableAttention(``). Mask2Former, DINO and DDQ reach it through deformable_detr_layers.
MSDA_CONSTRUCTION_SITES = (
    "mmdet.models.layers.transformer.deformable_detr_layers",
    "mmdet.models.layers.transformer.grounding_dino_layers",
)
MSDA_GLOBAL_NAME = "MultiScaleDeformableAttention"


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """A meta-path finder that runs a patch function right after a target module executes."""

    def __init__(self, patches: Dict[str, Callable]):
        self.patches = patches
        self._busy = threading.local()

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.patches or getattr(self._busy, "active", False):
            return None
        self._busy.active = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.active = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        original_exec = spec.loader.exec_module
        patch = self.patches[fullname]

        def exec_then_patch(module):
            original_exec(module)
            patch(module)

        spec.loader.exec_module = exec_then_patch
        return spec


def _rebind_msda(module) -> None:
    from deform_plugin.models.msda import MultiScaleDeformableAttention as PluginMSDA
    if getattr(module, MSDA_GLOBAL_NAME, None) is not None:
        setattr(module, MSDA_GLOBAL_NAME, PluginMSDA)


FOCAL_LOSS_MODULE = "mmdet.models.losses.focal_loss"
FOCAL_LOSS_GLOBAL_NAME = "_sigmoid_focal_loss"  # mmcv's SigmoidFocalLossFunction.apply, as mmdet imported it


def _sigmoid_focal_loss_accepting_bf16(compiled_focal_loss: Callable) -> Callable:
    def sigmoid_focal_loss(input, *args, **kwargs):
        if input.dtype == torch.bfloat16:
            input = input.float()
        return compiled_focal_loss(input, *args, **kwargs)

    sigmoid_focal_loss.wrapped_by_deform_plugin = compiled_focal_loss
    return sigmoid_focal_loss


def _let_focal_loss_take_bf16(module) -> None:
    current = getattr(module, FOCAL_LOSS_GLOBAL_NAME, None)
    if current is not None and not hasattr(current, "wrapped_by_deform_plugin"):
        setattr(module, FOCAL_LOSS_GLOBAL_NAME, _sigmoid_focal_loss_accepting_bf16(current))


_finder = None


def install_msda_swap() -> None:
    """Apply the mmdet patches (MSDA construction sites, bf16 focal loss): now where imported, else on import."""
    global _finder
    patches = {name: _rebind_msda for name in MSDA_CONSTRUCTION_SITES}
    patches[FOCAL_LOSS_MODULE] = _let_focal_loss_take_bf16
    pending = {}
    for name, patch in patches.items():
        if name in sys.modules:
            patch(sys.modules[name])
        else:
            pending[name] = patch
    if pending and _finder is None:
        _finder = _PatchAfterImport(pending)
        sys.meta_path.insert(0, _finder)


def swapped_sites() -> Dict[str, bool]:
    """For each construction site that is imported, whether it now builds our module (for tests and diagnostics)."""
    from deform_plugin.models.msda import MultiScaleDeformableAttention as PluginMSDA
    return {name: getattr(sys.modules[name], MSDA_GLOBAL_NAME, None) is PluginMSDA
            for name in MSDA_CONSTRUCTION_SITES if name in sys.modules}
