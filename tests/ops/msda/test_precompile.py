"""Precompiling the Triton MSDA kernels: a variant's launches are recorded, not made, and they are the launches the
module itself makes in training (so the variants compiled ahead are the ones the run loads); bad variants are
refused by name."""
import contextlib
import inspect

import pytest
import torch

triton = pytest.importorskip("triton")

from deform_plugin.models.msda import MultiScaleDeformableAttention  # noqa: E402
from deform_plugin.ops.compile_stats import launch_key, triton_kernels  # noqa: E402
from deform_plugin.ops.msda.precompile import MSDAVariant, compile_jobs, variant_launches  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="compares against the module's launches through the CPU interpreter")


@contextlib.contextmanager
def _launches_recorded(names):
    """[(kernel name, args, kwargs)] of every launch of the named kernels while active (before they run)."""
    kernels = triton_kernels()
    launches, hooks = [], []
    for name in names:
        def hook(*args, _name=name, **kwargs):
            launches.append((_name, args, kwargs))
        kernels[name].add_pre_run_hook(hook)
        hooks.append((kernels[name], hook))
    try:
        yield launches
    finally:
        for kernel, hook in hooks:
            kernel.pre_run_hooks.remove(hook)


def _constexprs(launch):
    names = list(inspect.signature(launch.kernel.fn).parameters)
    arguments = launch.tensors + launch.scalars
    return {name: arguments[i] for i, name in enumerate(names) if name.isupper()}


@pytest.mark.parametrize("reference_dim", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_variants_launches_are_the_fused_forward_and_backward_recorded_not_made(reference_dim, dtype):
    variant = MSDAVariant(num_heads=2, head_dim=4, num_levels=2, num_points=3, dtype=str(dtype)[6:],
                          reference_dim=reference_dim)
    kernels = triton_kernels()
    with _launches_recorded(["msda_forward", "msda_backward"]) as made:
        forward, backward = variant_launches(variant)
    assert made == []  # recorded only: no kernel ran
    assert forward.kernel is kernels["msda_forward"] and backward.kernel is kernels["msda_backward"]
    assert forward.tensors[0].dtype == dtype and forward.tensors[5].dtype == torch.float32  # value; reference
    constexprs = _constexprs(backward)
    assert (constexprs["NUM_LEVELS"], constexprs["NUM_POINTS"], constexprs["REF_DIM"]) == (2, 3, reference_dim)
    assert constexprs["FUSED"] and not constexprs["DETERMINISTIC"] and not constexprs["REF_GRAD"]
    assert [launch.kernel for launch in variant_launches(variant, backward=False)] == [kernels["msda_forward"]]


def _module_launch_keys(module, reference_dim, autocast_dtype):
    """The keys under which the module's training forward and backward would compile their kernels (the
    interpreter's launch hooks do not see the launch options: both sides are keyed without them; they follow from
    head_dim and dtype alone, :func:`choose_config`)."""
    kernels = triton_kernels()
    generator = torch.Generator().manual_seed(0)
    levels = torch.tensor([[4, 5], [2, 3]])
    sizes = levels.prod(1)
    starts = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)[:-1]])
    query = torch.randn(1, 7, 16, generator=generator, requires_grad=True)
    value = torch.randn(1, int(sizes.sum()), 16, generator=generator, requires_grad=True)
    reference = torch.rand(1, 7, 2, reference_dim, generator=generator)  # constant, as in the DETRs
    with _launches_recorded(["msda_forward", "msda_backward"]) as launches:
        with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            out = module(query, value=value, reference_points=reference, spatial_shapes=levels,
                         level_start_index=starts)
        out.float().sum().backward()
    return {(name, launch_key(kernels[name], *args)) for name, args, _ in launches}


@pytest.mark.parametrize("reference_dim", [2, 4], ids=["points", "boxes"])
@pytest.mark.parametrize("autocast_dtype", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_the_variants_compiled_ahead_are_those_the_module_launches_in_training(reference_dim, autocast_dtype):
    module = MultiScaleDeformableAttention(embed_dims=16, num_heads=2, num_levels=2, num_points=2, batch_first=True,
                                           backend="triton")
    module_keys = _module_launch_keys(module, reference_dim, autocast_dtype)
    assert {name for name, _ in module_keys} == {"msda_forward", "msda_backward"}
    dtype = "float32" if autocast_dtype is None else "bfloat16"
    variant = MSDAVariant(num_heads=2, head_dim=8, num_levels=2, num_points=2, dtype=dtype,
                          reference_dim=reference_dim)
    kernels = {kernel: name for name, kernel in triton_kernels().items()}
    precompiled = {(kernels[launch.kernel], launch_key(launch.kernel, *launch.tensors, *launch.scalars))
                   for launch in variant_launches(variant)}
    assert module_keys == precompiled


def test_under_the_interpreter_there_is_nothing_to_compile():
    assert compile_jobs([MSDAVariant(num_heads=1, head_dim=4, num_levels=1, num_points=1)]) == []


@pytest.mark.parametrize("kwargs,match", [
    (dict(dtype="float64"), "dtype must be one of float32, float16, bfloat16, got 'float64'"),
    (dict(reference_dim=3), "reference_dim must be 2 or 4, got 3"),
    (dict(num_points=0), "num_points must be an int >= 1, got 0"),
])
def test_a_bad_variant_is_refused_naming_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MSDAVariant(**dict(dict(num_heads=1, head_dim=4, num_levels=1, num_points=1), **kwargs))
