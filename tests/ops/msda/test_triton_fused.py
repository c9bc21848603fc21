"""The fused Triton MSDA op (reference points, offsets and logits in; locations and weights derived in the kernel)
against the float64 reference, its backward without a reference-point gradient and its deterministic backward."""
import pytest
import torch

from deform_plugin.ops.msda.functional import fused_multi_scale_deformable_attn

triton = pytest.importorskip("triton")
from deform_plugin.ops.msda.triton_op import fused_multi_scale_deformable_attn_triton  # noqa: E402
from msda_cases import (DEVICE, DTYPES, ENCODER_LEVELS, ON_GPU, TOLERANCE, fused_reference,  # noqa: E402
                        make_fused_case, relative_error)

pytestmark = pytest.mark.usefixtures("poisoned_allocations")


@pytest.mark.parametrize("ref_dim", [2, 4], ids=["points2d", "boxes4d"])
@pytest.mark.parametrize("dtype_name", ["fp32", "fp16", "bf16"])
def test_fused_path_matches_reference(ref_dim, dtype_name):
    dtype = DTYPES[dtype_name]
    levels = [(6, 7), (3, 4), (1, 2)] if not ON_GPU else ENCODER_LEVELS
    queries = 5 if not ON_GPU else 3001
    heads = 2 if not ON_GPU else 8
    value, shapes, starts, reference, offsets, logits = make_fused_case(levels, 2, queries, heads, 16, 3, ref_dim,
                                                                        dtype)
    grad_output = torch.randn(2, queries, heads * 16, generator=torch.Generator().manual_seed(2),
                              dtype=torch.float64).to(device=DEVICE, dtype=dtype)
    inputs = [t.detach().clone().requires_grad_() for t in (value, reference, offsets, logits)]
    out = fused_multi_scale_deformable_attn_triton(inputs[0], shapes, starts, *inputs[1:])
    grads = torch.autograd.grad(out, inputs, grad_output)
    ref_inputs = [t.detach().double().requires_grad_() for t in (value, reference, offsets, logits)]
    ref_out = fused_reference(ref_inputs[0], shapes, starts, *ref_inputs[1:])
    ref_grads = torch.autograd.grad(ref_out, ref_inputs, grad_output.double())
    tol, loc_tol = TOLERANCE[dtype]
    # Reference-point grads sum location grads over heads and points (cancellation): the location limit, doubled.
    limits = (tol, 2 * loc_tol, loc_tol, 2 * tol)
    for name, actual, expected, limit in zip(("output", "value", "reference", "offsets", "logits"),
                                             (out, *grads), (ref_out, *ref_grads), (tol, *limits)):
        assert actual.dtype == dtype
        assert relative_error(actual, expected) <= limit, name


@pytest.mark.parametrize("dtype_name", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("ref_dim", [2, 4], ids=["points2d", "boxes4d"])
def test_fused_backward_without_reference_grad(ref_dim, dtype_name):
    """Constant reference points (the DETRs' encoder) or detached ones (their refining decoders): the kernel stores no
    per-head reference gradient, and the other gradients are those of a call that differentiates the points too."""
    dtype = DTYPES[dtype_name]
    value, shapes, starts, reference, offsets, logits = make_fused_case([(6, 7), (3, 4)], 2, 5, 2, 16, 3, ref_dim,
                                                                        dtype, seed=4)
    grad_output = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype)
    with_reference = [t.detach().clone().requires_grad_() for t in (value, reference, offsets, logits)]
    out = fused_multi_scale_deformable_attn_triton(with_reference[0], shapes, starts, *with_reference[1:])
    expected = torch.autograd.grad(out, with_reference, grad_output)
    without = [t.detach().clone().requires_grad_(i != 1) for i, t in enumerate((value, reference, offsets, logits))]
    out = fused_multi_scale_deformable_attn_triton(without[0], shapes, starts, *without[1:])
    actual = torch.autograd.grad(out, [without[0], without[2], without[3]], grad_output)
    for name, got, want in zip(("value", "offsets", "logits"), actual, (expected[0], *expected[2:])):
        # The GPU's atomics add into grad_value in a varying order (float32 accumulation, rounded once per dtype).
        torch.testing.assert_close(got, want, rtol=1e-6 if dtype == torch.float32 else 1e-2,
                                   atol=1e-7 if dtype == torch.float32 else 1e-3, msg=name)
    from deform_plugin.ops.msda import triton_launch
    grads = triton_launch.fused_msda_backward(grad_output, value, shapes, starts, reference, offsets, logits,
                                              reference_grad=False)
    assert grads[1] is None


def test_fused_functional_entry_point_runs_triton():
    value, shapes, starts, reference, offsets, logits = make_fused_case([(4, 5), (2, 2)], 1, 3, 2, 8, 2, 2,
                                                                        torch.float32)
    out = fused_multi_scale_deformable_attn(value, shapes, starts, reference, offsets, logits, backend="triton")
    expected = fused_reference(value.double(), shapes, starts, reference.double(), offsets.double(),
                               logits.double())
    assert relative_error(out, expected) <= 1e-5


def test_fused_deterministic_backward_is_bit_identical():
    case = make_fused_case([(6, 7), (3, 4)], 2, 5, 2, 8, 2, 4, torch.float32, seed=3)
    grad_output = torch.randn(2, 5, 16, device=DEVICE)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = []
        for _ in range(2):
            inputs = [t.detach().clone().requires_grad_() for t in (case[0], *case[3:])]
            out = fused_multi_scale_deformable_attn_triton(inputs[0], case[1], case[2], *inputs[1:])
            runs.append(torch.autograd.grad(out, inputs, grad_output))
    finally:
        torch.use_deterministic_algorithms(previous)
    for a, b in zip(*runs):
        assert torch.equal(a, b)
