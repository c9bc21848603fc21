"""Samples that read nothing contribute nothing: non-finite values beside them and non-finite locations stay out.

Every backend and entry point ('pytorch' and 'triton', plain and fused) must give, with ``inf``/``NaN`` written into
every value pixel that no sample reads, exactly what it gives with finite values there, and zero gradients to the
samples that read nothing. Pixels "read" are the in-map corners of samples whose pixel coordinate lies in
``(-1, size)`` on both axes (mmcv's CUDA rule): a sample at pixel -1 exactly, whose one in-map corner has weight 0,
reads nothing.

Sampling positions lie on a 1/8-pixel grid, never on an integer pixel except the deliberate edge cases at -1 and
``size``, which are placed only on power-of-two axes: there the location ``(p + 0.5) / size`` and its pixel
coordinate are exact in float32 and float64, so "which corner is read" does not depend on rounding.
"""
from __future__ import annotations

import math

import pytest
import torch

from deform_plugin.ops.msda.functional import fused_multi_scale_deformable_attn, multi_scale_deformable_attn
from deform_plugin.ops.triton_support import triton_unavailable_reason

# (h, w): power-of-two axes (exact edges) and one odd level (positions keep 1/8 px from any integer there).
LEVELS = ((4, 8), (3, 5), (2, 4))
# Two images and two heads: a clamped index that strays into the other image's or head's memory reads poison. Two
# points: the interpreter runs every program's level x point x corner loop (6 samples per query and head, not a power
# of two, so the kernels' sample lanes are masked too).
BATCH, QUERIES, HEADS, HEAD_DIM, POINTS = 2, 5, 2, 3, 2
POISON = (float("inf"), float("-inf"), float("nan"))

# The Triton backend runs on CUDA where there is a GPU, else under the interpreter (tests/conftest.py).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NO_TRITON = triton_unavailable_reason(DEVICE)
BACKENDS = [
    pytest.param("pytorch", id="pytorch"),
    pytest.param("triton", id="triton", marks=pytest.mark.skipif(NO_TRITON is not None, reason=str(NO_TRITON))),
]
DTYPES = {"fp64": torch.float64, "fp32": torch.float32}


def level_tables():
    spatial_shapes = torch.tensor(LEVELS, dtype=torch.long)
    sizes = spatial_shapes.prod(1)
    return spatial_shapes, torch.cat([sizes.new_zeros(1), sizes.cumsum(0)[:-1]]), int(sizes.sum())


def _power_of_two(n: int) -> bool:
    return n & (n - 1) == 0


def _grid_pixel(generator, low: float, high: float) -> float:
    # A pixel coordinate in [low, high] on the 1/8 grid, never an integer.
    eighths = [k for k in range(math.ceil(low * 8), math.floor(high * 8) + 1) if k % 8]
    return eighths[int(torch.randint(len(eighths), (1,), generator=generator))] / 8


def _outside_pixel(generator, size: int) -> float:
    # A coordinate that puts the sample wholly outside on this axis (its other axis may be anywhere).
    choices = [-1.5, -9.25, size + 0.25, size + 3.5]
    if _power_of_two(size):
        choices += [-1.0, float(size)]  # the edges themselves, exact on these axes
    return choices[int(torch.randint(len(choices), (1,), generator=generator))]


