"""Deformable SDPA: the Triton kernels against the float64 reference, the reference against a brute-force loop,
input checks, and the MMEngine module built from its config.

On a machine without CUDA the Triton kernels run under the interpreter (TRITON_INTERPRET=1, set by conftest.py
before triton is imported) on tiny shapes only; with CUDA the full-size shapes run too.
"""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from op_devices import DEVICE, HAS_CUDA, needs_triton

from deform_plugin.ops.deform_sdpa import deform_sdpa, deform_sdpa_reference

needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
needs_mmengine = pytest.mark.skipif(importlib.util.find_spec("mmengine") is None, reason="mmengine not installed")

REPO_ROOT = Path(__file__).resolve().parents[3]

# Largest error relative to the largest reference magnitude, per storage dtype (fp32 math inside).
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def shape_id(batch, views, samples, heads, head_dim, width, height):
    return f"B{batch}-V{views}-S{samples}-H{heads}-D{head_dim}-{width}x{height}"


# (batch, views, samples, heads, head_dim, width, height). Tiny shapes keep interpreter programs few (B*V*H*N).
TINY_SHAPES = [
    (1, 2, 3, 1, 16, 3, 2),  # the basic case
    (2, 1, 33, 1, 32, 2, 2),  # 33 samples: several key blocks in every dtype, so the online softmax rescales
    (1, 2, 2, 2, 20, 1, 3),  # head_dim 20 padded to 32; a 1-pixel-wide view
    (1, 3, 2, 1, 24, 5, 1),  # 3 views, head_dim 24, odd width
    (1, 2, 5, 3, 16, 2, 2),  # 3 heads: a head's maps are not the first ones
    (2, 2, 3, 2, 16, 2, 2),  # batch, views and heads all above 1: the forward's program order differs from the layout
]
FULL_SHAPES = [
    (2, 8, 32, 16, 32, 14, 14),  # the seed's configuration
    (1, 6, 8, 8, 64, 13, 11),  # prime sizes
    (2, 3, 5, 4, 80, 9, 7),  # head_dim 80 (not a power of two)
    (1, 2, 4, 2, 128, 8, 8),
    (1, 4, 16, 3, 48, 17, 5),
    (3, 2, 7, 5, 16, 31, 3),
]
SHAPES = TINY_SHAPES + (FULL_SHAPES if HAS_CUDA else [])


def make_coords(batch, views, pixels, samples, width, height, dtype, device, generator, outside=True):
    """Normalized coords whose pixel coordinates stay >= 0.05 px from integers after rounding to ``dtype``.

    The bilinear gradient jumps at integer pixel coordinates, so points there would compare one-sided
    derivatives. With ``outside``, pixels span [-2.5, size + 1.5]: some points fall wholly or partly off the map.
    """
    shape = (batch, views, pixels, views, samples)
    sizes = torch.tensor([width, height], dtype=torch.float64)
    low, high = (-2.5, sizes + 1.5) if outside else (-0.5, sizes - 0.5)
    coords = torch.empty(shape + (2,), dtype=dtype)
    redraw = torch.ones(shape + (2,), dtype=torch.bool)
    while redraw.any():
        pixel = low + (high - low) * torch.rand(shape + (2,), dtype=torch.float64, generator=generator)
        candidate = ((pixel + 0.5) / sizes).to(dtype)
        coords = torch.where(redraw, candidate, coords)
        rounded_pixel = coords.double() * sizes - 0.5
        frac = rounded_pixel - rounded_pixel.floor()
        redraw = (frac < 0.05) | (frac > 0.95)
    return coords.to(device)


def make_inputs(shape, dtype, device=DEVICE, seed=0, outside=True):
    batch, views, samples, heads, head_dim, width, height = shape
    generator = torch.Generator().manual_seed(seed)
    pixels = width * height
    q, k, v = (torch.randn(batch, views, heads, pixels, head_dim, generator=generator).to(device, dtype)
               for _ in range(3))
    coords = make_coords(batch, views, pixels, samples, width, height, dtype, device, generator, outside)
    return q, k, v, coords


def forward_and_grads(inputs, width, height, grad_out, backend):
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = deform_sdpa(*inputs, width, height, backend=backend)
    grads = torch.autograd.grad(out, inputs, grad_out.to(out.dtype))
    return (out,) + grads


