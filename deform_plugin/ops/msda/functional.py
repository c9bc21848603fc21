"""Public entry points of the MSDA op: validate, pick a backend, run it."""
from __future__ import annotations

from typing import Optional

import torch
from torch._C._autograd import _profiler_enabled
from torch.profiler import record_function

from ..backend import registered_backend, resolve_backend
from .checks import check_fused_msda_inputs, check_msda_inputs
from .export import fused_multi_scale_deformable_attn_export, in_onnx_export, multi_scale_deformable_attn_export
from .level_tables import host_level_tables
from .reference import multi_scale_deformable_attn_reference, sampling_locations_from_offsets

OP_NAME = "msda"
# The profiler's name for the op's work (entered only while a profiler runs: the range costs a few microseconds).
PROFILER_RANGE = "deform_plugin::msda"


def multi_scale_deformable_attn(value: torch.Tensor, spatial_shapes: torch.Tensor, level_start_index: torch.Tensor,
                                sampling_locations: torch.Tensor, attention_weights: torch.Tensor,
                                backend: Optional[str] = None) -> torch.Tensor:
    """Multi-scale deformable attention (Deformable-DETR), a drop-in for mmcv's op with any batch size.

    Args:
        value: ``(B, S, H, D)`` values of all levels, each level's map flattened row-major, levels concatenated.
        spatial_shapes: ``(L, 2)`` integer (h, w) of each level.
        level_start_index: ``(L,)`` offset of each level in S: ``[0, h0*w0, h0*w0 + h1*w1, ...]``.
        sampling_locations: ``(B, Q, H, L, P, 2)`` normalized (x, y); pixel = x * w - 0.5 (mmcv's convention).
            Locations outside the map, NaN or infinite contribute zero.
        attention_weights: ``(B, Q, H, L, P)`` weight of each sample (usually a softmax over L*P).
        backend: ``'auto'``, ``'triton'``, ``'pytorch'``, a registered backend (``'mmcv'`` where mmcv's compiled
            ops are installed) or None for the process default (see :mod:`deform_plugin.ops.backend`).

    Returns:
        ``(B, Q, H*D)`` in the dtype of ``value``.

    The level tables are read on the host once per tensor object (see :mod:`.checks`): pass the same tensors to
    every call of a forward, as mmdet does, and no call waits for the GPU.

    Example:
        >>> value = torch.randn(2, 12 * 20 + 6 * 10, 8, 32)
        >>> shapes = torch.tensor([[12, 20], [6, 10]])
        >>> starts = torch.tensor([0, 240])
        >>> loc = torch.rand(2, 100, 8, 2, 4, 2)
        >>> weights = torch.rand(2, 100, 8, 2, 4).softmax(-1)
        >>> multi_scale_deformable_attn(value, shapes, starts, loc, weights).shape
        torch.Size([2, 100, 256])
    """
    shape = check_msda_inputs(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    if in_onnx_export():  # standard ONNX operators whatever the backend (see .export)
        return multi_scale_deformable_attn_export(value, spatial_shapes, level_start_index, sampling_locations,
                                                  attention_weights)
    name = resolve_backend(OP_NAME, backend, value.device)
    if shape.is_empty:
        return value.new_zeros((shape.batch, shape.num_queries, shape.num_heads * shape.head_dim))
    if _profiling():
        with record_function(PROFILER_RANGE):
            return _run(name, value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    return _run(name, value, spatial_shapes, level_start_index, sampling_locations, attention_weights)


def _profiling() -> bool:
    # Under torch.compile the profiler sees the compiled graph's own ranges; the flag is not traceable anyway.
    return not torch.compiler.is_compiling() and _profiler_enabled()


def _run(name, value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    if name == "triton":
        from .triton_op import multi_scale_deformable_attn_triton
        return multi_scale_deformable_attn_triton(value, spatial_shapes, level_start_index, sampling_locations,
                                                  attention_weights)
    if name == "pytorch":
        if not torch.compiler.is_compiling():
            # The host copies the checks made: the reference then never reads a table tensor itself.
            spatial_shapes, level_start_index = host_level_tables(spatial_shapes, level_start_index)
        return multi_scale_deformable_attn_reference(value, spatial_shapes, level_start_index, sampling_locations,
                                                     attention_weights)
    return registered_backend(OP_NAME, name).implementation(value, spatial_shapes, level_start_index,
                                                            sampling_locations, attention_weights)


def fused_multi_scale_deformable_attn(value: torch.Tensor, spatial_shapes: torch.Tensor,
                                      level_start_index: torch.Tensor, reference_points: torch.Tensor,
                                      sampling_offsets: torch.Tensor, attention_logits: torch.Tensor,
                                      backend: Optional[str] = None) -> torch.Tensor:
    """MSDA from the module's raw predictions: softmax and location arithmetic fused into the op.

    Computes ``multi_scale_deformable_attn(value, ..., locations, softmax(attention_logits over L*P))`` with
    ``locations`` from :func:`~deform_plugin.ops.msda.reference.sampling_locations_from_offsets`. The Triton
    backend does the softmax and the location arithmetic inside its kernels (no intermediate tensors); the other
    backends compose PyTorch ops.

    Args:
        value: ``(B, S, H, D)``.
        spatial_shapes, level_start_index: as in :func:`multi_scale_deformable_attn`.
        reference_points: ``(B, Q, L, 2)`` normalized points or ``(B, Q, L, 4)`` normalized boxes (cx, cy, w, h).
        sampling_offsets: ``(B, Q, H, L, P, 2)`` raw offsets predicted by the module.
        attention_logits: ``(B, Q, H, L, P)`` raw logits; the softmax runs over the last L*P values per head.
        backend: as in :func:`multi_scale_deformable_attn`.

    Returns:
        ``(B, Q, H*D)`` in the dtype of ``value``.
    """
    shape = check_fused_msda_inputs(value, spatial_shapes, level_start_index, reference_points, sampling_offsets,
                                    attention_logits)
    if in_onnx_export():  # standard ONNX operators whatever the backend (see .export)
        return fused_multi_scale_deformable_attn_export(value, spatial_shapes, level_start_index, reference_points,
                                                        sampling_offsets, attention_logits)
    name = resolve_backend(OP_NAME, backend, value.device)
    if shape.is_empty:
        return value.new_zeros((shape.batch, shape.num_queries, shape.num_heads * shape.head_dim))
    if name == "triton":
        from .triton_op import fused_multi_scale_deformable_attn_triton
        if _profiling():
            with record_function(PROFILER_RANGE):
                return fused_multi_scale_deformable_attn_triton(value, spatial_shapes, level_start_index,
                                                                reference_points, sampling_offsets, attention_logits)
        return fused_multi_scale_deformable_attn_triton(value, spatial_shapes, level_start_index, reference_points,
                                                        sampling_offsets, attention_logits)
    weights = attention_logits.flatten(-2).softmax(-1).view_as(attention_logits)
    locations = sampling_locations_from_offsets(reference_points, sampling_offsets, spatial_shapes)
    return multi_scale_deformable_attn(value, spatial_shapes, level_start_index, locations, weights, backend=name)
