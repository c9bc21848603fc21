"""Input validation shared by every MSDA backend, plain and fused.

Both public entry points validate before choosing a backend, so a bad call fails the same way whichever kernel
would have run it, with a message that names the offending values.

The level tables (``spatial_shapes``, ``level_start_index``) can only be checked against ``value`` on the host:
:mod:`.level_tables` reads each table tensor at most once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Sequence

import torch

from .level_tables import host_level_tables

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int64, torch.int32)


@dataclass(frozen=True)
class MSDAShape:
    """Sizes of one MSDA call: batch, keys, heads, head_dim, queries, levels, points."""

    batch: int
    num_keys: int
    num_heads: int
    head_dim: int
    num_queries: int
    num_levels: int
    num_points: int

    @property
    def is_empty(self) -> bool:
        return self.batch == 0 or self.num_queries == 0


def _check_tensor_types(named: Dict[str, object], float_names: Sequence[str]) -> None:
    for name, tensor in named.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    for name in float_names:
        if named[name].dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be a floating tensor (float16, bfloat16, float32 or float64), "
                            f"got {named[name].dtype}")
    for name in ("spatial_shapes", "level_start_index"):
        if named[name].dtype not in INDEX_DTYPES:
            raise TypeError(f"{name} must be an integer tensor (int64 or int32), got {named[name].dtype}")


def _check_value_and_tables(value: torch.Tensor, spatial_shapes: torch.Tensor, level_start_index: torch.Tensor,
                            num_levels: int, levels_from: str) -> None:
    if value.dim() != 4:
        raise ValueError(f"value must be (batch, num_keys, num_heads, head_dim), got shape {tuple(value.shape)}")
    if spatial_shapes.dim() != 2 or spatial_shapes.shape[1] != 2:
        raise ValueError(f"spatial_shapes must be (num_levels, 2) as (h, w), got shape {tuple(spatial_shapes.shape)}")
    if level_start_index.dim() != 1:
        raise ValueError(f"level_start_index must be (num_levels,), got shape {tuple(level_start_index.shape)}")
    if spatial_shapes.shape[0] != num_levels:
        raise ValueError(f"spatial_shapes has {spatial_shapes.shape[0]} levels but {levels_from} has {num_levels}")
    if level_start_index.shape[0] != num_levels:
        raise ValueError(f"level_start_index has {level_start_index.shape[0]} levels but {levels_from} has "
                         f"{num_levels}")


def _check_one_device(named: Dict[str, torch.Tensor]) -> None:
    devices = {t.device for t in named.values()}
    if len(devices) > 1:
        raise ValueError(f"{', '.join(named)} must be on one device, got "
                         + ", ".join(f"{name} on {t.device}" for name, t in named.items()))


def _check_tables_on_host(spatial_shapes, level_start_index, num_keys: int) -> None:
    # torch.compile traces with fake tensors that cannot be read: compiled graphs rely on eager calls having
    # checked the tables.
    if torch.compiler.is_compiling():
        return
    shapes, starts = host_level_tables(spatial_shapes, level_start_index)
    check_level_tables(shapes, starts, num_keys)


def check_msda_inputs(value: torch.Tensor, spatial_shapes: torch.Tensor, level_start_index: torch.Tensor,
                      sampling_locations: torch.Tensor, attention_weights: torch.Tensor) -> MSDAShape:
    """Validate the five tensors of :func:`deform_plugin.ops.multi_scale_deformable_attn` and return their sizes.

    Raises:
        TypeError: a tensor is not a tensor, or has an unsupported dtype.
        ValueError: shapes that do not agree with each other; the message names the values.
    """
    named = dict(value=value, spatial_shapes=spatial_shapes, level_start_index=level_start_index,
                 sampling_locations=sampling_locations, attention_weights=attention_weights)
    _check_tensor_types(named, ("value", "sampling_locations", "attention_weights"))
    if sampling_locations.dim() != 6:
        raise ValueError("sampling_locations must be (batch, num_queries, num_heads, num_levels, num_points, 2), "
                         f"got shape {tuple(sampling_locations.shape)}")
    if attention_weights.dim() != 5:
        raise ValueError("attention_weights must be (batch, num_queries, num_heads, num_levels, num_points), "
                         f"got shape {tuple(attention_weights.shape)}")
    batch_l, num_queries, heads_l, num_levels, num_points, last = sampling_locations.shape
    _check_value_and_tables(value, spatial_shapes, level_start_index, num_levels, "sampling_locations")
    batch, num_keys, num_heads, head_dim = value.shape
    if last != 2:
        raise ValueError(f"sampling_locations must end in 2 coordinates (x, y), got last dim {last}")
    if batch_l != batch:
        raise ValueError(f"sampling_locations has batch {batch_l} but value has batch {batch}")
    if heads_l != num_heads:
        raise ValueError(f"sampling_locations has {heads_l} heads but value has {num_heads}")
    expected_weights = (batch, num_queries, num_heads, num_levels, num_points)
    if tuple(attention_weights.shape) != expected_weights:
        raise ValueError(f"attention_weights has shape {tuple(attention_weights.shape)} but sampling_locations "
                         f"implies {expected_weights}")
    if num_levels == 0 or num_points == 0:
        raise ValueError(f"need at least one level and one point, got num_levels={num_levels}, "
                         f"num_points={num_points}")
    _check_one_device(dict(value=value, sampling_locations=sampling_locations, attention_weights=attention_weights))
    _check_tables_on_host(spatial_shapes, level_start_index, num_keys)
    return MSDAShape(batch, num_keys, num_heads, head_dim, num_queries, num_levels, num_points)


def check_fused_msda_inputs(value: torch.Tensor, spatial_shapes: torch.Tensor, level_start_index: torch.Tensor,
                            reference_points: torch.Tensor, sampling_offsets: torch.Tensor,
                            attention_logits: torch.Tensor) -> MSDAShape:
    """Validate the six tensors of :func:`deform_plugin.ops.fused_multi_scale_deformable_attn`; return their sizes.

    Raises:
        TypeError: a tensor is not a tensor, or has an unsupported dtype.
        ValueError: shapes that do not agree with each other; the message names the values.
    """
    named = dict(value=value, spatial_shapes=spatial_shapes, level_start_index=level_start_index,
                 reference_points=reference_points, sampling_offsets=sampling_offsets,
                 attention_logits=attention_logits)
    _check_tensor_types(named, ("value", "reference_points", "sampling_offsets", "attention_logits"))
    if sampling_offsets.dim() != 6 or sampling_offsets.shape[-1] != 2:
        raise ValueError("sampling_offsets must be (batch, num_queries, num_heads, num_levels, num_points, 2), "
                         f"got shape {tuple(sampling_offsets.shape)}")
    batch_o, num_queries, heads_o, num_levels, num_points, _ = sampling_offsets.shape
    _check_value_and_tables(value, spatial_shapes, level_start_index, num_levels, "sampling_offsets")
    batch, num_keys, num_heads, head_dim = value.shape
    if reference_points.dim() != 4 or reference_points.shape[-1] not in (2, 4):
        raise ValueError("reference_points must be (batch, num_queries, num_levels, 2 or 4), "
                         f"got shape {tuple(reference_points.shape)}")
    if batch_o != batch:
        raise ValueError(f"sampling_offsets has batch {batch_o} but value has batch {batch}")
    if heads_o != num_heads:
        raise ValueError(f"sampling_offsets has {heads_o} heads but value has {num_heads}")
    if tuple(reference_points.shape[:3]) != (batch, num_queries, num_levels):
        raise ValueError(f"reference_points has shape {tuple(reference_points.shape)} but sampling_offsets "
                         f"implies (batch, num_queries, num_levels) = {(batch, num_queries, num_levels)}")
    expected_logits = (batch, num_queries, num_heads, num_levels, num_points)
    if tuple(attention_logits.shape) != expected_logits:
        raise ValueError(f"attention_logits has shape {tuple(attention_logits.shape)} but sampling_offsets "
                         f"implies {expected_logits}")
    if num_levels == 0 or num_points == 0:
        raise ValueError(f"need at least one level and one point, got num_levels={num_levels}, "
                         f"num_points={num_points}")
    _check_one_device(dict(value=value, reference_points=reference_points, sampling_offsets=sampling_offsets,
                           attention_logits=attention_logits))
    _check_tables_on_host(spatial_shapes, level_start_index, num_keys)
    return MSDAShape(batch, num_keys, num_heads, head_dim, num_queries, num_levels, num_points)


def check_level_tables(shapes: Sequence[Sequence[int]], starts: Sequence[int], num_keys: int) -> None:
    """Check that (h, w) per level and the level start offsets tile exactly ``num_keys`` keys."""
    offset = 0
    shapes = [tuple(s) for s in shapes]
    for level, ((height, width), start) in enumerate(zip(shapes, starts)):
        if height < 1 or width < 1:
            raise ValueError(f"spatial_shapes[{level}] = ({height}, {width}): every level needs h >= 1 and w >= 1")
        if start != offset:
            raise ValueError(f"level_start_index[{level}] = {start} but the levels before it cover {offset} keys "
                             f"(spatial_shapes = {shapes})")
        offset += height * width
    if offset != num_keys:
        raise ValueError(f"spatial_shapes {shapes} cover {offset} keys but value has {num_keys}")
