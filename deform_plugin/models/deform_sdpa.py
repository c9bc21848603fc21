"""MMEngine modules built on the deformable SDPA op: the attention layer and a tiny multi-view fusion model."""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from mmengine.registry import MODELS
from torch import nn

from ..ops.deform_sdpa import deform_sdpa


def reference_grid(height: int, width: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """Normalized (x, y) centres of a ``height x width`` map, row-major: ``(height * width, 2)``."""
    ys = (torch.arange(height, device=device, dtype=dtype) + 0.5) / height
    xs = (torch.arange(width, device=device, dtype=dtype) + 0.5) / width
    grid_y, grid_x = torch.meshgrid(ys, xs, indexing="ij")
    return torch.stack([grid_x, grid_y], -1).reshape(height * width, 2)


@MODELS.register_module()
class DeformableSDPAttention(nn.Module):
    """Multi-view deformable scaled dot-product attention (the layer around :func:`deform_plugin.ops.deform_sdpa`).

    Every query pixel of every view predicts ``num_samples`` sampling offsets in each view from its own feature,
    adds them to a reference point (by default its own position, in every view), samples keys and values there
    and attends over all ``num_views * num_samples`` samples with a softmax of ``q . k``. The sampling points are
    shared by the heads; q, k, v and the output are linear projections.

    Args:
        embed_dims: Channels C of the input and output features.
        num_heads: Attention heads; ``embed_dims`` must be divisible by it. Head dims of 16..128 run fastest on
            the Triton kernels.
        num_views: Views V per sample.
        num_samples: Sampling points S per view and query.
        sm_scale: Score scale; None for ``1 / sqrt(embed_dims / num_heads)``.
        init_radius: Radius in pixels of the outermost ring on which the offsets start (the points start on
            rings of radius ``init_radius * (1 + s % 4) / 4`` around the reference).
        backend: Backend of the op (``'auto'``, ``'triton'``, ``'pytorch'``) or None for the process default.

    Shapes:
        ``query``: ``(B, V, N, C)`` with ``N = height * width`` pixels per view, row-major;
        ``value``: ``(B, V, N, C)``, the features keys and values are projected from (default: ``query``);
        ``reference_points``: ``(B, V, N, V, 2)`` normalized (x, y) in each view (default: the query's own
        pixel centre in every view). Output: ``(B, V, N, C)``.
    """

    def __init__(self, embed_dims: int = 256, num_heads: int = 8, num_views: int = 6, num_samples: int = 8,
                 sm_scale: Optional[float] = None, init_radius: float = 2.0, backend: Optional[str] = None):
        super().__init__()
        if embed_dims % num_heads != 0:
            raise ValueError(f"embed_dims must be divisible by num_heads, got {embed_dims} and {num_heads}")
        if num_views < 1 or num_samples < 1:
            raise ValueError(f"need num_views >= 1 and num_samples >= 1, got {num_views} and {num_samples}")
        self.embed_dims = embed_dims
        self.num_heads = num_heads
        self.num_views = num_views
        self.num_samples = num_samples
        self.sm_scale = sm_scale
        self.init_radius = init_radius
        self.backend = backend
        self.sampling_offsets = nn.Linear(embed_dims, num_views * num_samples * 2)
        self.q_proj = nn.Linear(embed_dims, embed_dims)
        self.k_proj = nn.Linear(embed_dims, embed_dims)
        self.v_proj = nn.Linear(embed_dims, embed_dims)
        self.out_proj = nn.Linear(embed_dims, embed_dims)
        self.init_weights()

    def init_weights(self) -> None:
        # Offsets start input-independent, spread on rings around the reference (as MSDA starts its points),
        # so early training samples a neighbourhood rather than one pixel.
        nn.init.zeros_(self.sampling_offsets.weight)
        sample = torch.arange(self.num_samples, dtype=torch.float32)
        angle = 2 * math.pi * sample / self.num_samples
        radius = self.init_radius * (1 + sample % 4) / 4
        ring = torch.stack([angle.cos(), angle.sin()], -1) * radius[:, None]
        with torch.no_grad():
            self.sampling_offsets.bias.copy_(ring.repeat(self.num_views, 1).flatten())
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            nn.init.xavier_uniform_(proj.weight)
            nn.init.zeros_(proj.bias)

    def forward(self, query: torch.Tensor, spatial_shape: Sequence[int], value: Optional[torch.Tensor] = None,
                reference_points: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Attend from every pixel of every view to its sampling points in all views.

        Args:
            query: ``(B, V, N, C)``.
            spatial_shape: ``(height, width)`` of every view, ``height * width == N``.
            value: ``(B, V, N, C)`` or None to use ``query``.
            reference_points: ``(B, V, N, V, 2)`` normalized (x, y), or None for each query's own position.

        Returns:
            ``(B, V, N, C)``.
        """
        height, width = (int(size) for size in spatial_shape)
        value = query if value is None else value
        batch, num_views, num_pixels, channels = query.shape
        if (num_views, num_pixels, channels) != (self.num_views, height * width, self.embed_dims):
            raise ValueError(f"query has shape {tuple(query.shape)} but the module expects (batch, num_views="
                             f"{self.num_views}, height*width={height * width}, embed_dims={self.embed_dims})")
        if reference_points is None:
            grid = reference_grid(height, width, device=query.device, dtype=query.dtype)
            reference_points = grid[None, None, :, None, :].expand(batch, num_views, num_pixels, num_views, 2)
        offsets = self.sampling_offsets(query).view(batch, num_views, num_pixels, num_views, self.num_samples, 2)
        pixel_size = query.new_tensor([1.0 / width, 1.0 / height])
        coords = reference_points[:, :, :, :, None, :] + offsets * pixel_size

        head_dim = self.embed_dims // self.num_heads

        def heads(tensor: torch.Tensor) -> torch.Tensor:
            # (B, V, N, C) -> (B, V, H, N, D); the op accepts the strided view.
            return tensor.view(batch, num_views, num_pixels, self.num_heads, head_dim).transpose(2, 3)

        out = deform_sdpa(heads(self.q_proj(query)), heads(self.k_proj(value)), heads(self.v_proj(value)), coords,
                          width, height, sm_scale=self.sm_scale, backend=self.backend)
        out = out.transpose(2, 3).reshape(batch, num_views, num_pixels, self.embed_dims)
        return self.out_proj(out)


@MODELS.register_module()
class MultiViewDeformSDPAFusion(nn.Module):
    """A tiny multi-view classifier: patch embedding per view, deformable-SDPA fusion layers, pooled head.

    Each layer is pre-norm: ``x + attention(norm(x))`` across all views, then ``x + ffn(norm(x))``.

    Args:
        num_views: Views V per sample.
        in_channels: Image channels.
        embed_dims: Feature channels C.
        patch_size: Stride of the patch embedding; images of ``h x w`` give ``(h / p) x (w / p)`` tokens per view.
        num_layers: Fusion layers.
        num_classes: Classes of the linear head.
        ffn_ratio: Hidden width of each feed-forward block, as a multiple of ``embed_dims``.
        attn_cfg: Config of the attention layer, built with ``MODELS.build``; ``type`` defaults to
            ``'DeformableSDPAttention'``, and ``embed_dims`` and ``num_views`` come from this model.

    Shapes:
        ``images``: ``(B, V, in_channels, h, w)`` with h and w divisible by ``patch_size``. Output: logits
        ``(B, num_classes)``.
    """

    def __init__(self, num_views: int = 4, in_channels: int = 3, embed_dims: int = 64, patch_size: int = 4,
                 num_layers: int = 2, num_classes: int = 10, ffn_ratio: int = 2, attn_cfg: Optional[dict] = None):
        super().__init__()
        attn_cfg = dict(attn_cfg or {})
        self.num_views = num_views
        self.patch_embed = nn.Conv2d(in_channels, embed_dims, patch_size, stride=patch_size)
        self.view_embed = nn.Parameter(torch.zeros(num_views, embed_dims))
        self.attn_norms = nn.ModuleList(nn.LayerNorm(embed_dims) for _ in range(num_layers))
        attn_cfg.setdefault("type", "DeformableSDPAttention")
        self.attentions = nn.ModuleList(
            MODELS.build(dict(attn_cfg, embed_dims=embed_dims, num_views=num_views)) for _ in range(num_layers))
        self.ffn_norms = nn.ModuleList(nn.LayerNorm(embed_dims) for _ in range(num_layers))
        self.ffns = nn.ModuleList(
            nn.Sequential(nn.Linear(embed_dims, ffn_ratio * embed_dims), nn.GELU(),
                          nn.Linear(ffn_ratio * embed_dims, embed_dims)) for _ in range(num_layers))
        self.head_norm = nn.LayerNorm(embed_dims)
        self.head = nn.Linear(embed_dims, num_classes)
        nn.init.normal_(self.view_embed, std=0.02)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        batch, num_views = images.shape[:2]
        if num_views != self.num_views:
            raise ValueError(f"images have {num_views} views but the model was built for {self.num_views}")
        features = self.patch_embed(images.flatten(0, 1))  # (B*V, C, h, w)
        height, width = features.shape[-2:]
        tokens = features.flatten(2).transpose(1, 2).reshape(batch, num_views, height * width, -1)
        tokens = tokens + self.view_embed[None, :, None, :]
        for attn_norm, attention, ffn_norm, ffn in zip(self.attn_norms, self.attentions, self.ffn_norms,
                                                       self.ffns):
            tokens = tokens + attention(attn_norm(tokens), (height, width))
            tokens = tokens + ffn(ffn_norm(tokens))
        return self.head(self.head_norm(tokens.mean(dim=(1, 2))))
