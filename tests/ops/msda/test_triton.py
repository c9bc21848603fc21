"""The Triton MSDA kernels against the float64 reference: forward, all gradients, fused path, edge cases.

One file, two scales: on a machine without CUDA the kernels run in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1) at tiny sizes; with CUDA the same tests run at full sizes, and the GPU-only tests run too.
The reference is evaluated in float64 on the same rounded inputs as the kernel (inputs are drawn, rounded to the
tested dtype, then upcast), so the error measured is the kernel's own.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from deform_plugin.ops.msda.functional import fused_multi_scale_deformable_attn, multi_scale_deformable_attn
from deform_plugin.ops.msda.reference import multi_scale_deformable_attn_reference, sampling_locations_from_offsets

triton = pytest.importorskip("triton")
from deform_plugin.ops.msda.triton_op import (  # noqa: E402
    fused_multi_scale_deformable_attn_triton,
    multi_scale_deformable_attn_triton,
)

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
requires_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device (the interpreter cannot show it)")

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64}
# Relative L2 error against float64 on the same rounded inputs: output and value/weight grads, then location grads
# (looser: they are differences of corner values, rounding-sensitive).
TOLERANCE = {torch.float64: (1e-12, 1e-10), torch.float32: (2e-5, 1e-4), torch.float16: (2e-3, 5e-3),
             torch.bfloat16: (1.5e-2, 3e-2)}


def level_tables(shapes, device=DEVICE):
    spatial_shapes = torch.tensor(shapes, dtype=torch.long, device=device)
    sizes = spatial_shapes[:, 0] * spatial_shapes[:, 1]
    level_start_index = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)[:-1]])
    return spatial_shapes, level_start_index, int(sizes.sum())


def away_from_pixel_edges(shape, sizes, generator, low=-1.6, margin=0.1):
    """Normalized coordinates whose pixel coordinate is >= ``margin`` from an integer, spanning [low, size - low].

    Bilinear interpolation is not differentiable at integer pixel coordinates; keeping away from them makes the
    float32 and float64 floors agree, so location gradients compare. ``low`` < -1 puts some points fully outside.
    """
    sizes = sizes.to(torch.float64)
    span = sizes - 2 * low
    pixel = low + torch.rand(shape, generator=generator, dtype=torch.float64) * span
    pixel = pixel.floor() + margin + (1 - 2 * margin) * torch.rand(shape, generator=generator, dtype=torch.float64)
    return (pixel + 0.5) / sizes


def make_case(shapes, batch, queries, heads, head_dim, points, dtype, seed=0):
    """Inputs rounded to ``dtype`` on DEVICE: value, spatial_shapes, level_start_index, locations, weights."""
    generator = torch.Generator().manual_seed(seed)
    spatial_shapes, level_start_index, num_keys = level_tables(shapes)
    levels = len(shapes)
    value = torch.randn(batch, num_keys, heads, head_dim, generator=generator, dtype=torch.float64)
    loc_shape = (batch, queries, heads, levels, points)
    widths = spatial_shapes[:, 1].cpu().view(1, 1, 1, levels, 1).expand(loc_shape)
    heights = spatial_shapes[:, 0].cpu().view(1, 1, 1, levels, 1).expand(loc_shape)
    loc_x = away_from_pixel_edges(loc_shape, widths, generator)
    loc_y = away_from_pixel_edges(loc_shape, heights, generator)
    locations = torch.stack([loc_x, loc_y], -1)
    logits = torch.randn(batch, queries, heads, levels * points, generator=generator, dtype=torch.float64)
    weights = logits.softmax(-1).view(batch, queries, heads, levels, points)
    cast = [t.to(device=DEVICE, dtype=dtype) for t in (value, locations, weights)]
    return cast[0], spatial_shapes, level_start_index, cast[1], cast[2]


def relative_error(actual, expected):
    actual = actual.detach().to(torch.float64)
    expected = expected.detach().to(torch.float64)
    assert torch.isfinite(actual).all(), "non-finite values (an unwritten or poisoned element?)"
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def reference_with_grads(value, spatial_shapes, level_start_index, locations, weights, grad_output):
    inputs = [t.detach().to(torch.float64).requires_grad_() for t in (value, locations, weights)]
    out = multi_scale_deformable_attn_reference(inputs[0], spatial_shapes, level_start_index, inputs[1], inputs[2])
    grads = torch.autograd.grad(out, inputs, grad_output.to(torch.float64))
    return out, grads


def triton_with_grads(value, spatial_shapes, level_start_index, locations, weights, grad_output):
    inputs = [t.detach().clone().requires_grad_() for t in (value, locations, weights)]
    out = multi_scale_deformable_attn_triton(inputs[0], spatial_shapes, level_start_index, inputs[1], inputs[2])
    grads = torch.autograd.grad(out, inputs, grad_output)
    return out, grads


def assert_matches_reference(case, dtype, seed=1):
    value, spatial_shapes, level_start_index, locations, weights = case
    out_shape = (value.shape[0], locations.shape[1], value.shape[2] * value.shape[3])
    grad_output = torch.randn(out_shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    grad_output = grad_output.to(device=DEVICE, dtype=dtype)
    out, grads = triton_with_grads(value, spatial_shapes, level_start_index, locations, weights, grad_output)
    ref_out, ref_grads = reference_with_grads(value, spatial_shapes, level_start_index, locations, weights,
                                              grad_output)
    assert out.dtype == value.dtype and out.shape == ref_out.shape
    for grad, source in zip(grads, (value, locations, weights)):
        assert grad.dtype == source.dtype and grad.shape == source.shape
    tol, loc_tol = TOLERANCE[dtype]
    errors = dict(output=relative_error(out, ref_out), grad_value=relative_error(grads[0], ref_grads[0]),
                  grad_locations=relative_error(grads[1], ref_grads[1]),
                  grad_weights=relative_error(grads[2], ref_grads[2]))
    limits = dict(output=tol, grad_value=tol, grad_locations=loc_tol, grad_weights=tol)
    failed = {name: (errors[name], limits[name]) for name in errors if not errors[name] <= limits[name]}
    assert not failed, f"relative error above tolerance (error, limit): {failed}"


@pytest.fixture(autouse=True)
def poisoned_allocations(monkeypatch):
    """Fill every torch.empty/empty_like with NaN (FLA's trick): an element a kernel forgets to write fails."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(tensor):
        if tensor.is_floating_point():
            tensor.fill_(float("nan"))
        return tensor

    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: poison(real_empty(*args, **kwargs)))
    monkeypatch.setattr(torch, "empty_like", lambda *args, **kwargs: poison(real_empty_like(*args, **kwargs)))
    yield