def relative_error(actual, expected):
    scale = expected.abs().max().clamp_min(1e-12)
    return ((actual.double() - expected).abs().max() / scale).item()


def assert_close_to_float64(inputs, width, height, dtype, seed=1):
    """Triton forward and all four gradients against the float64 reference on the same (rounded) inputs."""
    inputs64 = [t.double() for t in inputs]
    batch, views, heads, pixels, head_dim = inputs[0].shape
    grad_out = torch.randn(batch, views, heads, pixels, head_dim, generator=torch.Generator().manual_seed(seed),
                           dtype=torch.float64).to(inputs[0].device)
    expected = forward_and_grads(inputs64, width, height, grad_out, "pytorch")
    actual = forward_and_grads(inputs, width, height, grad_out, "triton")
    # flash-attention's rule, with a floor: at most twice the error of PyTorch in the same storage dtype.
    torch_same_dtype = forward_and_grads(inputs, width, height, grad_out, "pytorch")
    for name, got, same_dtype, want in zip(("out", "dq", "dk", "dv", "dcoords"), actual, torch_same_dtype,
                                           expected):
        assert got.dtype == (inputs[3].dtype if name == "dcoords" else dtype), name
        assert torch.isfinite(got).all(), f"{name} has non-finite values"
        tolerance = max(TOLERANCE[dtype], 2 * relative_error(same_dtype, want))
        error = relative_error(got, want)
        assert error <= tolerance, f"{name}: relative error {error:.3g} > {tolerance:.3g}"


def test_tiny_shapes_cover_several_key_blocks():
    from deform_plugin.ops.deform_sdpa.triton_launch import (BACKWARD_TILE_ELEMENTS, FORWARD_TILE_ELEMENTS,
                                                             heuristic_block_t)

    for tile_elements in (FORWARD_TILE_ELEMENTS, BACKWARD_TILE_ELEMENTS):
        assert any(heuristic_block_t(views * samples, max(16, head_dim), tile_elements) < views * samples
                   for _, views, samples, _, head_dim, _, _ in TINY_SHAPES), tile_elements


@needs_triton
@pytest.mark.parametrize("shape", SHAPES, ids=[shape_id(*s) for s in SHAPES])
def test_triton_matches_float64_reference_fp32(shape):
    q, k, v, coords = make_inputs(shape, torch.float32)
    assert ((coords < 0) | (coords > 1)).any(), "the case must exercise points outside the views"
    assert_close_to_float64((q, k, v, coords), shape[5], shape[6], torch.float32)


HALF_CASES = [(shape, dtype) for shape in TINY_SHAPES[:2] for dtype in (torch.float16, torch.bfloat16)]
if HAS_CUDA:
    HALF_CASES += [(shape, dtype) for shape in FULL_SHAPES[:3] for dtype in (torch.float16, torch.bfloat16)]


@needs_triton
@pytest.mark.parametrize("shape, dtype", HALF_CASES,
                         ids=[f"{shape_id(*s)}-{DTYPE_NAMES[d]}" for s, d in HALF_CASES])
def test_triton_matches_float64_reference_half(shape, dtype):
    q, k, v, coords = make_inputs(shape, dtype)
    assert_close_to_float64((q, k, v, coords), shape[5], shape[6], dtype)


@needs_triton
def test_triton_half_storage_with_float32_coords():
    shape = TINY_SHAPES[0] if not HAS_CUDA else FULL_SHAPES[0]
    q, k, v, coords = make_inputs(shape, torch.bfloat16)
    assert_close_to_float64((q, k, v, coords.float()), shape[5], shape[6], torch.bfloat16)


