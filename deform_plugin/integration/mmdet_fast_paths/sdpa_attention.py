"""The ``sdpa_attention`` fast path: mmcv's ``MultiheadAttention`` brick without the attention matrix it discards.

Every mmcv ``MultiheadAttention`` brick (the DETR decoders' self-attention, Mask2Former's masked cross- and
self-attention) calls ``nn.MultiheadAttention`` with ``need_weights=True``, which makes PyTorch compute the softmax
matrix explicitly (baddbmm, softmax, dropout, bmm) and average it over heads for a return value the brick throws
away; with ``need_weights=False`` PyTorch calls ``scaled_dot_product_attention`` (fused kernels on CUDA). Same
parameters, same state-dict keys, same function: the outputs and gradients agree to float rounding. With attention
dropout > 0 in training mode (Deformable-DETR's decoder: 0.1) the dropout mask is drawn differently, so single steps
agree only in distribution; eval mode and dropout 0 (DINO, Mask2Former) agree to rounding.

In eval mode the brick leaves cuDNN's attention backend out of PyTorch's choice. Inference meets a new key length
with each new input size (Mask2Former's masked cross-attention attends over a feature level of the image), and
cuDNN's backend, which PyTorch prefers for 16-bit inputs on Hopper, builds an execution plan for every new length:
on an H200 (torch 2.11) 4.8 ms per call, about 170 ms of a Mask2Former bf16 call at a new image size, where the
attention kernels themselves take 2 ms. The flash and memory-efficient backends need no plan. Training keeps
PyTorch's choice: its shape buckets repeat lengths, so plans are reused.
"""
from __future__ import annotations

import contextlib
import warnings

from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

# Backends whose kernels need no per-shape plan (see the module); MATH keeps a backend for every input.
PLAN_FREE_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _stock_multihead_attention_class():
    from mmcv.cnn.bricks.transformer import MultiheadAttention
    return MultiheadAttention


def _make_sdpa_class():
    stock = _stock_multihead_attention_class()

    class SDPAMultiheadAttention(stock):
        """mmcv's ``MultiheadAttention`` brick calling ``nn.MultiheadAttention`` with ``need_weights=False``.

        Identical parameters and forward semantics; PyTorch then runs ``scaled_dot_product_attention`` instead of
        materialising (and head-averaging) the attention matrix that the stock brick discards.
        """

        def forward(self, query, key=None, value=None, identity=None, query_pos=None, key_pos=None,
                    attn_mask=None, key_padding_mask=None, **kwargs):
            # Mirrors the stock brick's argument handling line for line; only need_weights (and, in eval mode, the
            # backends PyTorch may choose) differ.
            if key is None:
                key = query
            if value is None:
                value = key
            if identity is None:
                identity = query
            if key_pos is None and query_pos is not None:
                if query_pos.shape == key.shape:
                    key_pos = query_pos
                else:
                    warnings.warn(f"position encoding of key is missing in {self.__class__.__name__}.")
            if query_pos is not None:
                query = query + query_pos
            if key_pos is not None:
                key = key + key_pos
            if self.batch_first:
                query = query.transpose(0, 1)
                key = key.transpose(0, 1)
                value = value.transpose(0, 1)
            with contextlib.nullcontext() if self.training else sdpa_kernel(PLAN_FREE_SDPA_BACKENDS):
                out = self.attn(query=query, key=key, value=value, attn_mask=attn_mask,
                                key_padding_mask=key_padding_mask, need_weights=False)[0]
            if self.batch_first:
                out = out.transpose(0, 1)
            return identity + self.dropout_layer(self.proj_drop(out))

    SDPAMultiheadAttention.__name__ = SDPAMultiheadAttention.__qualname__ = "SDPAMultiheadAttention"
    return SDPAMultiheadAttention


_sdpa_class = None


def sdpa_multihead_attention_class():
    """The SDPA subclass of mmcv's ``MultiheadAttention`` brick (created on first use, after mmcv is importable)."""
    global _sdpa_class
    if _sdpa_class is None:
        _sdpa_class = _make_sdpa_class()
    return _sdpa_class


def enable_sdpa_attention(model: nn.Module) -> int:
    """Switch every stock mmcv ``MultiheadAttention`` brick in ``model`` to :func:`sdpa_multihead_attention_class`.

    The switch changes the instance's class only: parameters, buffers, hooks and state-dict keys stay as they are,
    so it may run before or after the optimizer and DDP are built. Subclasses of the brick are left alone (their
    forward may differ). Returns the number of modules switched.
    """
    return _switch_class(model, _stock_multihead_attention_class(), sdpa_multihead_attention_class())


def _switch_class(model: nn.Module, old: type, new: type) -> int:
    switched = 0
    for module in model.modules():
        if type(module) is old:
            module.__class__ = new
            switched += 1
    return switched


def disable_sdpa_attention(model: nn.Module) -> int:
    """Undo :func:`enable_sdpa_attention`; returns the number of modules switched back."""
    return _switch_class(model, sdpa_multihead_attention_class(), _stock_multihead_attention_class())
