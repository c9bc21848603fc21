"""sdpa_attention: mmcv's MultiheadAttention brick through PyTorch SDPA gives the stock outputs and gradients."""
import copy

import pytest
import torch
from mmcv.cnn.bricks.transformer import MultiheadAttention

import deform_plugin  # noqa: F401  (mmcv stand-in where mmcv-lite is installed)
from deform_plugin.integration.mmdet_fast_paths import (disable_sdpa_attention, enable_sdpa_attention,
                                                        sdpa_multihead_attention_class)


def _attention_pair(batch_first, attn_drop=0.0):
    torch.manual_seed(0)
    # No dropout layer after the attention: mmcv builds its 'Dropout' through the registry of the current default
    # scope, and under mmdet's scope (set by any earlier test that builds an mmdet model) it gets p=0.1.
    stock = MultiheadAttention(embed_dims=32, num_heads=4, attn_drop=attn_drop, batch_first=batch_first,
                               dropout_layer=None).double()
    fast = copy.deepcopy(stock)
    assert enable_sdpa_attention(fast) == 1
    assert type(fast) is sdpa_multihead_attention_class()
    return stock, fast


def _run(module, inputs, kwargs):
    inputs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    query, key, query_pos, key_pos = inputs
    out = module(query=query, key=key, value=key, query_pos=query_pos, key_pos=key_pos, **kwargs)
    grad_out = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    grads = torch.autograd.grad(out, [query, key, query_pos, key_pos, *module.parameters()], grad_out)
    return out, grads


ATTENTION_CASES = [
    pytest.param(dict(batch_first=True, num_keys=None, mask=None), id="self-attn-batch-first"),
    pytest.param(dict(batch_first=False, num_keys=None, mask=None), id="self-attn-seq-first"),
    pytest.param(dict(batch_first=True, num_keys=None, mask="bool-2d"), id="self-attn-dn-mask"),
    pytest.param(dict(batch_first=True, num_keys=23, mask="bool-3d"), id="masked-cross-attn"),
    pytest.param(dict(batch_first=True, num_keys=23, mask="key-padding"), id="cross-attn-key-padding"),
]


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_sdpa_brick_matches_stock_outputs_and_gradients_float64(case):
    batch, num_queries, heads = 2, 17, 4
    num_keys = case["num_keys"] or num_queries
    stock, fast = _attention_pair(case["batch_first"])
    generator = torch.Generator().manual_seed(2)

    def tensor(length):
        shape = (batch, length, 32) if case["batch_first"] else (length, batch, 32)
        return torch.randn(shape, generator=generator, dtype=torch.float64)
    query, query_pos = tensor(num_queries), tensor(num_queries)
    key, key_pos = (query, query_pos) if case["num_keys"] is None else (tensor(num_keys), tensor(num_keys))
    kwargs = {}
    if case["mask"] == "bool-2d":  # DINO's denoising mask: True blocks attention
        mask = torch.rand(num_queries, num_keys, generator=generator) < 0.3
        mask.fill_diagonal_(False)
        kwargs["attn_mask"] = mask
    elif case["mask"] == "bool-3d":  # Mask2Former's masked attention, one map per (image, head)
        mask = torch.rand(batch * heads, num_queries, num_keys, generator=generator) < 0.5
        mask[..., 0] = False
        kwargs["attn_mask"] = mask
    elif case["mask"] == "key-padding":
        padding = torch.zeros(batch, num_keys, dtype=torch.bool)
        padding[1, -5:] = True
        kwargs["key_padding_mask"] = padding
    out_stock, grads_stock = _run(stock, [query, key, query_pos, key_pos], kwargs)
    out_fast, grads_fast = _run(fast, [query, key, query_pos, key_pos], kwargs)
    torch.testing.assert_close(out_fast, out_stock, rtol=1e-10, atol=1e-11)
    for g_fast, g_stock in zip(grads_fast, grads_stock):
        torch.testing.assert_close(g_fast, g_stock, rtol=1e-9, atol=1e-10)


def test_sdpa_brick_in_eval_mode_ignores_attention_dropout_like_stock():
    stock, fast = _attention_pair(batch_first=True, attn_drop=0.1)
    stock.eval()
    fast.eval()
    query = torch.randn(2, 9, 32, dtype=torch.float64)
    torch.testing.assert_close(fast(query), stock(query), rtol=1e-10, atol=1e-11)


def test_sdpa_brick_leaves_cudnn_attention_out_in_eval_mode_only():
    # cuDNN's attention plans each new key length (inference meets one per image size); training keeps PyTorch's
    # choice. The flag is read where the attention runs: inside nn.MultiheadAttention's forward.
    _, fast = _attention_pair(batch_first=True)
    seen = []
    forward = fast.attn.forward

    def recording_forward(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return forward(*args, **kwargs)

    fast.attn.forward = recording_forward
    query = torch.randn(2, 9, 32, dtype=torch.float64)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    fast.train()
    fast(query)
    fast.eval()
    fast(query)
    assert seen == [before, False]
    assert torch.backends.cuda.cudnn_sdp_enabled() == before  # restored after the call


def test_sdpa_switch_keeps_parameters_and_state_dict_and_can_be_undone():
    stock, fast = _attention_pair(batch_first=True)
    assert list(fast.state_dict()) == list(stock.state_dict())
    assert disable_sdpa_attention(fast) == 1 and type(fast) is MultiheadAttention
