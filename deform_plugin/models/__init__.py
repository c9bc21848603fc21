"""MMEngine-registered modules. They call deform_plugin.ops and know nothing of Triton or of mmdet internals."""
from .deform_sdpa import DeformableSDPAttention, MultiViewDeformSDPAFusion
from .msda import MultiScaleDeformableAttention

__all__ = ["DeformableSDPAttention", "MultiScaleDeformableAttention", "MultiViewDeformSDPAFusion"]