@needs_triton
def test_nan_and_inf_coords_sample_zero_like_points_far_outside():
    shape = (1, 2, 3, 1, 16, 3, 2)
    q, k, v, coords = make_inputs(shape, torch.float32)
    bad = torch.zeros(coords.shape[:-1], dtype=torch.bool, device=coords.device)
    bad[0, 0, 1, 1, 0] = bad[0, 1, 4, 0, 2] = bad[0, 1, 5, 1, 1] = True
    nan_coords = coords.clone()
    nan_coords[bad] = torch.tensor([float("nan"), 0.5], device=coords.device)
    nan_coords[0, 1, 5, 1, 1] = torch.tensor([0.5, float("inf")], device=coords.device)
    far_coords = coords.clone()
    far_coords[bad] = -10.0
    grad_out = torch.randn(q.shape, dtype=torch.float64, device=q.device)
    with_nan = forward_and_grads((q, k, v, nan_coords), 3, 2, grad_out, "triton")
    far_away = forward_and_grads((q, k, v, far_coords), 3, 2, grad_out, "pytorch")
    for name, got, want in zip(("out", "dq", "dk", "dv"), with_nan[:4], far_away[:4]):
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
    dcoords = with_nan[4]
    assert torch.isfinite(dcoords).all()
    assert (dcoords[bad] == 0).all(), "NaN/inf points must get zero gradient"
    torch.testing.assert_close(dcoords[~bad], far_away[4][~bad], rtol=1e-5, atol=1e-5)
    # The reference follows the same rule.
    reference = forward_and_grads((q, k, v, nan_coords), 3, 2, grad_out, "pytorch")
    torch.testing.assert_close(reference[0], far_away[0])
    assert (reference[4][bad] == 0).all()


@needs_triton
def test_all_points_outside_give_zero_output_and_kv_grads():
    shape = (1, 2, 2, 1, 16, 2, 2)
    q, k, v, coords = make_inputs(shape, torch.float32)
    coords = torch.where(coords > 0.5, coords + 2.0, coords - 2.0)  # every corner off the map
    grad_out = torch.randn(q.shape, dtype=torch.float64, device=q.device)
    out, dq, dk, dv, dcoords = forward_and_grads((q, k, v, coords), 2, 2, grad_out, "triton")
    assert (out == 0).all() and (dq == 0).all() and (dk == 0).all() and (dv == 0).all() and (dcoords == 0).all()


@needs_triton
def test_non_contiguous_inputs():
    batch, views, samples, heads, head_dim, width, height = 1, 2, 3, 2, 16, 2, 1
    pixels = width * height
    # q, k, v as strided views of (B, V, N, H, D) storage, the layout a module's projections produce; coords
    # as every other sample of a larger tensor.
    q, k, v = (torch.randn(batch, views, pixels, heads, head_dim, device=DEVICE).transpose(2, 3)
               for _ in range(3))
    wide = make_coords(batch, views, pixels, 2 * samples, width, height, torch.float32, DEVICE,
                       torch.Generator().manual_seed(3))
    coords = wide[:, :, :, :, ::2]
    assert not (q.is_contiguous() or coords.is_contiguous())
    assert_close_to_float64((q, k, v, coords), width, height, torch.float32)


@needs_triton
@pytest.mark.parametrize("backend", ["triton", "pytorch"])
@pytest.mark.parametrize("shape", [(0, 2, 3, 2, 16, 3, 2), (1, 2, 3, 0, 16, 3, 2), (1, 2, 3, 2, 16, 0, 4),
                                   (2, 0, 3, 2, 16, 3, 2)],
                         ids=["batch0", "heads0", "width0", "views0"])
def test_empty_inputs(shape, backend):
    q, k, v, coords = (t.requires_grad_() for t in make_inputs(shape, torch.float32))
    out = deform_sdpa(q, k, v, coords, shape[5], shape[6], backend=backend)
    assert out.shape == q.shape
    out.sum().backward()
    for tensor in (q, k, v, coords):
        assert tensor.grad is not None and tensor.grad.shape == tensor.shape and (tensor.grad == 0).all()