def _sample_pixel(kind: str, height: int, width: int, generator):
    """(pixel x, pixel y) of one sample of the given kind, or a non-finite/huge pair for kind 'nonfinite'."""
    draw = lambda low, high: _grid_pixel(generator, low, high)  # noqa: E731
    if kind == "inside":  # all four corners in the map
        return draw(0, width - 1), draw(0, height - 1)
    if kind == "partly":  # corners on both sides of one edge
        axis = int(torch.randint(2, (1,), generator=generator))
        size = (width, height)[axis]
        edge = draw(-1, 0) if torch.rand(1, generator=generator) < 0.5 else draw(size - 1, size)
        other = draw(-1, (height, width)[axis])
        return (edge, other) if axis == 0 else (other, edge)
    if kind == "outside":
        axis = int(torch.randint(2, (1,), generator=generator))
        size = (width, height)[axis]
        # The other axis runs along the map, so the clamped corners would land on border pixels.
        other = draw(-1, (height, width)[axis])
        return (_outside_pixel(generator, size), other) if axis == 0 else (other, _outside_pixel(generator, size))
    # 'nonfinite': x, y or both NaN, +-inf or huge.
    bad = [float("nan"), float("inf"), -float("inf"), 1e30, -1e30]
    pick = lambda: bad[int(torch.randint(len(bad), (1,), generator=generator))]  # noqa: E731
    which = int(torch.randint(3, (1,), generator=generator))
    pixel_x = pick() if which != 1 else draw(0, width - 1)
    pixel_y = pick() if which != 0 else draw(0, height - 1)
    return pixel_x, pixel_y


def _reads(px: float, py: float, height: int, width: int):
    """The in-map pixels ``(row, col)`` a sample reads (empty unless -1 < p < size on both axes)."""
    if not (math.isfinite(px) and math.isfinite(py) and -1 < px < width and -1 < py < height):
        return []
    x0, y0 = math.floor(px), math.floor(py)
    return [(y, x) for y in (y0, y0 + 1) for x in (x0, x0 + 1) if 0 <= x < width and 0 <= y < height]


def make_case(kinds, seed=0):
    """Pixel coordinates of every sample, with the read mask of value rows and the mask of samples that read."""
    generator = torch.Generator().manual_seed(seed)
    spatial_shapes, level_start_index, num_keys = level_tables()
    pixels = torch.empty(BATCH, QUERIES, HEADS, len(LEVELS), POINTS, 2, dtype=torch.float64)
    read_rows = torch.zeros(BATCH, num_keys, HEADS, dtype=torch.bool)
    reading = torch.zeros(BATCH, QUERIES, HEADS, len(LEVELS), POINTS, dtype=torch.bool)
    for index in torch.cartesian_prod(*(torch.arange(n) for n in pixels.shape[:5])).tolist():
        b, _, h, level, _ = index
        height, width = LEVELS[level]
        kind = kinds[int(torch.randint(len(kinds), (1,), generator=generator))]
        px, py = _sample_pixel(kind, height, width, generator)
        pixels[tuple(index)] = torch.tensor([px, py], dtype=torch.float64)
        corners = _reads(px, py, height, width)
        reading[tuple(index)] = bool(corners)
        for row, col in corners:
            read_rows[b, int(level_start_index[level]) + row * width + col, h] = True
    sizes = spatial_shapes.flip(-1).to(torch.float64)  # (w, h) per level
    locations = (pixels + 0.5) / sizes[None, None, None, :, None, :]
    value = torch.randn(BATCH, num_keys, HEADS, HEAD_DIM, generator=generator, dtype=torch.float64)
    poison = torch.tensor(POISON, dtype=torch.float64)[torch.arange(value.numel()) % len(POISON)].view_as(value)
    poisoned = torch.where(read_rows[..., None], value, poison)
    logits = torch.randn(BATCH, QUERIES, HEADS, len(LEVELS), POINTS, generator=generator, dtype=torch.float64)
    return dict(value=value, poisoned=poisoned, locations=locations, logits=logits, reading=reading,
                read_rows=read_rows, spatial_shapes=spatial_shapes, level_start_index=level_start_index)


def run_plain(case, value, backend, dtype):
    weights = case["logits"].flatten(-2).softmax(-1).view_as(case["logits"])
    inputs = [t.to(DEVICE, dtype).requires_grad_() for t in (value, case["locations"], weights)]
    out = multi_scale_deformable_attn(inputs[0], case["spatial_shapes"].to(DEVICE),
                                      case["level_start_index"].to(DEVICE), inputs[1], inputs[2], backend=backend)
    return _with_grads(out, inputs, dtype)


