"""Input validation shared by every MSDA backend.

Every backend calls :func:`check_msda_inputs` first, so a bad call fails the same way whichever kernel
would have run it, with a message that names the offending values.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


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


def check_msda_inputs(value: torch.Tensor, spatial_shapes: torch.Tensor, level_start_index: torch.Tensor,
                      sampling_locations: torch.Tensor, attention_weights: torch.Tensor,
                      check_level_sizes: bool = True) -> MSDAShape:
    """Validate the five MSDA tensors and return their sizes.

    Raises:
        TypeError: a tensor is not a tensor, or has an unsupported dtype.
        ValueError: shapes that do not agree with each other; the message names the values.
    """
    named = dict(value=value, spatial_shapes=spatial_shapes, level_start_index=level_start_index,
                 sampling_locations=sampling_locations, attention_weights=attention_weights)
    for name, tensor in named.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if value.dim() != 4:
        raise ValueError(f"value must be (batch, num_keys, num_heads, head_dim), got shape {tuple(value.shape)}")
    if sampling_locations.dim() != 6:
        raise ValueError("sampling_locations must be (batch, num_queries, num_heads, num_levels, num_points, 2), "
                         f"got shape {tuple(sampling_locations.shape)}")
    if attention_weights.dim() != 5:
        raise ValueError("attention_weights must be (batch, num_queries, num_heads, num_levels, num_points), "
                         f"got shape {tuple(attention_weights.shape)}")
    if spatial_shapes.dim() != 2 or spatial_shapes.shape[1] != 2:
        raise ValueError(f"spatial_shapes must be (num_levels, 2) as (h, w), got shape {tuple(spatial_shapes.shape)}")
    if level_start_index.dim() != 1:
        raise ValueError(f"level_start_index must be (num_levels,), got shape {tuple(level_start_index.shape)}")
    for name in ("value", "sampling_locations", "attention_weights"):
        if named[name].dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be a floating tensor (float16, bfloat16, float32 or float64), "
                            f"got {named[name].dtype}")
    for name in ("spatial_shapes", "level_start_index"):
        if named[name].dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{name} must be an integer tensor (int64 or int32), got {named[name].dtype}")

    batch, num_keys, num_heads, head_dim = value.shape
    loc_batch, num_queries, loc_heads, num_levels, num_points, last = sampling_locations.shape
    if last != 2:
        raise ValueError(f"sampling_locations must end in 2 coordinates (x, y), got last dim {last}")
    if loc_batch != batch:
        raise ValueError(f"sampling_locations has batch {loc_batch} but value has batch {batch}")
    if loc_heads != num_heads:
        raise ValueError(f"sampling_locations has {loc_heads} heads but value has {num_heads}")
    if spatial_shapes.shape[0] != num_levels:
        raise ValueError(f"spatial_shapes has {spatial_shapes.shape[0]} levels "
                         f"but sampling_locations has {num_levels}")
    if level_start_index.shape[0] != num_levels:
        raise ValueError(f"level_start_index has {level_start_index.shape[0]} levels "
                         f"but sampling_locations has {num_levels}")
    expected_weights = (batch, num_queries, num_heads, num_levels, num_points)
    if tuple(attention_weights.shape) != expected_weights:
        raise ValueError(f"attention_weights has shape {tuple(attention_weights.shape)} but sampling_locations "
                         f"implies {expected_weights}")
    if num_levels == 0 or num_points == 0:
        raise ValueError(f"need at least one level and one point, got num_levels={num_levels}, "
                         f"num_points={num_points}")
    devices = {t.device for t in (value, sampling_locations, attention_weights)}
    if len(devices) > 1:
        raise ValueError("value, sampling_locations and attention_weights must be on one device, got "
                         f"{value.device}, {sampling_locations.device}, {attention_weights.device}")
    if check_level_sizes:
        # One host sync for both tables: the callers need the sizes on the host anyway.
        shapes = spatial_shapes.tolist()
        starts = level_start_index.tolist()
        check_level_tables(shapes, starts, num_keys)
    return MSDAShape(batch, num_keys, num_heads, head_dim, num_queries, num_levels, num_points)


def check_level_tables(shapes: list, starts: list, num_keys: int) -> None:
    """Check that (h, w) per level and the level start offsets tile exactly ``num_keys`` keys."""
    offset = 0
    for level, ((height, width), start) in enumerate(zip(shapes, starts)):
        if height < 1 or width < 1:
            raise ValueError(f"spatial_shapes[{level}] = ({height}, {width}): every level needs h >= 1 and w >= 1")
        if start != offset:
            raise ValueError(f"level_start_index[{level}] = {start} but the levels before it cover {offset} keys "
                             f"(spatial_shapes = {shapes})")
        offset += height * width
    if offset != num_keys:
        raise ValueError(f"spatial_shapes {shapes} cover {offset} keys but value has {num_keys}")
