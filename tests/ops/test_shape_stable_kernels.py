"""A new image size compiles no new Triton kernel variant, for every kernel of both ops.

Triton compiles one binary per specialisation key (constexprs, dtypes, and the value class of every integer and
pointer argument it specialises). On a CPU the interpreter compiles nothing, so these tests record every launch's
arguments and compute the key each would have compiled under with Triton's own specialisation code
(:func:`deform_plugin.ops.compile_stats.launch_key`). The same launches keyed as a kernel without our
``do_not_specialize`` marks give many more keys: the test would see a regression.
"""
import pytest
import torch

triton = pytest.importorskip("triton")

from deform_plugin.ops import deform_sdpa, fused_multi_scale_deformable_attn, multi_scale_deformable_attn  # noqa
from deform_plugin.ops.compile_stats import launch_key, triton_kernels  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="records launches through the CPU interpreter")

# Variants a kernel may have per dtype (and, for MSDA, per plain or fused path: FUSED is a constexpr).
MAX_VARIANTS_PER_DTYPE = 1


@pytest.fixture
def recorded_launches():
    """{kernel name: [(args, kwargs), ...]} of every interpreted launch while the fixture is active."""
    kernels = triton_kernels()
    launches = {name: [] for name in kernels}
    hooks = []
    for name, kernel in kernels.items():
        def hook(*args, _name=name, **kwargs):
            launches[_name].append((args, kwargs))
        kernel.add_pre_run_hook(hook)
        hooks.append((kernel, hook))
    yield launches
    for kernel, hook in hooks:
        kernel.pre_run_hooks.remove(hook)


# New image sizes of every value class Triton specialises on: key and query counts divisible by 16 or not, equal
# to 1; widths and heights likewise.
MSDA_SIZES = [(((4, 4), (2, 2)), 16), (((4, 8), (4, 4)), 23), (((3, 5), (2, 3)), 32), (((8, 8), (4, 4)), 1),
              (((5, 7), (3, 2)), 41)]
SDPA_SIZES = [(4, 4), (3, 5), (8, 2), (1, 5), (16, 1)]


def _msda_call(generator, dtype, fused, levels, queries):
    shapes = torch.tensor(levels)
    sizes = shapes.prod(1)
    starts = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)[:-1]])
    batch, heads, head_dim, points = 1, 1, 8, 2
    value = torch.randn(batch, int(sizes.sum()), heads, head_dim, generator=generator).to(dtype).requires_grad_()
    logits = torch.randn(batch, queries, heads, 2, points, generator=generator).to(dtype).requires_grad_()
    if fused:
        reference = torch.rand(batch, queries, 2, 2, generator=generator).requires_grad_()
        offsets = torch.randn(batch, queries, heads, 2, points, 2, generator=generator).to(dtype).requires_grad_()
        out = fused_multi_scale_deformable_attn(value, shapes, starts, reference, offsets, logits, backend="triton")
    else:
        locations = torch.rand(batch, queries, heads, 2, points, 2, generator=generator).to(dtype).requires_grad_()
        out = multi_scale_deformable_attn(value, shapes, starts, locations, logits.softmax(-1), backend="triton")
    out.float().sum().backward()


def _sdpa_call(generator, dtype, width, height):
    # One view: the interpreter runs a program per pixel, view and head; the view count is the same at every size.
    q, k, v = (torch.randn(1, 1, 1, width * height, 16, generator=generator).to(dtype).requires_grad_()
               for _ in range(3))
    coords = torch.rand(1, 1, width * height, 1, 3, 2, generator=generator).to(dtype).requires_grad_()
    deform_sdpa(q, k, v, coords, width, height, backend="triton").float().sum().backward()


def _keys(kernel, launches, unmarked=False):
    if unmarked:
        # The same kernel as Triton would see it without our do_not_specialize marks.
        from triton.runtime.interpreter import InterpretedFunction
        kernel = InterpretedFunction(kernel.fn)
    return {launch_key(kernel, *args, **kwargs) for args, kwargs in launches}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_new_sizes_compile_no_new_variants(recorded_launches, dtype):
    generator = torch.Generator().manual_seed(0)
    for (levels, queries), (width, height) in zip(MSDA_SIZES, SDPA_SIZES):
        _msda_call(generator, dtype, False, levels, queries)
        _msda_call(generator, dtype, True, levels, queries)
        _sdpa_call(generator, dtype, width, height)
    kernels = triton_kernels()
    for name in ("msda_forward", "msda_backward", "deform_sdpa_forward", "deform_sdpa_backward"):
        launches = recorded_launches[name]
        assert len(launches) >= 5, name
        # Plain and fused MSDA are two variants of one kernel (FUSED is a constexpr): twice the bound.
        bound = MAX_VARIANTS_PER_DTYPE * (2 if name.startswith("msda") else 1)
        keys = _keys(kernels[name], launches)
        assert len(keys) <= bound, f"{name}: {len(keys)} variants over {len(launches)} launches of new sizes"
        # Without the marks the same launches would compile a variant per size class: the test can see it.
        assert len(_keys(kernels[name], launches, unmarked=True)) > len(keys), name