@needs_triton
def test_coords_without_grad_and_custom_op_registration():
    from deform_plugin.ops.deform_sdpa.triton_op import deform_sdpa_forward_op

    shape = (1, 1, 2, 1, 16, 2, 1)
    q, k, v, coords = make_inputs(shape, torch.float32)
    q.requires_grad_()
    out = deform_sdpa(q, k, v, coords, 2, 1, backend="triton")
    (dq,) = torch.autograd.grad(out.sum(), q)
    assert torch.isfinite(dq).all()
    args = (q.detach().requires_grad_(), k.requires_grad_(), v.requires_grad_(), coords.requires_grad_(), 2, 1,
            0.25)
    torch.library.opcheck(deform_sdpa_forward_op, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_index_dtype_follows_the_largest_tensor():
    """int32 offsets only where neither q (and k, v, the gradients) nor coords can overflow them; meta tensors."""
    import triton.language as tl

    from deform_plugin.ops.deform_sdpa.triton_launch import _INT32_INDEX_MAX_NUMEL, _index_dtype

    small, large = (torch.empty(n, device="meta") for n in (1000, _INT32_INDEX_MAX_NUMEL + 1))
    assert _index_dtype(small, small) == tl.int32
    assert _index_dtype(large, small) == tl.int64
    assert _index_dtype(small, large) == tl.int64


@needs_triton
def test_int64_indexing_gives_the_same_results(monkeypatch):
    """The int64 variant (for tensors past 2^30 elements) computes what the int32 one does: exactly, but for the
    order in which a GPU's atomics add into dk, dv and the coordinate gradient."""
    from deform_plugin.ops.deform_sdpa import triton_launch

    # Every index above 0 in some program (two images, views and heads; 2 x 2 pixels): the interpreter runs a program
    # per pixel, view, head and image.
    shape = (2, 2, 5, 2, 16, 2, 2)
    q, k, v, coords = make_inputs(shape, torch.float32)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).to(DEVICE)

    def run():
        out, lse = triton_launch.deform_sdpa_forward(q, k, v, coords, shape[5], shape[6], 0.25)
        return (out, lse, *triton_launch.deform_sdpa_backward(grad_out, q, k, v, coords, out, lse, shape[5],
                                                               shape[6], 0.25, True))
    int32_results = run()
    monkeypatch.setattr(triton_launch, "_INT32_INDEX_MAX_NUMEL", 0)
    int64_results = run()
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dcoords"), int32_results, int64_results):
        if HAS_CUDA and name in ("dk", "dv", "dcoords"):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)
        else:
            assert torch.equal(a, b), name


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_autotuned_kernels_match_reference(dtype, monkeypatch):
    from deform_plugin.ops.deform_sdpa.triton_launch import AUTOTUNE_ENV

    monkeypatch.setenv(AUTOTUNE_ENV, "1")
    shape = (1, 3, 5, 2, 32, 6, 5)
    q, k, v, coords = make_inputs(shape, dtype)
    assert_close_to_float64((q, k, v, coords), shape[5], shape[6], dtype)


@needs_cuda
def test_triton_under_torch_compile():
    shape = FULL_SHAPES[1]
    q, k, v, coords = make_inputs(shape, torch.float32)
    width, height = shape[5], shape[6]

    def attention(q, k, v, coords):
        return deform_sdpa(q * 1.0, k, v, coords, width, height, backend="triton")

    compiled = torch.compile(attention, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, coords), attention(q, k, v, coords))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_triton_on_second_device():
    shape = FULL_SHAPES[1]
    q, k, v, coords = make_inputs(shape, torch.float32, device=torch.device("cuda", 1))
    assert_close_to_float64((q, k, v, coords), shape[5], shape[6], torch.float32)


def test_reference_matches_brute_force_loop():
    """The grid_sample reference against a direct transcription of the definition (float64, tiny)."""
    shape = (1, 2, 3, 2, 4, 3, 2)
    batch, views, samples, heads, head_dim, width, height = shape
    q, k, v, coords = make_inputs(shape, torch.float64, device="cpu")
    coords[0, 1, 2, 0, 1] = torch.tensor([float("nan"), 0.3], dtype=torch.float64)

    def bilinear(feature_map, x, y):  # feature_map (N, D) row-major
        if not (math.isfinite(x) and math.isfinite(y)):
            return torch.zeros(head_dim, dtype=torch.float64)
        px, py = x * width - 0.5, y * height - 0.5
        x0, y0 = math.floor(px), math.floor(py)
        total = torch.zeros(head_dim, dtype=torch.float64)
        for cx, cy in ((x0, y0), (x0 + 1, y0), (x0, y0 + 1), (x0 + 1, y0 + 1)):
            if 0 <= cx < width and 0 <= cy < height:
                total = total + (1 - abs(px - cx)) * (1 - abs(py - cy)) * feature_map[cy * width + cx]
        return total

    expected = torch.zeros_like(q)
    for b in range(batch):
        for view in range(views):
            for h in range(heads):
                for n in range(width * height):
                    keys, values = [], []
                    for other in range(views):
                        for s in range(samples):
                            x, y = coords[b, view, n, other, s].tolist()
                            keys.append(bilinear(k[b, other, h], x, y))
                            values.append(bilinear(v[b, other, h], x, y))
                    scores = torch.stack(keys) @ q[b, view, h, n] / math.sqrt(head_dim)
                    expected[b, view, h, n] = scores.softmax(0) @ torch.stack(values)
    torch.testing.assert_close(deform_sdpa_reference(q, k, v, coords, width, height), expected, rtol=1e-12,
                               atol=1e-12)


