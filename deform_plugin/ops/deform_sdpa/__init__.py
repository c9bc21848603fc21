"""Multi-view deformable scaled dot-product attention: reference, fused Triton kernels and the entry point."""
from .checks import check_deform_sdpa_inputs
from .functional import deform_sdpa
from .reference import deform_sdpa_reference

__all__ = ["check_deform_sdpa_inputs", "deform_sdpa", "deform_sdpa_reference"]
