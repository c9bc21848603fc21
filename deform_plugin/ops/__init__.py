"""Operators of deform_plugin. They import torch and triton only: tensors in, tensors out."""
from .backend import backend_names, default_backend, get_default_backend, register_backend, set_default_backend
from .deform_sdpa import deform_sdpa, deform_sdpa_reference
from .msda import (fused_multi_scale_deformable_attn, multi_scale_deformable_attn,
                   multi_scale_deformable_attn_reference)
from .nms import greedy_nms_first_kept, greedy_nms_first_kept_reference

__all__ = [
    "backend_names",
    "default_backend",
    "deform_sdpa",
    "deform_sdpa_reference",
    "fused_multi_scale_deformable_attn",
    "get_default_backend",
    "greedy_nms_first_kept",
    "greedy_nms_first_kept_reference",
    "multi_scale_deformable_attn",
    "multi_scale_deformable_attn_reference",
    "register_backend",
    "set_default_backend",
]