def test_reference_gradients_pass_gradcheck():
    shape = (1, 2, 2, 1, 3, 2, 2)
    inputs = [t.requires_grad_() for t in make_inputs(shape, torch.float64, device="cpu")]
    assert torch.autograd.gradcheck(lambda *args: deform_sdpa_reference(*args, 2, 2), inputs)


def test_float64_on_auto_runs_the_reference():
    q, k, v, coords = make_inputs((1, 1, 2, 1, 16, 2, 1), torch.float64)
    torch.testing.assert_close(deform_sdpa(q, k, v, coords, 2, 1, backend="auto"),
                               deform_sdpa_reference(q, k, v, coords, 2, 1))


class TestInputChecks:
    def inputs(self, dtype=torch.float32):
        return make_inputs((1, 2, 3, 2, 16, 3, 2), dtype, device="cpu")

    def test_wrong_q_rank(self):
        q, k, v, coords = self.inputs()
        with pytest.raises(ValueError, match=r"q must be \(batch, num_views, num_heads, num_pixels, head_dim\), "
                                             r"got shape \(2, 2, 6, 16\)"):
            deform_sdpa(q[0], k, v, coords, 3, 2)

    def test_k_shape_differs(self):
        q, k, v, coords = self.inputs()
        with pytest.raises(ValueError, match=r"k has shape \(1, 2, 2, 6, 8\) but q has \(1, 2, 2, 6, 16\)"):
            deform_sdpa(q, k[..., :8], v, coords, 3, 2)

    def test_pixels_do_not_match_width_height(self):
        q, k, v, coords = self.inputs()
        with pytest.raises(ValueError, match=r"6 pixels per view but width \* height = 2 \* 2 = 4"):
            deform_sdpa(q, k, v, coords, 2, 2)

    def test_coords_shape(self):
        q, k, v, coords = self.inputs()
        with pytest.raises(ValueError, match=r"coords has shape \(1, 2, 6, 1, 3, 2\) but q implies"):
            deform_sdpa(q, k, v, coords[:, :, :, :1], 3, 2)
        with pytest.raises(ValueError, match="last dim 3"):
            deform_sdpa(q, k, v, torch.cat([coords, coords[..., :1]], -1), 3, 2)
        with pytest.raises(ValueError, match="at least one sample"):
            deform_sdpa(q, k, v, coords[:, :, :, :, :0], 3, 2)

    def test_integer_dtype(self):
        q, k, v, coords = self.inputs()
        with pytest.raises(TypeError, match="q must be a floating tensor.*got torch.int64"):
            deform_sdpa(q.long(), k, v, coords, 3, 2)

    def test_mixed_qkv_dtypes(self):
        q, k, v, coords = self.inputs()
        with pytest.raises(TypeError, match="q torch.float32, k torch.float16"):
            deform_sdpa(q, k.half(), v, coords, 3, 2)

    def test_non_int_width(self):
        q, k, v, coords = self.inputs()
        with pytest.raises(TypeError, match=r"width must be an integer, got float \(3.0\)"):
            deform_sdpa(q, k, v, coords, 3.0, 2)

    def test_integral_width_and_height_of_any_integer_type(self):
        import numpy as np
        q, k, v, coords = self.inputs(torch.float64)
        expected = deform_sdpa(q, k, v, coords, 3, 2, backend="pytorch")
        for width, height in ((np.int64(3), np.int32(2)), (torch.tensor(3), torch.tensor(2, dtype=torch.int32))):
            torch.testing.assert_close(deform_sdpa(q, k, v, coords, width, height, backend="pytorch"), expected,
                                       rtol=0, atol=0)
        with pytest.raises(TypeError, match=r"width must be an integer, got a torch.float32 tensor"):
            deform_sdpa(q, k, v, coords, torch.tensor(3.0), 2)

    @pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
    def test_non_finite_sm_scale_rejected(self, scale):
        q, k, v, coords = self.inputs()
        with pytest.raises(ValueError, match=f"sm_scale must be finite, got {scale}"):
            deform_sdpa(q, k, v, coords, 3, 2, sm_scale=scale)

    def test_mmcv_backend_rejected_listing_only_its_own_backends(self):
        q, k, v, coords = self.inputs()
        with pytest.raises(ValueError, match="deform_sdpa has no backend 'mmcv'") as error:
            deform_sdpa(q, k, v, coords, 3, 2, backend="mmcv")
        assert "'auto', 'triton', 'pytorch' or None" in str(error.value)

    @needs_triton
    def test_float64_on_triton_rejected(self):
        q, k, v, coords = (t.to(DEVICE) for t in self.inputs(torch.float64))
        with pytest.raises(TypeError, match="q, k, v are torch.float64 but the Triton kernels take"):
            deform_sdpa(q, k, v, coords, 3, 2, backend="triton")

    @needs_cuda
    def test_mixed_devices(self):
        q, k, v, coords = self.inputs()
        with pytest.raises(ValueError, match="must be on one device.*coords cpu"):
            deform_sdpa(q.cuda(), k.cuda(), v.cuda(), coords, 3, 2)


