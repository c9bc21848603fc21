"""MMEngine-registered modules. They call deform_plugin.ops and know nothing of Triton or of mmdet internals."""
from .msda import MultiScaleDeformableAttention

__all__ = ["MultiScaleDeformableAttention"]