# Named shapes: (levels as (h, w), batch, queries, heads, head_dim, points). Interpreter sizes stay tiny (each
# program costs milliseconds there); on a GPU the same names run at realistic sizes.
ENCODER_LEVELS = [(100, 167), (50, 84), (25, 42), (13, 21)]
if ON_GPU:
    SHAPES = {
        "B2-L4-P4-D32": (ENCODER_LEVELS, 2, 5000, 8, 32, 4),
        "B1-L1x1-P4-D32": ([(1, 1)], 1, 1000, 8, 32, 4),
        "B2-thin1xW-Hx1-P4-D32": ([(1, 97), (89, 1)], 2, 777, 4, 32, 4),
        "B3-odd-L3-P3-D24": ([(37, 53), (19, 27), (7, 11)], 3, 1531, 5, 24, 3),
        "B2-L5-P8-D32": ([(64, 96), (32, 48), (16, 24), (8, 12), (4, 6)], 2, 1999, 8, 32, 8),
        "B1-L2-P4-D48": ([(40, 60), (20, 30)], 1, 1001, 4, 48, 4),
        "B2-L2-P2-D256": ([(24, 33), (12, 17)], 2, 301, 2, 256, 2),
        "B1-L2-P1-D8": ([(33, 47), (9, 13)], 1, 4097, 16, 8, 1),
    }
else:
    SHAPES = {
        "B2-L4-P4-D32": ([(6, 7), (3, 4), (2, 2), (1, 1)], 2, 5, 1, 32, 4),
        "B1-L1x1-P4-D32": ([(1, 1)], 1, 7, 2, 32, 4),
        "B2-thin1xW-Hx1-P4-D32": ([(1, 9), (7, 1)], 2, 6, 1, 32, 4),
        "B3-odd-L3-P3-D24": ([(5, 7), (3, 3), (1, 2)], 3, 5, 1, 24, 3),
        "B2-L5-P8-D32": ([(4, 5), (3, 3), (2, 3), (2, 1), (1, 1)], 1, 3, 1, 32, 8),
        "B1-L2-P4-D48": ([(5, 6), (2, 3)], 1, 4, 1, 48, 4),
        "B2-L2-P2-D256": ([(3, 4), (2, 2)], 2, 3, 1, 256, 2),
        "B1-L2-P1-D8": ([(5, 7), (3, 2)], 1, 19, 3, 8, 1),
    }

