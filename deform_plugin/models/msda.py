"""The drop-in ``MultiScaleDeformableAttention`` module, registered in MMEngine's ``MODELS``.

It subclasses mmcv's module, so a stock checkpoint loads with identical state-dict keys and mmdet's
``isinstance(m, MultiScaleDeformableAttention)`` weight initialisation still fires; only the attention itself runs on
deform_plugin's op (any batch size, fp32/fp16/bf16, Triton on CUDA). It knows nothing of Triton: it calls
:func:`deform_plugin.ops.fused_multi_scale_deformable_attn` with the raw predictions of its linear layers, and the
op decides where the softmax and the location arithmetic run.
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch
from mmcv.ops.multi_scale_deform_attn import MultiScaleDeformableAttention as MMCVMultiScaleDeformableAttention
from mmengine.logging import print_log
from mmengine.registry import MODELS
from mmengine.utils import deprecated_api_warning

from deform_plugin.ops import fused_multi_scale_deformable_attn, get_default_backend
from deform_plugin.ops.backend import resolve_backend, validate_backend_name
from deform_plugin.ops.msda import prepare_first_call_in_background

_live_modules: "weakref.WeakSet[MultiScaleDeformableAttention]" = weakref.WeakSet()
_reported_backends = set()


class MultiScaleDeformableAttention(MMCVMultiScaleDeformableAttention):
    """mmcv's ``MultiScaleDeformableAttention`` running on deform_plugin's kernels.

    Args:
        embed_dims (int): The embedding dimension of attention. Default: 256.
        num_heads (int): Parallel attention heads. Default: 8.
        num_levels (int): The number of feature maps used in attention. Default: 4.
        num_points (int): The number of sampling points for each query in each head. Default: 4.
        im2col_step (int): Kept for compatibility with mmcv; our kernels need no batch divisibility and ignore it
            except with ``backend='mmcv'``. Default: 64.
        dropout (float): A Dropout layer on the output before the residual. Default: 0.1.
        batch_first (bool): Query, key and value are (batch, n, embed_dims) instead of (n, batch, embed_dims).
            Default: False.
        norm_cfg (dict): Unused, as in mmcv. Default: None.
        init_cfg (dict or ConfigDict): The config for initialization. Default: None.
        value_proj_ratio (float): The expansion ratio of value_proj. Default: 1.0.
        backend (str, optional): ``'auto'`` (Triton on CUDA, the PyTorch reference elsewhere), ``'triton'``,
            ``'pytorch'`` or ``'mmcv'`` (the stock CUDA kernel, where mmcv's compiled ops are installed). None
            follows the process default (:func:`deform_plugin.ops.set_default_backend`). Default: None.
    """

    def __init__(self,
                 embed_dims: int = 256,
                 num_heads: int = 8,
                 num_levels: int = 4,
                 num_points: int = 4,
                 im2col_step: int = 64,
                 dropout: float = 0.1,
                 batch_first: bool = False,
                 norm_cfg: Optional[dict] = None,
                 init_cfg=None,
                 value_proj_ratio: float = 1.0,
                 backend: Optional[str] = None):
        validate_backend_name("msda", backend)
        super().__init__(embed_dims=embed_dims, num_heads=num_heads, num_levels=num_levels, num_points=num_points,
                         im2col_step=im2col_step, dropout=dropout, batch_first=batch_first, norm_cfg=norm_cfg,
                         init_cfg=init_cfg, value_proj_ratio=value_proj_ratio)
        self.backend = backend
        _live_modules.add(self)
        # The op's one-time host work of a process's first call (~0.6 s on a GPU host), on a thread while the rest
        # of the detector is built and its weights load, instead of in the first forward (the first image).
        prepare_first_call_in_background(backend)

    def _report_backend_once(self, device: torch.device) -> None:
        # One INFO line per process and (requested backend, device): that the plugin runs, and what 'auto' chose.
        requested = self.backend if self.backend is not None else get_default_backend()
        if (requested, device) in _reported_backends:
            return
        _reported_backends.add((requested, device))
        print_log(f"deform_plugin: {len(_live_modules)} MultiScaleDeformableAttention modules run deform_plugin's "
                  f"op; backend {requested!r} resolves to {resolve_backend('msda', self.backend, device)!r} on "
                  f"{device}", logger="current")

    def extra_repr(self) -> str:
        return (f"embed_dims={self.embed_dims}, num_heads={self.num_heads}, num_levels={self.num_levels}, "
                f"num_points={self.num_points}, backend={self.backend!r}")

    @deprecated_api_warning({"residual": "identity"}, cls_name="MultiScaleDeformableAttention")
    def forward(self,
                query: torch.Tensor,
                key: Optional[torch.Tensor] = None,
                value: Optional[torch.Tensor] = None,
                identity: Optional[torch.Tensor] = None,
                query_pos: Optional[torch.Tensor] = None,
                key_padding_mask: Optional[torch.Tensor] = None,
                reference_points: Optional[torch.Tensor] = None,
                spatial_shapes: Optional[torch.Tensor] = None,
                level_start_index: Optional[torch.Tensor] = None,
                **kwargs) -> torch.Tensor:
        """Same contract as mmcv's: returns ``dropout(attention(query)) + identity`` in the layout of ``query``.

        Args:
            query: ``(num_query, bs, embed_dims)`` (``(bs, num_query, embed_dims)`` if ``batch_first``).
            key: Unused, as in mmcv.
            value: ``(num_value, bs, embed_dims)``; defaults to ``query``.
            identity: Added to the output; defaults to ``query`` (before ``query_pos``).
            query_pos: Positional encoding added to ``query``.
            key_padding_mask: ``(bs, num_value)`` bool, True where the value is padding (zeroed).
            reference_points: ``(bs, num_query, num_levels, 2)`` normalized points or ``(..., 4)`` boxes.
            spatial_shapes: ``(num_levels, 2)`` (h, w) of each level.
            level_start_index: ``(num_levels,)`` start of each level in ``value``.
        """
        if not torch.compiler.is_compiling():
            self._report_backend_once(query.device)
        if value is None:
            value = query
        if identity is None:
            identity = query
        if query_pos is not None:
            query = query + query_pos
        if not self.batch_first:
            query = query.permute(1, 0, 2)
            value = value.permute(1, 0, 2)
        batch, num_query, _ = query.shape
        _, num_value, _ = value.shape

        value = self.value_proj(value)
        if key_padding_mask is not None:
            value = value.masked_fill(key_padding_mask[..., None], 0.0)
        value = value.view(batch, num_value, self.num_heads, -1)
        sampling_offsets = self.sampling_offsets(query).view(
            batch, num_query, self.num_heads, self.num_levels, self.num_points, 2)
        attention_logits = self.attention_weights(query).view(
            batch, num_query, self.num_heads, self.num_levels, self.num_points)
        output = fused_multi_scale_deformable_attn(value, spatial_shapes, level_start_index, reference_points,
                                                   sampling_offsets, attention_logits, backend=self.backend)
        output = self.output_proj(output)
        if not self.batch_first:
            output = output.permute(1, 0, 2)
        return self.dropout(output) + identity


# The registry name is the stock one, so registry-built configs (CO-DETR's ``type='MultiScaleDeformableAttention'``)
# get ours too; mmcv registered its class under that name in the same root registry, hence force=True.
MODELS.register_module(name="MultiScaleDeformableAttention", module=MultiScaleDeformableAttention, force=True)
MODELS.register_module(name="DeformPluginMSDA", module=MultiScaleDeformableAttention, force=True)
