"""The PyTorch reference op (the specification) against an independent float64 computation, and its input checks."""
import math

import pytest
import torch

from deform_plugin.ops import multi_scale_deformable_attn, multi_scale_deformable_attn_reference
from deform_plugin.ops.backend import default_backend, resolve_backend
from deform_plugin.ops.triton_support import triton_unavailable_reason


def level_tables(shapes):
    spatial_shapes = torch.tensor(shapes, dtype=torch.long)
    sizes = spatial_shapes[:, 0] * spatial_shapes[:, 1]
    level_start_index = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)[:-1]])
    return spatial_shapes, level_start_index, int(sizes.sum())


def make_inputs(shapes, batch=2, queries=5, heads=3, head_dim=4, points=2, dtype=torch.float64, seed=0,
                low=-0.15, high=1.15):
    generator = torch.Generator().manual_seed(seed)
    spatial_shapes, level_start_index, num_keys = level_tables(shapes)
    levels = len(shapes)
    value = torch.randn(batch, num_keys, heads, head_dim, generator=generator, dtype=dtype)
    locations = torch.rand(batch, queries, heads, levels, points, 2, generator=generator, dtype=dtype)
    locations = low + (high - low) * locations
    weights = torch.rand(batch, queries, heads, levels, points, generator=generator, dtype=dtype)
    return value, spatial_shapes, level_start_index, locations, weights


