"""Operators of deform_plugin. They know nothing of mmdet: tensors in, tensors out."""
from .backend import BACKENDS, default_backend, get_default_backend, set_default_backend
from .deform_sdpa import deform_sdpa, deform_sdpa_reference
from .msda import (fused_multi_scale_deformable_attn, multi_scale_deformable_attn,
                   multi_scale_deformable_attn_reference)

__all__ = [
    "BACKENDS",
    "default_backend",
    "deform_sdpa",
    "deform_sdpa_reference",
    "fused_multi_scale_deformable_attn",
    "get_default_backend",
    "multi_scale_deformable_attn",
    "multi_scale_deformable_attn_reference",
    "set_default_backend",
]
