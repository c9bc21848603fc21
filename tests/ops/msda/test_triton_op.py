"""The MSDA custom ops: torch.library registration (opcheck, eager agreement), whole-graph torch.compile of a
module and of the drop-in module, and autocast."""
import importlib.util

import pytest
import torch

from deform_plugin.ops.msda.reference import sampling_locations_from_offsets

triton = pytest.importorskip("triton")
from deform_plugin.ops.msda.triton_op import (  # noqa: E402
    fused_multi_scale_deformable_attn_triton,
    multi_scale_deformable_attn_triton,
)
from msda_cases import DEVICE, DTYPES, ON_GPU, level_tables, make_case, make_fused_case, relative_error  # noqa: E402

pytestmark = pytest.mark.usefixtures("poisoned_allocations")


class TinyMSDA(torch.nn.Module):
    """The smallest module that predicts offsets and logits and calls both ops, as the encoder layer does."""

    def __init__(self, levels, heads, head_dim, points):
        super().__init__()
        self.levels, self.heads, self.head_dim, self.points = len(levels), heads, head_dim, points
        embed = heads * head_dim
        self.offsets = torch.nn.Linear(embed, heads * self.levels * points * 2)
        self.logits = torch.nn.Linear(embed, heads * self.levels * points)
        self.value_proj = torch.nn.Linear(embed, embed)

    def forward(self, query, value, spatial_shapes, level_start_index, reference_points):
        batch, num_queries, _ = query.shape
        shape = (batch, num_queries, self.heads, self.levels, self.points)
        value = self.value_proj(value).view(batch, value.shape[1], self.heads, self.head_dim)
        offsets = self.offsets(query).view(*shape, 2)
        logits = self.logits(query).view(shape)
        weights = logits.flatten(-2).softmax(-1).view(shape)
        locations = sampling_locations_from_offsets(reference_points, offsets, spatial_shapes)
        plain = multi_scale_deformable_attn_triton(value, spatial_shapes, level_start_index, locations, weights)
        fused = fused_multi_scale_deformable_attn_triton(value, spatial_shapes, level_start_index, reference_points,
                                                         offsets, logits)
        return plain + fused


