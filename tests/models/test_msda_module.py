"""The registered drop-in module against mmcv's stock module, at float64."""
import pytest
import torch

import deform_plugin  # noqa: F401  (installs the integration)
from deform_plugin.models import MultiScaleDeformableAttention
from mmcv.ops.multi_scale_deform_attn import MultiScaleDeformableAttention as StockMSDA
from mmcv.ops.multi_scale_deform_attn import multi_scale_deformable_attn_pytorch

SHAPES = [(6, 7), (3, 4), (2, 2)]


def level_inputs(batch, queries, embed_dims, box_reference, batch_first, seed=0):
    generator = torch.Generator().manual_seed(seed)
    spatial_shapes = torch.tensor(SHAPES)
    sizes = spatial_shapes.prod(1)
    level_start_index = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)[:-1]])
    num_value = int(sizes.sum())
    layout = (lambda n: (batch, n, embed_dims)) if batch_first else (lambda n: (n, batch, embed_dims))
    query = torch.randn(*layout(queries), generator=generator, dtype=torch.float64)
    value = torch.randn(*layout(num_value), generator=generator, dtype=torch.float64)
    query_pos = torch.randn(*layout(queries), generator=generator, dtype=torch.float64)
    ref_dims = 4 if box_reference else 2
    reference_points = torch.rand(batch, queries, len(SHAPES), ref_dims, generator=generator, dtype=torch.float64)
    if box_reference:
        reference_points[..., 2:] = reference_points[..., 2:] * 0.5
    return dict(query=query, value=value, query_pos=query_pos, reference_points=reference_points,
                spatial_shapes=spatial_shapes, level_start_index=level_start_index)


def paired_modules(embed_dims=32, num_heads=4, num_points=3, batch_first=False, backend="pytorch"):
    kwargs = dict(embed_dims=embed_dims, num_heads=num_heads, num_levels=len(SHAPES), num_points=num_points,
                  batch_first=batch_first, dropout=0.0)
    stock = StockMSDA(**kwargs)
    stock.init_weights()
    # Non-trivial offsets and logits so that the sampling really moves and the softmax is not uniform.
    with torch.no_grad():
        stock.sampling_offsets.weight.normal_(0, 0.05)
        stock.attention_weights.weight.normal_(0, 0.2)
    ours = MultiScaleDeformableAttention(**kwargs, backend=backend)
    ours.load_state_dict(stock.state_dict())
    return stock.double().eval(), ours.double().eval()


@pytest.mark.parametrize("box_reference", [False, True], ids=["ref2d", "ref4d"])
@pytest.mark.parametrize("batch_first", [False, True], ids=["seq-first", "batch-first"])
def test_module_matches_stock_pytorch_path_float64(box_reference, batch_first):
    stock, ours = paired_modules(batch_first=batch_first)
    inputs = level_inputs(batch=3, queries=7, embed_dims=32, box_reference=box_reference, batch_first=batch_first)
    stock_inputs = {k: v.clone().requires_grad_(v.is_floating_point()) for k, v in inputs.items()}
    our_inputs = {k: v.clone().requires_grad_(v.is_floating_point()) for k, v in inputs.items()}
    expected = stock(**stock_inputs)  # on CPU the stock module runs multi_scale_deformable_attn_pytorch
    got = ours(**our_inputs)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    grad_out = torch.randn_like(expected)
    expected.backward(grad_out)
    got.backward(grad_out)
    for name in ("query", "value", "query_pos", "reference_points"):
        torch.testing.assert_close(our_inputs[name].grad, stock_inputs[name].grad, rtol=1e-8, atol=1e-10)
    for (name, p_stock), (_, p_ours) in zip(stock.named_parameters(), ours.named_parameters()):
        torch.testing.assert_close(p_ours.grad, p_stock.grad, rtol=1e-8, atol=1e-10, msg=name)


