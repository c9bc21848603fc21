"""MSDA test cases and their float64 reference: inputs drawn away from pixel edges and rounded to the tested dtype,
relative errors, and the comparison of the Triton op's output and gradients with the reference.

On a machine without CUDA the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1); the
inputs live on ``DEVICE``.
"""
import pytest
import torch

from deform_plugin.ops.msda.reference import multi_scale_deformable_attn_reference, sampling_locations_from_offsets

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
requires_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device (the interpreter cannot show it)")

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64}
# Relative L2 error against float64 on the same rounded inputs: output and value/weight grads, then location grads
# (looser: they are differences of corner values, rounding-sensitive).
TOLERANCE = {torch.float64: (1e-12, 1e-10), torch.float32: (2e-5, 1e-4), torch.float16: (2e-3, 5e-3),
             torch.bfloat16: (1.5e-2, 3e-2)}
# Deformable-DETR's four encoder levels at 800x1333 (strides 8 to 64).
ENCODER_LEVELS = [(100, 167), (50, 84), (25, 42), (13, 21)]


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
    from deform_plugin.ops.msda.triton_op import multi_scale_deformable_attn_triton
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