CASES = [pytest.param(name, dtype_name, id=f"{name}-{dtype_name}")
         for name in SHAPES for dtype_name in ("fp32", "bf16")]
CASES += [pytest.param(name, "fp16", id=f"{name}-fp16") for name in ("B2-L4-P4-D32", "B3-odd-L3-P3-D24")]
CASES += [pytest.param("B2-L4-P4-D32", "fp64", id="B2-L4-P4-D32-fp64")]


@pytest.mark.parametrize("name, dtype_name", CASES)
def test_forward_and_gradients_match_float64_reference(name, dtype_name):
    levels, batch, queries, heads, head_dim, points = SHAPES[name]
    dtype = DTYPES[dtype_name]
    case = make_case(levels, batch, queries, heads, head_dim, points, dtype)
    assert_matches_reference(case, dtype)


@pytest.mark.parametrize("dtype_name", ["fp16", "bf16"])
def test_half_output_error_at_most_twice_rounding(dtype_name):
    """Issue 3, point 8: the kernel's 16-bit output is no worse than twice merely rounding the exact result."""
    dtype = DTYPES[dtype_name]
    levels, batch, queries, heads, head_dim, points = SHAPES["B2-L4-P4-D32"]
    value, shapes, starts, locations, weights = make_case(levels, batch, queries, heads, head_dim, points, dtype)
    out = multi_scale_deformable_attn_triton(value, shapes, starts, locations, weights)
    exact = multi_scale_deformable_attn_reference(value.double(), shapes, starts, locations.double(),
                                                  weights.double())
    rounding = relative_error(exact.to(dtype), exact)
    assert relative_error(out, exact) <= 2 * rounding


def test_points_outside_the_map_contribute_zero():
    """Every location is outside all four corners' reach: the output and value grad must be exactly zero."""
    value, shapes, starts, locations, weights = make_case([(4, 5), (2, 3)], 2, 6, 2, 16, 2, torch.float32)
    outside = torch.tensor([-0.6, 1.7], device=DEVICE)   # pixel < -1 or >= size in every level
    locations = outside[torch.randint(0, 2, locations.shape, generator=torch.Generator().manual_seed(3))
                        .to(DEVICE)]
    out, (grad_value, grad_locations, grad_weights) = triton_with_grads(
        value, shapes, starts, locations, weights, torch.ones(2, 6, 32, device=DEVICE))
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(grad_value, torch.zeros_like(grad_value))
    assert torch.equal(grad_locations, torch.zeros_like(grad_locations))
    assert torch.equal(grad_weights, torch.zeros_like(grad_weights))


def test_partially_outside_points_match_reference():
    """Points in the one-pixel border band, where some corners are inside and some zero-padded."""
    generator = torch.Generator().manual_seed(5)
    value, shapes, starts, locations, weights = make_case([(5, 6), (3, 3)], 1, 8, 2, 16, 3, torch.float32)
    sizes = torch.stack([shapes[:, 1], shapes[:, 0]], -1).view(1, 1, 1, 2, 1, 2).double().cpu()
    # pixel in (-1, -0.1) or (size - 0.9, size): exactly one row or column of corners is inside.
    low_band = -0.9 + 0.7 * torch.rand(locations.shape, generator=generator, dtype=torch.float64)
    high_band = sizes - 0.8 + 0.6 * torch.rand(locations.shape, generator=generator, dtype=torch.float64)
    pixel = torch.where(torch.rand(locations.shape, generator=generator) < 0.5, low_band, high_band)
    locations = ((pixel + 0.5) / sizes).to(device=DEVICE, dtype=torch.float32)
    assert_matches_reference((value, shapes, starts, locations, weights), torch.float32)