def test_key_padding_mask_and_identity():
    stock, ours = paired_modules()
    inputs = level_inputs(batch=2, queries=5, embed_dims=32, box_reference=False, batch_first=False)
    num_value = inputs["value"].shape[0]
    mask = torch.zeros(2, num_value, dtype=torch.bool)
    mask[1, -10:] = True
    identity = torch.randn_like(inputs["query"])
    torch.testing.assert_close(ours(**inputs, key_padding_mask=mask, identity=identity),
                               stock(**inputs, key_padding_mask=mask, identity=identity))


def test_state_dict_keys_and_isinstance_match_stock():
    stock = StockMSDA()
    ours = MultiScaleDeformableAttention()
    assert list(ours.state_dict().keys()) == list(stock.state_dict().keys())
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in stock.state_dict().items()}
    assert isinstance(ours, StockMSDA)
    ours.load_state_dict(stock.state_dict(), strict=True)


def test_default_arguments_match_stock():
    import inspect
    stock_params = inspect.signature(StockMSDA.__init__).parameters
    our_params = inspect.signature(MultiScaleDeformableAttention.__init__).parameters
    for name, param in stock_params.items():
        assert our_params[name].default == param.default, name
    assert list(inspect.signature(StockMSDA.forward).parameters) == \
        list(inspect.signature(MultiScaleDeformableAttention.forward).parameters)


def test_init_weights_is_stock():
    torch.manual_seed(0)
    stock = StockMSDA(embed_dims=32, num_heads=4)
    stock.init_weights()
    torch.manual_seed(0)
    ours = MultiScaleDeformableAttention(embed_dims=32, num_heads=4)
    ours.init_weights()
    for (name, a), (_, b) in zip(stock.state_dict().items(), ours.state_dict().items()):
        torch.testing.assert_close(a, b, msg=name)


def test_backend_choices_are_validated():
    with pytest.raises(ValueError, match="msda has no backend 'cuda'"):
        MultiScaleDeformableAttention(backend="cuda")
    _, ours = paired_modules(backend="mmcv")
    inputs = level_inputs(batch=1, queries=2, embed_dims=32, box_reference=False, batch_first=False)
    with pytest.raises(RuntimeError, match="backend='mmcv'"):
        ours(**inputs)


def test_bad_reference_points_raise():
    _, ours = paired_modules()
    inputs = level_inputs(batch=1, queries=2, embed_dims=32, box_reference=False, batch_first=False)
    inputs["reference_points"] = torch.rand(1, 2, 3, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="reference_points must be"):
        ours(**inputs)


def test_stock_pytorch_function_is_what_we_compare_against():
    # Guards the comparison above: on CPU the stock module must take mmcv's pure-PyTorch path.
    value = torch.randn(1, 42 + 12 + 4, 2, 4, dtype=torch.float64)
    locations = torch.rand(1, 3, 2, 3, 2, 2, dtype=torch.float64)
    weights = torch.rand(1, 3, 2, 3, 2, dtype=torch.float64)
    from deform_plugin.ops import multi_scale_deformable_attn
    spatial_shapes = torch.tensor(SHAPES)
    starts = torch.tensor([0, 42, 54])
    torch.testing.assert_close(multi_scale_deformable_attn(value, spatial_shapes, starts, locations, weights),
                               multi_scale_deformable_attn_pytorch(value, spatial_shapes, locations, weights))


def test_first_forward_says_the_plugin_runs_and_which_backend_auto_chose(monkeypatch):
    from deform_plugin.models import msda as msda_module
    messages = []
    monkeypatch.setattr(msda_module, "print_log", lambda message, **kwargs: messages.append(message))
    monkeypatch.setattr(msda_module, "_reported_backends", set())
    _, ours = paired_modules(backend="auto")
    inputs = level_inputs(batch=1, queries=2, embed_dims=32, box_reference=False, batch_first=False)
    ours(**inputs)
    ours(**inputs)
    assert len(messages) == 1, messages
    assert "MultiScaleDeformableAttention modules run deform_plugin's op; backend 'auto' resolves to 'pytorch' on " \
        "cpu" in messages[0]
