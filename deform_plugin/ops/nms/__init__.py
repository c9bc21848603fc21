"""Greedy non-maximum suppression with fixed-shape outputs: reference, Triton kernel and the entry point."""
from .checks import check_greedy_nms_inputs
from .functional import greedy_nms_first_kept
from .reference import greedy_nms_first_kept_reference

__all__ = ["check_greedy_nms_inputs", "greedy_nms_first_kept", "greedy_nms_first_kept_reference"]
