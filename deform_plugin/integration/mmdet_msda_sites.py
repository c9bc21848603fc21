"""Put deform_plugin's MSDA wherever mmdet 3.x builds mmcv's ``MultiScaleDeformableAttention``.

mmdet does not build MSDA through the registry: its layer classes call the class by name, imported into their own
module namespace (``from mmcv.ops import MultiScaleDeformableAttention``). Those module globals are the construction
sites; we rebind each of them to our subclass. The detectors' ``init_weights`` (``isinstance(m, mmcv's MSDA)``) keeps
working because ours is a subclass, so those references are left alone.
"""
from __future__ import annotations

from .import_hooks import patch_when_imported

# Every mmdet 3.3 module that constructs MSDA by class name (found by grepping mmdet for
# ``MultiScaleDeformableAttention(``). Mask2Former, DINO and DDQ reach it through deformable_detr_layers.
MSDA_CONSTRUCTION_SITES = (
    "mmdet.models.layers.transformer.deformable_detr_layers",
    "mmdet.models.layers.transformer.grounding_dino_layers",
)
MSDA_GLOBAL_NAME = "MultiScaleDeformableAttention"


def _rebind_msda(module) -> None:
    from deform_plugin.models.msda import MultiScaleDeformableAttention as PluginMSDA
    if getattr(module, MSDA_GLOBAL_NAME, None) is not None:
        setattr(module, MSDA_GLOBAL_NAME, PluginMSDA)


def install_msda_construction_sites() -> None:
    """Rebind mmdet's MSDA construction sites to our module: now where imported, else on import."""
    for name in MSDA_CONSTRUCTION_SITES:
        patch_when_imported(name, _rebind_msda)