def test_nan_and_infinite_locations_contribute_zero_with_zero_gradient():
    value, shapes, starts, locations, weights = make_case([(4, 5), (2, 3)], 2, 5, 2, 8, 2, torch.float32)
    bad = torch.tensor([float("nan"), float("inf"), -float("inf")], device=DEVICE)
    locations = locations.clone()
    locations[0, 0, 0, 0, 0, 0] = bad[0]
    locations[0, 1, 1, 1, 1, 1] = bad[1]
    locations[1, 2, 0, 0, 1, 0] = bad[2]
    locations[1, 3, 1, 1, 0] = bad[0]
    grad_output = torch.randn(2, 5, 16, device=DEVICE)
    out, grads = triton_with_grads(value, shapes, starts, locations, weights, grad_output)
    ref_out, ref_grads = reference_with_grads(value, shapes, starts, locations, weights, grad_output)
    for actual, expected in zip((out, *grads), (ref_out, *ref_grads)):
        assert relative_error(actual, expected) <= 1e-4
    grad_locations = grads[1]
    for index in ((0, 0, 0, 0, 0), (0, 1, 1, 1, 1), (1, 2, 0, 0, 1), (1, 3, 1, 1, 0)):
        assert torch.equal(grad_locations[index], torch.zeros(2, device=DEVICE))


def test_non_contiguous_inputs():
    value, shapes, starts, locations, weights = make_case([(5, 6), (3, 2)], 2, 7, 3, 12, 2, torch.float32)
    # (B, H, S, D) storage seen as (B, S, H, D); locations and weights as strided slices of larger tensors.
    value_nc = value.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    locations_nc = locations.transpose(1, 2).contiguous().transpose(1, 2)
    weights_nc = weights.transpose(0, 1).contiguous().transpose(0, 1)
    assert not value_nc.is_contiguous() and not locations_nc.is_contiguous() and not weights_nc.is_contiguous()
    assert_matches_reference((value_nc, shapes, starts, locations_nc, weights_nc), torch.float32)


def _offset_by_one_element(tensor):
    # The same values in storage one element past an allocation's start: the data pointer loses 16-byte alignment.
    storage = torch.empty(tensor.numel() + 1, dtype=tensor.dtype, device=tensor.device)
    return storage[1:].view_as(tensor).copy_(tensor)


@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
def test_unaligned_inputs_after_aligned_ones(dtype_name):
    """Triton compiles a variant per pointer alignment; a launch must never reuse an aligned variant for unaligned
    pointers (on a GPU the launches after the first skip Triton's own specialisation)."""
    dtype = DTYPES[dtype_name]
    case = make_case([(6, 7), (3, 4)], 2, 9, 2, 16, 3, dtype)
    for _ in range(2):  # the aligned variant first, twice
        assert_matches_reference(case, dtype)
    value, shapes, starts, locations, weights = case
    unaligned = (_offset_by_one_element(value), shapes, starts, _offset_by_one_element(locations),
                 _offset_by_one_element(weights))
    assert all(t.data_ptr() % 16 for t in (unaligned[0], unaligned[3], unaligned[4]))
    for _ in range(2):
        assert_matches_reference(unaligned, dtype)


@pytest.mark.parametrize("dtype_name", ["fp16", "bf16"])
def test_mixed_dtypes_as_under_autocast(dtype_name):
    """Under autocast value arrives in 16 bits while locations stay float32: gradients keep each input's dtype."""
    dtype = DTYPES[dtype_name]
    value, shapes, starts, locations, weights = make_case([(5, 6), (3, 2)], 2, 7, 2, 16, 2, dtype)
    locations = locations.float()
    assert_matches_reference((value, shapes, starts, locations, weights), dtype)