@needs_mmengine
def test_module_builds_from_config_and_trains():
    from mmengine import Config
    from mmengine.registry import MODELS

    config = Config.fromfile(str(REPO_ROOT / "configs" / "deform_sdpa" / "deform-sdpa_tiny-fusion_4views_toy.py"))
    model = MODELS.build(config.model).to(DEVICE)
    images = torch.randn(2, config.num_views, 3, 16, 12, device=DEVICE)
    logits = model(images)
    assert logits.shape == (2, config.model.num_classes)
    logits.logsumexp(-1).sum().backward()
    offsets = model.attentions[0].sampling_offsets
    assert offsets.weight.grad is not None and offsets.weight.grad.abs().sum() > 0, \
        "the coordinate gradient must reach the offset predictor"


@needs_mmengine
def test_attention_module_rejects_wrong_query_shape():
    from mmengine.registry import MODELS

    import deform_plugin.models.deform_sdpa  # noqa: F401  registers the modules

    attention = MODELS.build(dict(type="DeformableSDPAttention", embed_dims=32, num_heads=2, num_views=3,
                                  num_samples=4))
    with pytest.raises(ValueError, match=r"height\*width=20"):
        attention(torch.randn(1, 3, 12, 32), (4, 5))


@needs_mmengine
@needs_cuda
def test_attention_module_triton_matches_pytorch():
    from mmengine.registry import MODELS

    import deform_plugin.models.deform_sdpa  # noqa: F401

    attention = MODELS.build(dict(type="DeformableSDPAttention", embed_dims=64, num_heads=4, num_views=3,
                                  num_samples=8)).to(DEVICE)
    query = torch.randn(2, 3, 7 * 9, 64, device=DEVICE)
    outputs = []
    for backend in ("triton", "pytorch"):
        attention.backend = backend
        outputs.append(attention(query, (7, 9)))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-4, atol=1e-5)


@needs_triton
def test_head_dim_beyond_the_kernels():
    q, k, v, coords = make_inputs((1, 1, 2, 1, 264, 2, 1), torch.float32)
    with pytest.raises(ValueError, match="head_dim 264 exceeds 256"):
        deform_sdpa(q, k, v, coords, 2, 1, backend="triton")


@needs_cuda
def test_auto_falls_back_to_reference_with_a_warning_beyond_the_kernels():
    q, k, v, coords = make_inputs((1, 1, 2, 1, 264, 2, 1), torch.float32)
    with pytest.warns(UserWarning, match="runs the PyTorch reference instead of Triton: head_dim 264"):
        out = deform_sdpa(q, k, v, coords, 2, 1, backend="auto")
    torch.testing.assert_close(out, deform_sdpa_reference(q, k, v, coords, 2, 1))