def naive_msda(value, spatial_shapes, level_start_index, locations, weights):
    """Scalar loops over every sample and corner: slow, obviously right, independent of the reference's tensors."""
    batch, _, heads, head_dim = value.shape
    _, queries, _, levels, points, _ = locations.shape
    out = torch.zeros(batch, queries, heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        for q in range(queries):
            for h in range(heads):
                for lvl in range(levels):
                    height, width = spatial_shapes[lvl].tolist()
                    start = int(level_start_index[lvl])
                    for p in range(points):
                        x, y = locations[b, q, h, lvl, p].tolist()
                        if not (math.isfinite(x) and math.isfinite(y)):
                            continue
                        px, py = x * width - 0.5, y * height - 0.5
                        x0, y0 = math.floor(px), math.floor(py)
                        for cy, wy in ((y0, 1 - (py - y0)), (y0 + 1, py - y0)):
                            for cx, wx in ((x0, 1 - (px - x0)), (x0 + 1, px - x0)):
                                if 0 <= cx < width and 0 <= cy < height:
                                    row = value[b, start + cy * width + cx, h].double()
                                    out[b, q, h] += weights[b, q, h, lvl, p].double() * wx * wy * row
    return out.reshape(batch, queries, heads * head_dim)


SHAPES = {
    "L1-1x1": [[1, 1]],
    "L1-1xW": [[1, 7]],
    "L1-Hx1": [[5, 1]],
    "L3-odd": [[7, 5], [3, 4], [2, 3]],
    "L5": [[9, 11], [5, 6], [3, 3], [2, 2], [1, 1]],
}


@pytest.mark.parametrize("shapes", SHAPES.values(), ids=SHAPES.keys())
def test_forward_matches_naive_float64(shapes):
    inputs = make_inputs(shapes)
    expected = naive_msda(*inputs)
    got = multi_scale_deformable_attn_reference(*inputs)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shapes", [SHAPES["L3-odd"], SHAPES["L1-1xW"]], ids=["L3-odd", "L1-1xW"])
def test_gradients_match_finite_differences(shapes):
    value, spatial_shapes, level_start_index, locations, weights = make_inputs(shapes, batch=1, queries=3, heads=2,
                                                                               head_dim=3)
    # Keep points >= 0.1 px from integer pixel coordinates: the bilinear gradient jumps there.
    for level, (height, width) in enumerate(spatial_shapes.tolist()):
        for axis, size in ((0, width), (1, height)):
            pixel = locations[:, :, :, level, :, axis] * size - 0.5
            frac = pixel - pixel.floor()
            pixel = pixel.floor() + frac.clamp(0.1, 0.9)
            locations[:, :, :, level, :, axis] = (pixel + 0.5) / size
    tensors = [t.clone().requires_grad_() for t in (value, locations, weights)]

    def fn(v, loc, w):
        return multi_scale_deformable_attn_reference(v, spatial_shapes, level_start_index, loc, w)

    assert torch.autograd.gradcheck(fn, tensors, eps=1e-7, atol=1e-6)


def test_nan_inf_and_outside_locations_contribute_zero():
    value, spatial_shapes, level_start_index, locations, weights = make_inputs(SHAPES["L3-odd"], queries=6)
    locations[0, 0, 0, 0, 0, 0] = float("nan")
    locations[0, 1, 1, 1, 1, 1] = float("inf")
    locations[1, 2, 2, 2, 0, 0] = -float("inf")
    locations[1, 3, 0, 0, 1] = 1e30
    locations[1, 4, 1, 1, 0] = torch.tensor([-0.6, 1.7], dtype=torch.float64)  # wholly outside its level
    bad = ~torch.isfinite(locations).all(-1) | (locations.abs() > 1.5).any(-1)
    assert bad.sum() == 5
    tensors = [t.clone().requires_grad_() for t in (value, locations, weights)]
    out = multi_scale_deformable_attn_reference(tensors[0], spatial_shapes, level_start_index, *tensors[1:])
    assert torch.isfinite(out).all()
    # The same call with those samples' weights set to zero must give the same output.
    zeroed = weights.masked_fill(bad, 0.0)
    expected = multi_scale_deformable_attn_reference(value, spatial_shapes, level_start_index,
                                                     torch.where(bad[..., None], 0.5, locations), zeroed)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(out.square().sum(), tensors)
    for grad in grads:
        assert torch.isfinite(grad).all()
    assert (grads[1][bad] == 0).all() and (grads[2][bad] == 0).all()


def test_half_precision_computes_in_float32():
    inputs64 = make_inputs(SHAPES["L3-odd"], head_dim=8)
    value, spatial_shapes, level_start_index, locations, weights = inputs64
    for dtype in (torch.float16, torch.bfloat16):
        rounded = [t.to(dtype) for t in (value, locations, weights)]
        out = multi_scale_deformable_attn_reference(rounded[0], spatial_shapes, level_start_index, *rounded[1:])
        assert out.dtype == dtype
        exact = naive_msda(rounded[0].double(), spatial_shapes, level_start_index, rounded[1].double(),
                           rounded[2].double())
        # fp32 math: the only error left is the final rounding to the storage dtype.
        rounding = (exact.to(dtype).double() - exact).abs().max()
        assert (out.double() - exact).abs().max() <= 2 * rounding + 1e-6


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_gradients_computed_in_float32(dtype):
    value, spatial_shapes, level_start_index, locations, weights = make_inputs(SHAPES["L3-odd"], head_dim=8)
    rounded = [t.to(dtype).requires_grad_() for t in (value, locations, weights)]
    exact = [t.detach().double().requires_grad_() for t in rounded]
    grad_output = torch.randn(2, 5, 3 * 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out = multi_scale_deformable_attn_reference(rounded[0], spatial_shapes, level_start_index, *rounded[1:])
    grads = torch.autograd.grad(out, rounded, grad_output.to(dtype))
    exact_out = multi_scale_deformable_attn_reference(exact[0], spatial_shapes, level_start_index, *exact[1:])
    exact_grads = torch.autograd.grad(exact_out, exact, grad_output.to(dtype).double())
    for grad, want, source in zip(grads, exact_grads, rounded):
        assert grad.dtype == dtype and grad.shape == source.shape
        # float32 math: what is left is the final rounding of each gradient to the storage dtype.
        rounding = (want.to(dtype).double() - want).abs().max()
        assert (grad.double() - want).abs().max() <= 2 * rounding + 1e-6


def test_level_tables_as_tensors_or_host_sequences():
    value, spatial_shapes, level_start_index, locations, weights = make_inputs(SHAPES["L3-odd"])
    from_tensors = multi_scale_deformable_attn_reference(value, spatial_shapes, level_start_index, locations,
                                                         weights)
    host_shapes = tuple(tuple(row) for row in spatial_shapes.tolist())
    from_host = multi_scale_deformable_attn_reference(value, host_shapes, tuple(level_start_index.tolist()),
                                                      locations, weights)
    assert torch.equal(from_tensors, from_host)


def test_backward_keeps_only_the_inputs():
    """The reference saves value, locations and weights for its backward, nothing else: it recomputes the corners.

    A regression guard on memory that does not time anything: autograd through the corner gathers used to keep
    4 * L gathered (B*H, Q*P, D) tensors.
    """
    value, spatial_shapes, level_start_index, locations, weights = make_inputs(SHAPES["L5"], queries=40, points=4)
    inputs = [t.requires_grad_() for t in (value, locations, weights)]
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = multi_scale_deformable_attn_reference(inputs[0], spatial_shapes, level_start_index, *inputs[1:])
    assert sum(saved) <= sum(t.numel() * t.element_size() for t in inputs)
    grads = torch.autograd.grad(out.sum(), inputs)
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("batch,queries", [(0, 4), (2, 0)], ids=["B0", "Q0"])
def test_empty_batch_or_queries(batch, queries):
    inputs = make_inputs(SHAPES["L3-odd"], batch=batch, queries=queries)
    out = multi_scale_deformable_attn(*inputs, backend="pytorch")
    assert out.shape == (batch, queries, 3 * 4)


def test_public_op_uses_reference_on_cpu_by_default():
    inputs = make_inputs(SHAPES["L3-odd"])
    with default_backend("auto"):
        torch.testing.assert_close(multi_scale_deformable_attn(*inputs), naive_msda(*inputs))


BAD_CALLS = {
    "value-length": (lambda v, s, i, l, w: (v[:, :-1], s, i, l, w), r"cover 53 keys but value has 52"),
    "levels": (lambda v, s, i, l, w: (v, s[:2], i[:2], l, w),
               r"spatial_shapes has 2 levels but sampling_locations has 3"),
    "heads": (lambda v, s, i, l, w: (v[:, :, :2], s, i, l, w), r"sampling_locations has 3 heads but value has 2"),
    "points": (lambda v, s, i, l, w: (v, s, i, l, w[..., :1]), r"attention_weights has shape .* implies"),
    "last-dim": (lambda v, s, i, l, w: (v, s, i, l[..., :1], w), r"last dim 1"),
    "batch": (lambda v, s, i, l, w: (v[:1], s, i, l, w), r"sampling_locations has batch 2 but value has batch 1"),
    "start-index": (lambda v, s, i, l, w: (v, s, i + 1, l, w), r"level_start_index\[0\] = 1"),
    "value-rank": (lambda v, s, i, l, w: (v.flatten(2), s, i, l, w), r"value must be \(batch, num_keys"),
}


@pytest.mark.parametrize("case", BAD_CALLS.values(), ids=BAD_CALLS.keys())
def test_bad_shapes_raise_value_error_naming_values(case):
    mutate, message = case
    inputs = make_inputs(SHAPES["L3-odd"])
    with pytest.raises(ValueError, match=message):
        multi_scale_deformable_attn(*mutate(*inputs), backend="pytorch")


def test_bad_dtypes_and_backends_raise():
    value, spatial_shapes, level_start_index, locations, weights = make_inputs(SHAPES["L3-odd"])
    with pytest.raises(TypeError, match="value must be a floating tensor"):
        multi_scale_deformable_attn(value.long(), spatial_shapes, level_start_index, locations, weights)
    with pytest.raises(TypeError, match="spatial_shapes must be an integer tensor"):
        multi_scale_deformable_attn(value, spatial_shapes.float(), level_start_index, locations, weights)
    with pytest.raises(ValueError, match="msda has no backend 'cuda'"):
        multi_scale_deformable_attn(value, spatial_shapes, level_start_index, locations, weights, backend="cuda")
    with pytest.raises(RuntimeError, match="backend='mmcv'"):
        multi_scale_deformable_attn(value, spatial_shapes, level_start_index, locations, weights, backend="mmcv")


def test_triton_backend_on_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="need a CUDA device"):
        resolve_backend("msda", "triton", torch.device("cpu"))
    assert resolve_backend("msda", "auto", torch.device("cpu")) == "pytorch"


def _fused_inputs(levels=((3, 4), (2, 2)), batch=1, queries=3, heads=2, head_dim=8, points=2):
    generator = torch.Generator().manual_seed(0)
    shapes = torch.tensor(levels)
    sizes = shapes.prod(1)
    starts = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)[:-1]])
    value = torch.randn(batch, int(sizes.sum()), heads, head_dim, generator=generator)
    reference = torch.rand(batch, queries, len(levels), 2, generator=generator)
    offsets = torch.randn(batch, queries, heads, len(levels), points, 2, generator=generator)
    logits = torch.randn(batch, queries, heads, len(levels), points, generator=generator)
    return dict(value=value, spatial_shapes=shapes, level_start_index=starts, reference_points=reference,
                sampling_offsets=offsets, attention_logits=logits)