def make_fused_case(levels, batch, queries, heads, head_dim, points, ref_dim, dtype, seed=0):
    """Reference points (or boxes) and offsets whose sampling pixels stay >= 0.1 px from integers, as in
    :func:`make_case`: offsets are solved from target locations, then everything is rounded to ``dtype``."""
    generator = torch.Generator().manual_seed(seed)
    spatial_shapes, level_start_index, num_keys = level_tables(levels)
    num_levels = len(levels)
    value = torch.randn(batch, num_keys, heads, head_dim, generator=generator, dtype=torch.float64)
    reference = 0.1 + 0.8 * torch.rand(batch, queries, num_levels, ref_dim, generator=generator, dtype=torch.float64)
    if ref_dim == 4:
        reference[..., 2:] = 0.05 + 0.3 * reference[..., 2:]
    loc_shape = (batch, queries, heads, num_levels, points)
    sizes = torch.tensor(levels, dtype=torch.float64)                       # (L, 2) as (h, w)
    wh = torch.stack([sizes[:, 1], sizes[:, 0]], -1).view(1, 1, 1, num_levels, 1, 2)
    # Targets: ~2 px Gaussian around the reference, snapped into [floor + 0.1, floor + 0.9] of a pixel.
    ref_xy = reference[:, :, None, :, None, :2]
    pixel = ref_xy * wh - 0.5 + 2.0 * torch.randn(*loc_shape, 2, generator=generator, dtype=torch.float64)
    pixel = pixel.floor() + 0.1 + 0.8 * torch.rand(*loc_shape, 2, generator=generator, dtype=torch.float64)
    target = (pixel + 0.5) / wh
    if ref_dim == 2:
        offsets = (target - ref_xy) * wh
    else:
        offsets = (target - ref_xy) * points * 2.0 / reference[:, :, None, :, None, 2:]
    logits = torch.randn(batch, queries, heads, num_levels, points, generator=generator, dtype=torch.float64)
    cast = [t.to(device=DEVICE, dtype=dtype) for t in (value, reference, offsets, logits)]
    return cast[0], spatial_shapes, level_start_index, cast[1], cast[2], cast[3]


def fused_reference(value, spatial_shapes, level_start_index, reference, offsets, logits):
    weights = logits.flatten(-2).softmax(-1).view_as(logits)
    locations = sampling_locations_from_offsets(reference, offsets, spatial_shapes)
    return multi_scale_deformable_attn_reference(value, spatial_shapes, level_start_index, locations, weights)


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


@pytest.mark.parametrize("batch, queries", [(0, 4), (2, 0)], ids=["B0", "Q0"])
def test_empty_batch_or_queries(batch, queries):
    value, shapes, starts, locations, weights = make_case([(3, 4)], max(batch, 1), max(queries, 1), 2, 8, 2,
                                                          torch.float32)
    value = value[:batch].requires_grad_()
    locations = locations[:batch, :queries].requires_grad_()
    weights = weights[:batch, :queries].requires_grad_()
    out = multi_scale_deformable_attn(value, shapes, starts, locations, weights, backend="triton")
    assert out.shape == (batch, queries, 16)
    # The op itself (as a compiled graph would call it) also accepts empty inputs.
    direct = multi_scale_deformable_attn_triton(value, shapes, starts, locations, weights)
    assert direct.shape == (batch, queries, 16)
    grads = torch.autograd.grad(direct.sum(), (value, locations, weights), allow_unused=True)
    assert all(g is None or g.numel() == 0 or torch.all(g == 0) for g in grads)


def test_deterministic_backward_is_bit_identical_and_correct():
    levels, batch, queries, heads, head_dim, points = SHAPES["B2-L4-P4-D32"]
    case = make_case(levels, batch, queries, heads, head_dim, points, torch.float32, seed=7)
    grad_output = torch.randn(batch, queries, heads * head_dim, device=DEVICE)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        _, first = triton_with_grads(*case, grad_output)
        _, second = triton_with_grads(*case, grad_output)
        assert_matches_reference(case, torch.float32)
    finally:
        torch.use_deterministic_algorithms(previous)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    _, default_path = triton_with_grads(*case, grad_output)
    assert relative_error(first[0], default_path[0]) <= 1e-6


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