def test_torch_compile_fullgraph_module():
    """The ops are registered custom ops: fullgraph compilation must trace the module with no graph break."""
    levels = [(4, 5), (2, 3)]
    spatial_shapes, level_start_index, num_keys = level_tables(levels)
    module = TinyMSDA(levels, heads=2, head_dim=8, points=2).to(DEVICE)
    query = torch.randn(2, 6, 16, device=DEVICE)
    value = torch.randn(2, num_keys, 16, device=DEVICE)
    reference_points = torch.rand(2, 6, len(levels), 2, device=DEVICE)
    torch._dynamo.reset()
    # Inductor on a GPU; on a CPU aot_eager keeps the test fast while tracing the same graph (fake + autograd).
    compiled = torch.compile(module, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    out = compiled(query, value, spatial_shapes, level_start_index, reference_points)
    expected = module(query, value, spatial_shapes, level_start_index, reference_points)
    assert relative_error(out, expected) <= 1e-5
    out.sum().backward()
    assert module.offsets.weight.grad is not None and torch.isfinite(module.offsets.weight.grad).all()


@pytest.mark.skipif(importlib.util.find_spec("mmcv") is None or importlib.util.find_spec("mmengine") is None,
                    reason="the registered module subclasses mmcv's MultiScaleDeformableAttention")
def test_torch_compile_fullgraph_registered_module():
    """The drop-in module, through the public functional API (checks, backend choice, fused op), compiles whole."""
    import deform_plugin  # noqa: F401  (installs the mmcv-lite stand-in where needed)
    from deform_plugin.models import MultiScaleDeformableAttention
    levels = [(4, 5), (2, 3)]
    spatial_shapes, level_start_index, num_keys = level_tables(levels)
    module = MultiScaleDeformableAttention(embed_dims=16, num_heads=2, num_levels=len(levels), num_points=2,
                                           batch_first=True, dropout=0.0, backend="triton").to(DEVICE)
    module.init_weights()
    query = torch.randn(2, 6, 16, device=DEVICE)
    value = torch.randn(2, num_keys, 16, device=DEVICE)
    reference_points = torch.rand(2, 6, len(levels), 2, device=DEVICE)
    kwargs = dict(value=value, reference_points=reference_points, spatial_shapes=spatial_shapes.to(DEVICE),
                  level_start_index=level_start_index.to(DEVICE))
    torch._dynamo.reset()
    compiled = torch.compile(module, fullgraph=True, backend="inductor" if ON_GPU else "aot_eager")
    out = compiled(query, **kwargs)
    expected = module(query, **kwargs)
    assert relative_error(out, expected) <= 1e-5
    out.sum().backward()
    assert module.sampling_offsets.weight.grad is not None and module.sampling_offsets.weight.grad.abs().sum() > 0


AUTOCAST_DTYPES = ["fp16", "bf16"] if ON_GPU else ["bf16"]


@pytest.mark.parametrize("dtype_name", AUTOCAST_DTYPES)
def test_module_under_autocast(dtype_name):
    """Under torch.autocast the module's Linear layers emit 16-bit value/offsets/logits while the reference points
    stay float32: both ops must accept the mix, return value's dtype and backpropagate finite float32 grads."""
    levels = [(4, 5), (2, 3)]
    spatial_shapes, level_start_index, num_keys = level_tables(levels)
    module = TinyMSDA(levels, heads=2, head_dim=8, points=2).to(DEVICE)
    query = torch.randn(2, 6, 16, device=DEVICE)
    value = torch.randn(2, num_keys, 16, device=DEVICE)
    reference_points = torch.rand(2, 6, len(levels), 2, device=DEVICE)
    expected = module(query, value, spatial_shapes, level_start_index, reference_points)
    with torch.autocast(device_type=DEVICE.type, dtype=DTYPES[dtype_name]):
        out = module(query, value, spatial_shapes, level_start_index, reference_points)
    assert out.dtype == DTYPES[dtype_name]
    assert relative_error(out, expected) <= (2e-2 if dtype_name == "bf16" else 5e-3)
    out.float().sum().backward()
    for parameter in module.parameters():
        assert parameter.grad is not None and parameter.grad.dtype == torch.float32
        assert torch.isfinite(parameter.grad).all()


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_registered_custom_ops_pass_opcheck_and_match_eager(fused):
    """Traced code runs the torch.library ops, eager code a thin autograd.Function: both must agree, and the ops'
    schema, fake implementation and autograd registration must pass torch.library.opcheck."""
    from deform_plugin.ops.msda import triton_op
    if fused:
        case = make_fused_case([(4, 5), (2, 3)], 2, 5, 2, 8, 2, 2, torch.float32, seed=4)
        op, eager = torch.ops.deform_plugin.fused_msda_forward.default, fused_multi_scale_deformable_attn_triton
        args = (case[0], case[1], case[2], case[3], case[4], case[5])
        differentiable = (0, 3, 4, 5)
    else:
        case = make_case([(4, 5), (2, 3)], 2, 5, 2, 8, 2, torch.float32, seed=4)
        op, eager = torch.ops.deform_plugin.msda_forward.default, multi_scale_deformable_attn_triton
        args = case
        differentiable = (0, 3, 4)
    assert triton_op is not None
    leaves = [t.detach().clone().requires_grad_() if i in differentiable else t for i, t in enumerate(args)]
    torch.library.opcheck(op, tuple(leaves), test_utils=("test_schema", "test_autograd_registration",
                                                         "test_faketensor"))
    grad_output = torch.randn(2, 5, 16, device=DEVICE)
    results = []
    for fn in (op, eager):
        inputs = [t.detach().clone().requires_grad_() if i in differentiable else t for i, t in enumerate(args)]
        out = fn(*inputs)
        grads = torch.autograd.grad(out, [inputs[i] for i in differentiable], grad_output)
        results.append((out, *grads))
    for via_op, via_eager in zip(*results):
        assert relative_error(via_op, via_eager) <= 1e-6
