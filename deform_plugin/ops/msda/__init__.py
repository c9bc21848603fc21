"""Multi-scale deformable attention (MSDA): reference, Triton kernels and the functional entry points."""
from .checks import check_fused_msda_inputs, check_msda_inputs
from .functional import (fused_multi_scale_deformable_attn, multi_scale_deformable_attn,
                         prepare_first_call_in_background, prepare_triton_in_background)
from .level_tables import host_level_tables, host_spatial_shapes, make_level_tables
from .reference import multi_scale_deformable_attn_reference, sampling_locations_from_offsets

__all__ = [
    "check_fused_msda_inputs",
    "check_msda_inputs",
    "fused_multi_scale_deformable_attn",
    "host_level_tables",
    "host_spatial_shapes",
    "make_level_tables",
    "multi_scale_deformable_attn",
    "multi_scale_deformable_attn_reference",
    "prepare_first_call_in_background",
    "prepare_triton_in_background",
    "sampling_locations_from_offsets",
]
