"""The Triton MSDA kernels against the float64 reference: forward, all gradients, edge cases, errors.

One file, two scales: on a machine without CUDA the kernels run in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1) at tiny sizes; with CUDA the same tests run at full sizes, and the GPU-only tests run too.
The reference is evaluated in float64 on the same rounded inputs as the kernel (inputs are drawn, rounded to the
tested dtype, then upcast), so the error measured is the kernel's own. Every torch.empty is poisoned with NaN
(tests/ops/msda/conftest.py): an element a kernel forgets to write fails.
"""
import pytest
import torch

from deform_plugin.ops.msda.functional import multi_scale_deformable_attn
from deform_plugin.ops.msda.reference import multi_scale_deformable_attn_reference

triton = pytest.importorskip("triton")
from deform_plugin.ops.msda.triton_op import multi_scale_deformable_attn_triton  # noqa: E402
from msda_cases import (DEVICE, DTYPES, ENCODER_LEVELS, ON_GPU, assert_matches_reference,  # noqa: E402
                        away_from_pixel_edges, level_tables, make_case, reference_with_grads, relative_error,
                        requires_gpu, triton_with_grads)

pytestmark = pytest.mark.usefixtures("poisoned_allocations")


# Named shapes: (levels as (h, w), batch, queries, heads, head_dim, points). Interpreter sizes stay tiny (each
# program costs milliseconds there); on a GPU the same names run at realistic sizes.
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
    # One image and two points: alignment is a property of the pointers, not of the sizes (fewer interpreted programs).
    case = make_case([(6, 7), (3, 4)], 1, 9, 2, 16, 2, dtype)
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


@pytest.mark.skipif(not ON_GPU or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_runs_on_second_cuda_device(monkeypatch):
    """Tensors on cuda:1 while cuda:0 is current: the launch must go to cuda:1 (a known crash elsewhere)."""
    import msda_cases
    monkeypatch.setattr(msda_cases, "DEVICE", torch.device("cuda:1"))
    torch.cuda.set_device(0)
    case = make_case([(6, 7), (3, 4)], 2, 50, 2, 16, 2, torch.float32)
    assert case[0].device == torch.device("cuda:1")
    assert_matches_reference(case, torch.float32)


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