FUSED_BACKENDS = ["pytorch", pytest.param("triton", marks=pytest.mark.skipif(
    triton_unavailable_reason(torch.device("cpu")) is not None and not torch.cuda.is_available(),
    reason="the Triton backend needs CUDA or the interpreter"))]


@pytest.mark.parametrize("backend", FUSED_BACKENDS)
@pytest.mark.parametrize("bad, error, message", [
    ("levels", ValueError, r"spatial_shapes has 3 levels but sampling_offsets has 2"),
    ("list_shapes", TypeError, r"spatial_shapes must be a torch.Tensor, got list"),
    ("keys", ValueError, r"spatial_shapes \[\(3, 4\), \(2, 2\)\] cover 16 keys but value has 15"),
    ("reference", ValueError, r"reference_points must be \(batch, num_queries, num_levels, 2 or 4\)"),
    ("logits", ValueError, r"attention_logits has shape \(1, 3, 2, 2, 1\) but sampling_offsets implies"),
], ids=["levels", "list-shapes", "keys", "reference", "logits"])
def test_fused_entry_validates_first_with_the_same_message_on_every_backend(backend, bad, error, message):
    from deform_plugin.ops import fused_multi_scale_deformable_attn
    inputs = _fused_inputs()
    if bad == "levels":
        inputs["spatial_shapes"] = torch.tensor([(3, 4), (2, 2), (1, 1)])
    elif bad == "list_shapes":
        inputs["spatial_shapes"] = [(3, 4), (2, 2)]
    elif bad == "keys":
        inputs["value"] = inputs["value"][:, :-1]
    elif bad == "reference":
        inputs["reference_points"] = inputs["reference_points"][..., :1]
    elif bad == "logits":
        inputs["attention_logits"] = inputs["attention_logits"][..., :1]
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    with pytest.raises(error, match=message):
        fused_multi_scale_deformable_attn(**inputs, backend=backend)