def test_index_dtype_follows_the_largest_tensor():
    """int32 index arithmetic only where no tensor of the launch can overflow it (element counts of value, the
    per-sample tensors and the output)."""
    from deform_plugin.ops.msda.triton_launch import _INT32_INDEX_MAX_NUMEL, _index_dtype

    small, large = 1000, _INT32_INDEX_MAX_NUMEL + 1
    assert _index_dtype(small, small, small) == triton.language.int32
    assert _index_dtype(large, small, small) == triton.language.int64
    assert _index_dtype(small, small, large) == triton.language.int64
    # The deterministic backward writes two entries per location element.
    assert _index_dtype(small, _INT32_INDEX_MAX_NUMEL // 2 + 1, small) == triton.language.int64
    assert _index_dtype(small, _INT32_INDEX_MAX_NUMEL // 2, small) == triton.language.int32


def test_forward_blocks_give_each_thread_one_16_byte_load_per_row():
    """The forward takes 4 queries of 32 float32 channels (8 in 16-bit); the backward 8 in every dtype; neither
    depends on the query count."""
    from deform_plugin.ops.msda.triton_launch import choose_config

    assert choose_config(32, forward_element_size=4).block_q == 4
    assert choose_config(32, forward_element_size=2).block_q == 8
    assert choose_config(32, forward_element_size=8).block_q == 2
    assert choose_config(32).block_q == 8
    assert choose_config(64, forward_element_size=2).block_q == 4
    assert choose_config(16, forward_element_size=4).block_q == 8
    for config in (choose_config(32, forward_element_size=4), choose_config(32)):
        assert config.num_warps == 1 and config.block_d == 32


@pytest.mark.parametrize("dtype_name, block_q", [("fp32", 4), ("bf16", 8)])
def test_launch_plans_follow_the_chosen_blocks(dtype_name, block_q):
    """A call's kept launch plan (default blocks: config None) holds the forward's and the backward's grid."""
    from deform_plugin.ops.msda import triton_launch

    value, shapes, starts, locations, weights = make_case([(6, 7), (3, 4)], 2, 13, 2, 32, 2, DTYPES[dtype_name],
                                                          seed=8)
    grad_output = torch.randn(2, 13, 64, generator=torch.Generator().manual_seed(9)).to(value)
    triton_launch.msda_forward(value, shapes, starts, locations, weights)
    triton_launch.msda_backward(grad_output, value, shapes, starts, locations, weights)
    grids = {key[0]: plan.grid for key, plan in triton_launch._plans.items()
             if key[1] is None and key[2] == value.shape and key[3] == value.dtype and key[5] == locations.shape}
    assert grids == {"forward": (-(-13 // block_q), 2, 2), "backward": (2, 2, 2)}


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_int64_indexing_gives_the_same_results(fused, monkeypatch):
    """The int64 variant (for tensors past 2^30 elements) computes what the int32 one does: exactly, but for the
    order in which a GPU's atomics add into grad_value."""
    from deform_plugin.ops.msda import triton_launch

    if fused:
        case = make_fused_case([(6, 7), (3, 4)], 2, 5, 2, 8, 2, 4, torch.float32, seed=5)
        value, shapes, starts, extra = case[0], case[1], case[2], case[3:]
        forward, backward = triton_launch.fused_msda_forward, triton_launch.fused_msda_backward
    else:
        value, shapes, starts, *extra = make_case([(6, 7), (3, 4)], 2, 5, 2, 8, 2, torch.float32, seed=5)
        forward, backward = triton_launch.msda_forward, triton_launch.msda_backward
    grad_output = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(6)).to(DEVICE)

    def run(config=None):
        return (forward(value, shapes, starts, *extra, config=config),
                *backward(grad_output, value, shapes, starts, *extra, config=config))
    int32_results = run()
    monkeypatch.setattr(triton_launch, "_INT32_INDEX_MAX_NUMEL", 0)
    monkeypatch.setattr(triton_launch, "_plans", {})  # the plans kept by the int32 run chose int32
    int64_results = run()
    constexprs = [plan.variant[-1] for plan in triton_launch._plans.values()]
    assert constexprs and all(triton.language.int64 in c and triton.language.int32 not in c for c in constexprs)
    grad_value_index = 1
    for index, (a, b) in enumerate(zip(int32_results, int64_results)):
        if index == grad_value_index and ON_GPU:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(a, b)


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


@pytest.mark.skipif(not ON_GPU or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_runs_on_second_cuda_device():
    """Tensors on cuda:1 while cuda:0 is current: the launch must go to cuda:1 (a known crash elsewhere)."""
    global DEVICE
    saved = DEVICE
    DEVICE = torch.device("cuda:1")
    try:
        torch.cuda.set_device(0)
        case = make_case([(6, 7), (3, 4)], 2, 50, 2, 16, 2, torch.float32)
        assert case[0].device == torch.device("cuda:1")
        assert_matches_reference(case, torch.float32)
    finally:
        DEVICE = saved


@requires_gpu
def test_value_with_more_than_2_31_elements():
    """int64 addressing: image 1 of a value tensor of 2^31 + elements starts past element 2^31; its samples (in the
    last rows of the map) read and write correctly. The reference runs on a crop of those rows."""
    batch, heads, head_dim = 2, 8, 256
    height, width, crop = 512, 1100, 16        # 2 x 563200 keys x 2048 channels = 2.3e9 elements
    assert batch * height * width * heads * head_dim > 2 ** 31
    value = torch.randn(batch, height * width, heads, head_dim, device=DEVICE)
    shapes, starts, _ = level_tables([(height, width)])
    queries, points = 64, 2
    generator = torch.Generator().manual_seed(11)
    loc_shape = (batch, queries, heads, 1, points)
    loc_x = away_from_pixel_edges(loc_shape, torch.full(loc_shape, width), generator, low=0.2)
    crop_y = away_from_pixel_edges(loc_shape, torch.full(loc_shape, crop), generator, low=0.2)
    loc_y = (crop_y * crop + (height - crop)) / height
    locations = torch.stack([loc_x, loc_y], -1).to(device=DEVICE, dtype=torch.float32)
    # The crop's coordinates from the rounded float32 locations, so both sides see the same points.
    rounded = locations.double()
    crop_locations = torch.stack([rounded[..., 0], (rounded[..., 1] * height - (height - crop)) / crop], -1)
    weights = torch.rand(batch, queries, heads, 1, points, device=DEVICE)
    value.requires_grad_()
    out = multi_scale_deformable_attn_triton(value, shapes, starts, locations, weights)
    grad_output = torch.randn_like(out)
    (grad_value,) = torch.autograd.grad(out, value, grad_output)
    tail = slice(height * width - crop * width, height * width)
    crop_value = value.detach()[:, tail].double().requires_grad_()
    crop_shapes, crop_starts, _ = level_tables([(crop, width)])
    expected = multi_scale_deformable_attn_reference(crop_value, crop_shapes, crop_starts, crop_locations,
                                                     weights.double())
    (expected_grad,) = torch.autograd.grad(expected, crop_value, grad_output.double())
    # float32 pixel coordinates of a 1100-wide map carry ~1e-4 px of rounding; wrong addressing would be O(1).
    errors = relative_error(out, expected), relative_error(grad_value[:, tail], expected_grad)
    assert max(errors) <= 1e-4, errors
    assert grad_value[:, :tail.start].abs().max().item() == 0.0


@requires_gpu
def test_locations_with_more_than_2_31_elements():
    """int64 addressing on the query side: 2^31 + location elements; the last queries are checked."""
    heads, head_dim, points = 16, 8, 4
    queries = 2 ** 31 // (heads * points * 2) + 1000
    shapes, starts, num_keys = level_tables([(13, 17)])
    value = torch.randn(1, num_keys, heads, head_dim, device=DEVICE, dtype=torch.float16)
    locations = torch.rand(1, queries, heads, 1, points, 2, device=DEVICE, dtype=torch.float16)
    weights = torch.rand(1, queries, heads, 1, points, device=DEVICE, dtype=torch.float16)
    assert locations.numel() > 2 ** 31
    out = multi_scale_deformable_attn_triton(value, shapes, starts, locations, weights)
    tail = slice(queries - 777, queries)
    expected = multi_scale_deformable_attn_reference(value.double(), shapes, starts, locations[:, tail].double(),
                                                     weights[:, tail].double())
    assert relative_error(out[:, tail], expected) <= 2e-3


@pytest.mark.parametrize("bad, message", [
    ("value_dim", "value must be"),
    ("weights_shape", "attention_weights has shape"),
    ("keys", "cover"),
    ("dtype", "floating tensor"),
])
def test_wrong_inputs_raise_clear_errors(bad, message):
    value, shapes, starts, locations, weights = make_case([(3, 4), (2, 2)], 1, 3, 2, 8, 2, torch.float32)
    if bad == "value_dim":
        value = value[0]
    elif bad == "weights_shape":
        weights = weights[..., :1]
    elif bad == "keys":
        value = value[:, :-1]
    elif bad == "dtype":
        locations = locations.to(torch.int32)
    with pytest.raises((ValueError, TypeError), match=message):
        multi_scale_deformable_attn(value, shapes, starts, locations, weights, backend="triton")


@requires_gpu
def test_mixed_devices_raise():
    value, shapes, starts, locations, weights = make_case([(3, 4)], 1, 3, 2, 8, 2, torch.float32)
    with pytest.raises(ValueError, match="one device"):
        multi_scale_deformable_attn(value, shapes, starts, locations.cpu(), weights, backend="triton")


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
