"""Precompiling the Triton MSDA kernels: a variant's small call runs the fused kernels forward and backward and
matches the reference; bad variants are refused by name."""
import json

import pytest
import torch

from deform_plugin.ops.msda.precompile import MSDAVariant, main, run_variant

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on the CPU (tests/conftest.py)


@pytest.mark.parametrize("reference_dim", [2, 4])
def test_a_variants_call_runs_the_fused_kernels_forward_and_backward(reference_dim):
    variant = MSDAVariant(num_heads=2, head_dim=4, num_levels=2, num_points=2, reference_dim=reference_dim)
    output = run_variant(variant, device=DEVICE)
    assert output.shape == (1, 5, 8) and output.dtype == torch.float32
    assert torch.isfinite(output).all() and output.grad_fn is not None


def test_the_variants_call_matches_the_pytorch_backend():
    variant = MSDAVariant(num_heads=1, head_dim=4, num_levels=2, num_points=1, reference_dim=4)
    torch.manual_seed(0)
    ours = run_variant(variant, device=DEVICE, backward=False)
    import deform_plugin.ops.msda.precompile as precompile
    original = precompile.fused_multi_scale_deformable_attn

    def pytorch(*args, backend=None):
        return original(*[a.cpu().double() if a.is_floating_point() else a.cpu() for a in args], backend="pytorch")
    precompile.fused_multi_scale_deformable_attn = pytorch
    try:
        expected = run_variant(variant, device=DEVICE, backward=False)
    finally:
        precompile.fused_multi_scale_deformable_attn = original
    torch.testing.assert_close(ours.detach().cpu().double(), expected.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kwargs,match", [
    (dict(dtype="float64"), "dtype must be one of float32, float16, bfloat16, got 'float64'"),
    (dict(reference_dim=3), "reference_dim must be 2 or 4, got 3"),
    (dict(num_points=0), "num_points must be an int >= 1, got 0"),
])
def test_a_bad_variant_is_refused_naming_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MSDAVariant(**dict(dict(num_heads=1, head_dim=4, num_levels=1, num_points=1), **kwargs))


def test_the_command_line_needs_its_variants():
    with pytest.raises(SystemExit, match="python -m deform_plugin.ops.msda.precompile"):
        main([])
    with pytest.raises(TypeError):
        main([json.dumps([dict(num_heads=1)])])