def _with_grads(out, inputs, dtype):
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = torch.autograd.grad(out, inputs, grad_out.to(out.device, dtype))
    return out.cpu(), [grad.cpu() for grad in grads]


def run_fused(case, value, backend, dtype):
    # 2-d reference points on the 1/8 grid; offsets in pixels such that reference + offset / size = location.
    generator = torch.Generator().manual_seed(2)
    reference = torch.randint(0, 9, (BATCH, QUERIES, len(LEVELS), 2), generator=generator).double() / 8
    sizes = case["spatial_shapes"].flip(-1).to(torch.float64)[None, None, None, :, None, :]
    offsets = (case["locations"] - reference[:, :, None, :, None, :]) * sizes
    # Non-finite locations come from non-finite offsets (inf - x stays inf, nan stays nan).
    offsets = torch.where(torch.isfinite(case["locations"]), offsets, case["locations"])
    inputs = [t.to(DEVICE, dtype).requires_grad_() for t in (value, reference, offsets, case["logits"])]
    out = fused_multi_scale_deformable_attn(inputs[0], case["spatial_shapes"].to(DEVICE),
                                           case["level_start_index"].to(DEVICE), *inputs[1:], backend=backend)
    return _with_grads(out, inputs, dtype)


ENTRIES = {"plain": run_plain, "fused": run_fused}


def assert_all_finite(tensors):
    for name, tensor in tensors.items():
        assert torch.isfinite(tensor).all(), f"{name} has {(~torch.isfinite(tensor)).sum().item()} non-finite values"


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_samples_reading_nothing_give_exact_zeros_beside_poisoned_borders(backend, entry, dtype_name):
    """Every sample wholly outside its map (edges -1 and size included) or at a NaN/inf/huge location; every value
    pixel inf/-inf/NaN: the output and every gradient are exactly zero."""
    case = make_case(["outside", "nonfinite"])
    assert not case["reading"].any() and not case["read_rows"].any()
    assert (~torch.isfinite(case["poisoned"])).all()
    out, grads = ENTRIES[entry](case, case["poisoned"], backend, DTYPES[dtype_name])
    assert_all_finite({"output": out, **{f"grad[{i}]": g for i, g in enumerate(grads)}})
    assert (out == 0).all()
    for index, grad in enumerate(grads):
        assert (grad == 0).all(), f"gradient {index} of the {entry} op is not zero: {grad.abs().max()}"


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_poison_in_unread_pixels_changes_nothing(backend, entry, dtype_name):
    """Inside, partly outside (outside corners land on poisoned memory: the neighbouring row, level or border
    pixel a clamped index would read), wholly outside and non-finite samples mixed: poisoning every unread pixel
    gives the same output and gradients as finite values there, and samples that read nothing get zero gradient."""
    dtype = DTYPES[dtype_name]
    case = make_case(["inside", "partly", "partly", "outside", "nonfinite"], seed=3)
    reading = case["reading"]
    assert reading.any() and (~reading).any() and (~case["read_rows"]).sum() > 10
    run = ENTRIES[entry]
    out, grads = run(case, case["poisoned"], backend, dtype)
    clean_out, clean_grads = run(case, case["value"], backend, dtype)
    assert_all_finite({"output": out, **{f"grad[{i}]": g for i, g in enumerate(grads)}})
    assert_all_finite({"clean output": clean_out})
    torch.testing.assert_close(out, clean_out, rtol=0, atol=0)
    for got, want in zip(grads, clean_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert (grads[0][~case["read_rows"]] == 0).all(), "unread value rows received gradient"
    if entry == "plain":
        assert (grads[1][~reading] == 0).all() and (grads[2][~reading] == 0).all()
    else:
        assert (grads[2][~reading] == 0).all(), "offsets of samples that read nothing received gradient"
