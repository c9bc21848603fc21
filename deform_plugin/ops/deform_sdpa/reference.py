"""Pure-PyTorch deformable scaled dot-product attention: the specification of the op and its CPU path.

For each query pixel ``n`` of view ``v`` (batch ``b``, head ``h``), keys and values are sampled bilinearly at
``num_samples`` points in every view, and the query attends over all ``num_views * num_samples`` samples:

    k_s, v_s = bilinear(k[b, v'], coords[b, v, n, v', s]), bilinear(v[b, v'], ...)   for all (v', s)
    out[b, v, h, n] = softmax_s(q[b, v, h, n] . k_s * sm_scale) @ v_s

Conventions (the same as our MSDA op):
    * a sampling location ``(x, y)`` in [0, 1] maps to the pixel coordinate ``(x * width - 0.5, y * height - 0.5)``
      of the view's ``height x width`` map, flattened row-major (``n = row * width + col``);
    * bilinear interpolation over the four neighbouring pixels, each corner outside the map contributing zero;
    * locations that are NaN or infinite sample zero (and get zero gradient).

A sample outside the map, or at a NaN location, still takes part in the softmax: its key is zero, so its score
is 0, and its value is zero. This is what grid sampling with zero padding followed by attention computes.

Arithmetic runs in float32 for half-precision inputs and in float64 for float64 inputs, so this function is also
the float64 reference that the Triton kernels are tested against. Gradients come from PyTorch autograd.
It materializes the sampled keys and values, ``(B, V, H, N, V*S, D)`` each: this is the baseline the fused
kernels are benchmarked against.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F


def deform_sdpa_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, coords: torch.Tensor, width: int,
                          height: int, sm_scale: Optional[float] = None) -> torch.Tensor:
    """Reference deformable SDPA. Shapes as in :func:`deform_plugin.ops.deform_sdpa`; returns ``(B, V, H, N, D)``."""
    batch, num_views, num_heads, num_pixels, head_dim = q.shape
    num_samples = coords.shape[4]
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    coords_dtype = torch.promote_types(coords.dtype, compute_dtype)

    # grid_sample's align_corners=False maps g in [-1, 1] to pixel ((g + 1) * size - 1) / 2, so g = 2x - 1 gives
    # our pixel = x * size - 0.5.
    coords = coords.to(coords_dtype)
    finite = torch.isfinite(coords).all(-1, keepdim=True)
    # where() rather than arithmetic masking, so a NaN location cannot leak NaN into any gradient.
    grid = torch.where(finite, coords, torch.full_like(coords, -1.0)) * 2 - 1
    # Clamping keeps grid_sample's index arithmetic finite for huge values; it moves only points whose four
    # corners are all outside the map (pixel <= -1 or >= size), which sample zero either way.
    grid = grid.clamp(-3.0, 3.0).to(compute_dtype)

    # Sample keys and values of all views in one call: the sampled views fold into the batch, the channels are
    # (k|v, head, dim), the output "image" is (query view * query pixel, sample).
    key_value = torch.stack([k, v], 2).to(compute_dtype)  # (B, V', 2, H, N, D)
    key_value = key_value.permute(0, 1, 2, 3, 5, 4).reshape(batch * num_views, 2 * num_heads * head_dim,
                                                             height, width)
    # (B, Vq, N, V', S, 2) -> (B, V', Vq, N, S, 2) -> (B*V', Vq*N, S, 2)
    grid = grid.permute(0, 3, 1, 2, 4, 5).reshape(batch * num_views, num_views * num_pixels, num_samples, 2)
    sampled = F.grid_sample(key_value, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    # (B*V', 2*H*D, Vq*N, S) -> (B, V', 2, H, D, Vq, N, S) -> (2, B, Vq, H, N, V', S, D)
    sampled = sampled.view(batch, num_views, 2, num_heads, head_dim, num_views, num_pixels, num_samples)
    sampled = sampled.permute(2, 0, 5, 3, 6, 1, 7, 4)
    sampled = sampled.reshape(2, batch, num_views, num_heads, num_pixels, num_views * num_samples, head_dim)
    sampled_k, sampled_v = sampled.unbind(0)

    scores = torch.einsum("bvhnd,bvhntd->bvhnt", q.to(compute_dtype), sampled_k) * sm_scale
    probs = scores.softmax(-1)
    out = torch.einsum("bvhnt,bvhntd->bvhnd", probs, sampled_v)
    return out.to(q.dtype)
