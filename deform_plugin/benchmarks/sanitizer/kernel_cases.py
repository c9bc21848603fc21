"""The kernel targets: every Triton kernel launched once per check at small odd sizes, compared with float64.

Each case runs one op in one dtype over a few named shapes (odd level sizes, query counts that are no multiple of
any block, head_dim below its padded block, int32 and int64 level tables, points outside the maps) and checks:

- ``msda:DTYPE`` (:func:`deform_plugin.ops.multi_scale_deformable_attn`): the forward, the forward and its backward
  (grad_value by atomics), the deterministic backward (sort and segment sum, run twice: bitwise equal), and a forward
  and backward whose locations hold NaN, infinities and huge values;
- ``msda-fused:DTYPE`` (:func:`deform_plugin.ops.fused_multi_scale_deformable_attn`): reference points (2-d) and
  boxes (4-d), with and without the reference points' gradient, and the deterministic backward;
- ``sdpa:DTYPE`` (:func:`deform_plugin.ops.deform_sdpa`): the forward, the backward with and without the coordinates'
  gradient (head_dim padded and not), and non-finite coordinates;
- ``nms:fp32`` (:func:`deform_plugin.ops.greedy_nms_first_kept`): kept indices and counts equal to the reference's;
- ``control:DTYPE``: no code of ours (a cuBLAS GEMM, then PyTorch's elementwise multiply reading its output), so
  that what a tool reports there is seen to belong to the tool or the libraries, not to the kernels.

The float64 reference runs on the CPU (the sanitizer then watches our kernels and the few PyTorch ones around
them). A check fails where a result is not finite or its relative error (Frobenius norm) exceeds the dtype's limit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple

import torch

from deform_plugin.benchmarks.common import relative_error

# Relative error limits of outputs (and value / weight / logit gradients), then of location, offset, reference and
# coordinate gradients (differences of corner values: rounding-sensitive). fp64 runs the kernels in float64.
LIMITS = {"fp64": (1e-10, 1e-8), "fp32": (1e-4, 5e-3), "fp16": (5e-3, 2e-2), "bf16": (3e-2, 6e-2)}
DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
MSDA_DTYPES = ("fp32", "fp16", "bf16", "fp64")
SDPA_DTYPES = ("fp32", "fp16", "bf16")  # the Triton kernels of deform_sdpa take no float64
NMS_DTYPES = ("fp32",)  # greedy NMS computes in float32 whatever its inputs
CONTROL_DTYPES = ("fp32", "bf16")


@dataclass
class Check:
    """One comparison: its name, the relative error (inf where the result is not finite) and the limit."""

    name: str
    error: float
    limit: float

    @property
    def passed(self) -> bool:
        return self.error <= self.limit  # False for NaN and inf

    def as_dict(self) -> dict:
        return dict(name=self.name, error=self.error, limit=self.limit, passed=self.passed)


def compare(checks: List[Check], name: str, actual: torch.Tensor, expected: torch.Tensor, limit: float) -> None:
    checks.append(Check(name, relative_error(actual.cpu(), expected), limit))


# ---- MSDA ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MSDAShape:
    levels: Tuple[Tuple[int, int], ...]
    batch: int
    queries: int
    heads: int
    head_dim: int
    points: int
    table_dtype: torch.dtype = torch.int64

    @property
    def name(self) -> str:
        levels = "+".join(f"{h}x{w}" for h, w in self.levels)
        return (f"L{levels}-B{self.batch}-Q{self.queries}-H{self.heads}-D{self.head_dim}-P{self.points}"
                f"-{str(self.table_dtype).replace('torch.', '')}")


# Queries 13, 9, 37: no multiple of any block (4 to 32 queries); head_dim 24 and 8 below their blocks, 32 filling it.
MSDA_SHAPES = (
    MSDAShape(((5, 7), (3, 3), (2, 1)), batch=2, queries=13, heads=3, head_dim=24, points=3),
    MSDAShape(((3, 5),), batch=1, queries=9, heads=2, head_dim=8, points=1, table_dtype=torch.int32),
    MSDAShape(((7, 5), (4, 3), (2, 2), (1, 1)), batch=1, queries=37, heads=1, head_dim=32, points=4),
)
# The one shape whose checks take seconds, not minutes, in Triton's CPU interpreter.
TINY_MSDA_SHAPES = MSDA_SHAPES[1:2]


def level_tables(levels, dtype=torch.int64) -> Tuple[torch.Tensor, torch.Tensor]:
    shapes = torch.tensor(levels, dtype=dtype)
    sizes = shapes[:, 0] * shapes[:, 1]
    return shapes, torch.cat([sizes.new_zeros(1), sizes.cumsum(0)[:-1]]).to(dtype)


def rounded(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` rounded to ``dtype`` and back to float64: the inputs both the kernel and the reference see."""
    return tensor.to(dtype).to(torch.float64)


def away_from_pixel_edges(sizes: torch.Tensor, shape, dtype: torch.dtype, generator: torch.Generator,
                          low: float = -1.6) -> torch.Tensor:
    """Normalized coordinates (rounded to ``dtype``) whose pixel coordinate ``x * size - 0.5`` spans
    ``[low, size - low]`` (some samples wholly outside the map) and stays >= 0.05 px from an integer, where the
    bilinear gradient jumps. ``sizes`` broadcasts against ``shape``."""
    sizes = sizes.to(torch.float64).expand(shape)
    coords = torch.zeros(shape, dtype=torch.float64)
    redraw = torch.ones(shape, dtype=torch.bool)
    while redraw.any():
        pixel = low + torch.rand(shape, generator=generator, dtype=torch.float64) * (sizes - 2 * low)
        coords = torch.where(redraw, rounded((pixel + 0.5) / sizes, dtype), coords)
        frac = (coords * sizes - 0.5) % 1.0
        redraw = (frac < 0.05) | (frac > 0.95)
    return coords


def msda_inputs(shape: MSDAShape, dtype: torch.dtype, seed: int = 0) -> Dict[str, torch.Tensor]:
    """float64 CPU inputs already rounded to ``dtype``: value, locations, weights, grad_output, tables."""
    generator = torch.Generator().manual_seed(seed)
    spatial_shapes, level_start_index = level_tables(shape.levels, shape.table_dtype)
    num_keys = int((spatial_shapes[:, 0] * spatial_shapes[:, 1]).sum())
    num_levels = len(shape.levels)
    sample_shape = (shape.batch, shape.queries, shape.heads, num_levels, shape.points)
    heights = spatial_shapes[:, 0].view(1, 1, 1, num_levels, 1)
    widths = spatial_shapes[:, 1].view(1, 1, 1, num_levels, 1)
    locations = torch.stack([away_from_pixel_edges(widths, sample_shape, dtype, generator),
                             away_from_pixel_edges(heights, sample_shape, dtype, generator)], -1)
    logits = torch.randn(shape.batch, shape.queries, shape.heads, num_levels * shape.points, generator=generator,
                         dtype=torch.float64)
    return dict(
        value=rounded(torch.randn(shape.batch, num_keys, shape.heads, shape.head_dim, generator=generator,
                                  dtype=torch.float64), dtype),
        locations=locations,
        weights=rounded(logits.softmax(-1).view(sample_shape), dtype),
        logits=rounded(logits.view(sample_shape), dtype),
        grad_output=rounded(torch.randn(shape.batch, shape.queries, shape.heads * shape.head_dim,
                                        generator=generator, dtype=torch.float64), dtype),
        spatial_shapes=spatial_shapes, level_start_index=level_start_index)


def fused_inputs(shape: MSDAShape, ref_dim: int, dtype: torch.dtype, seed: int = 0) -> Dict[str, torch.Tensor]:
    """Reference points (``ref_dim`` 2) or boxes (4) in (0.1, 0.9), offsets of ~2 px with a few far outside."""
    generator = torch.Generator().manual_seed(seed + 1)
    num_levels = len(shape.levels)
    reference = 0.1 + 0.8 * torch.rand(shape.batch, shape.queries, num_levels, ref_dim, generator=generator,
                                       dtype=torch.float64)
    if ref_dim == 4:
        reference[..., 2:] = 0.05 + 0.3 * reference[..., 2:]
    offsets = 2.0 * torch.randn(shape.batch, shape.queries, shape.heads, num_levels, shape.points, 2,
                                generator=generator, dtype=torch.float64)
    offsets.view(-1)[::7] *= 20.0  # every 7th coordinate far away: samples partly and wholly outside the map
    return dict(reference=rounded(reference, dtype), offsets=rounded(offsets, dtype))


def _device_leaves(tensors: Sequence[torch.Tensor], dtype: torch.dtype, device) -> List[torch.Tensor]:
    return [t.to(device=device, dtype=dtype).requires_grad_() for t in tensors]


def _reference_leaves(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    return [t.detach().clone().requires_grad_() for t in tensors]


def _grads(out: torch.Tensor, leaves: Sequence[torch.Tensor], grad_output: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    return torch.autograd.grad(out, leaves, grad_output.to(device=out.device, dtype=out.dtype))


class deterministic_algorithms:
    """``torch.use_deterministic_algorithms(enabled)`` inside the block (the MSDA backward then sorts instead of
    adding atomically), the previous setting after it."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled

    def __enter__(self):
        self.previous = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(self.enabled)

    def __exit__(self, *exc):
        torch.use_deterministic_algorithms(self.previous)


def msda_checks(dtype_name: str, device, tiny: bool = False) -> List[Check]:
    from deform_plugin.ops import multi_scale_deformable_attn

    dtype = DTYPES[dtype_name]
    limit, loc_limit = LIMITS[dtype_name]
    checks: List[Check] = []
    for shape in TINY_MSDA_SHAPES if tiny else MSDA_SHAPES:
        inputs = msda_inputs(shape, dtype)
        tables = (inputs["spatial_shapes"], inputs["level_start_index"])
        device_tables = tuple(t.to(device) for t in tables)
        sources = (inputs["value"], inputs["locations"], inputs["weights"])
        ref = _reference_leaves(sources)
        ref_out = multi_scale_deformable_attn(ref[0], *tables, ref[1], ref[2], backend="pytorch")
        ref_grads = _grads(ref_out, ref, inputs["grad_output"])

        def run(leaves):
            return multi_scale_deformable_attn(leaves[0], *device_tables, leaves[1], leaves[2], backend="triton")

        with torch.no_grad():
            compare(checks, f"{shape.name} forward", run([t.to(device, dtype) for t in sources]), ref_out, limit)
        for mode in ("atomic", "deterministic"):
            with deterministic_algorithms(mode == "deterministic"):
                leaves = _device_leaves(sources, dtype, device)
                out = run(leaves)
                grads = _grads(out, leaves, inputs["grad_output"])
                if mode == "deterministic":
                    again = _grads(run(leaves), leaves, inputs["grad_output"])
                    same = all(torch.equal(a, b) for a, b in zip(grads, again))
                    checks.append(Check(f"{shape.name} deterministic backward bitwise repeatable",
                                        0.0 if same else float("inf"), 0.0))
            compare(checks, f"{shape.name} {mode} output", out, ref_out, limit)
            for name, grad, ref_grad, grad_limit in zip(("grad_value", "grad_locations", "grad_weights"), grads,
                                                        ref_grads, (limit, loc_limit, limit)):
                compare(checks, f"{shape.name} {mode} {name}", grad, ref_grad, grad_limit)
        checks += _msda_non_finite_checks(shape, inputs, device_tables, tables, dtype, limit)
    return checks


def _non_finite_locations(locations: torch.Tensor) -> torch.Tensor:
    # Every 5th coordinate NaN, inf, -inf or 1e30 in turn: samples the kernels must skip (and park) safely.
    specials = torch.tensor([float("nan"), float("inf"), float("-inf"), 1e30], dtype=locations.dtype)
    flat = locations.clone().view(-1)
    picked = torch.arange(0, flat.numel(), 5)
    flat[picked] = specials[torch.arange(len(picked)) % len(specials)]
    return flat.view_as(locations)


def _msda_non_finite_checks(shape, inputs, device_tables, tables, dtype, limit) -> List[Check]:
    """Forward and backward with non-finite locations: such samples contribute nothing and get zero gradient."""
    from deform_plugin.ops import multi_scale_deformable_attn

    checks: List[Check] = []
    locations = _non_finite_locations(inputs["locations"])
    taken = torch.isfinite(locations).all(-1) & (locations.abs() < 1e3).all(-1)
    # The reference gets the skipped samples' weights zeroed and in-map locations instead (its own treatment of
    # non-finite points is not what is tested here): the same output, finite gradients to compare with.
    ref_locations = torch.where(taken[..., None], locations, torch.full_like(locations, 0.5))
    ref_weights = torch.where(taken, inputs["weights"], torch.zeros_like(inputs["weights"]))
    ref = _reference_leaves((inputs["value"], ref_locations, ref_weights))
    ref_out = multi_scale_deformable_attn(ref[0], *tables, ref[1], ref[2], backend="pytorch")
    ref_grad_value = _grads(ref_out, ref, inputs["grad_output"])[0]
    leaves = _device_leaves((inputs["value"], locations, inputs["weights"]), dtype, device_tables[0].device)
    out = multi_scale_deformable_attn(leaves[0], *device_tables, leaves[1], leaves[2], backend="triton")
    grad_value, grad_locations, grad_weights = _grads(out, leaves, inputs["grad_output"])
    compare(checks, f"{shape.name} non-finite locations output", out, ref_out, limit)
    compare(checks, f"{shape.name} non-finite locations grad_value", grad_value, ref_grad_value, limit)
    skipped = ~taken.to(grad_weights.device)
    zero_where_skipped = (grad_locations[skipped].abs().sum() + grad_weights[skipped].abs().sum()).item()
    checks.append(Check(f"{shape.name} non-finite locations: zero gradients where skipped",
                        0.0 if zero_where_skipped == 0.0 else float("inf"), 0.0))
    return checks


def fused_msda_checks(dtype_name: str, device, tiny: bool = False) -> List[Check]:
    from deform_plugin.ops import fused_multi_scale_deformable_attn

    dtype = DTYPES[dtype_name]
    limit, loc_limit = LIMITS[dtype_name]
    checks: List[Check] = []
    for shape in TINY_MSDA_SHAPES if tiny else MSDA_SHAPES:
        inputs = msda_inputs(shape, dtype)
        tables = (inputs["spatial_shapes"], inputs["level_start_index"])
        device_tables = tuple(t.to(device) for t in tables)
        for ref_dim in (2, 4):
            fused = fused_inputs(shape, ref_dim, dtype)
            sources = (inputs["value"], fused["reference"], fused["offsets"], inputs["logits"])
            ref = _reference_leaves(sources)
            ref_out = fused_multi_scale_deformable_attn(ref[0], *tables, *ref[1:], backend="pytorch")
            ref_grads = _grads(ref_out, ref, inputs["grad_output"])
            label = f"{shape.name} ref{ref_dim}"

            def run(leaves):
                return fused_multi_scale_deformable_attn(leaves[0], *device_tables, *leaves[1:], backend="triton")

            with torch.no_grad():
                compare(checks, f"{label} forward", run([t.to(device, dtype) for t in sources]), ref_out, limit)
            for mode in ("atomic", "atomic without reference grad", "deterministic"):
                with deterministic_algorithms(mode == "deterministic"):
                    leaves = _device_leaves(sources, dtype, device)
                    if mode == "atomic without reference grad":
                        leaves[1].requires_grad_(False)
                    differentiated = [leaf for leaf in leaves if leaf.requires_grad]
                    out = run(leaves)
                    grads = dict(zip([id(t) for t in differentiated],
                                     _grads(out, differentiated, inputs["grad_output"])))
                compare(checks, f"{label} {mode} output", out, ref_out, limit)
                names = ("grad_value", "grad_reference", "grad_offsets", "grad_logits")
                for name, leaf, ref_grad, grad_limit in zip(names, leaves, ref_grads,
                                                            (limit, loc_limit, loc_limit, limit)):
                    if id(leaf) in grads:
                        compare(checks, f"{label} {mode} {name}", grads[id(leaf)], ref_grad, grad_limit)
    return checks


# ---- deform_sdpa ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SDPAShape:
    batch: int
    views: int
    samples: int
    heads: int
    head_dim: int
    width: int
    height: int

    @property
    def name(self) -> str:
        return (f"B{self.batch}-V{self.views}-S{self.samples}-H{self.heads}-D{self.head_dim}-"
                f"{self.width}x{self.height}")


# head_dim 24 padded to 32 (masked channels), 16 unpadded (EVEN_D); 66 keys span several key blocks.
SDPA_SHAPES = (
    SDPAShape(batch=1, views=2, samples=3, heads=3, head_dim=24, width=5, height=3),
    SDPAShape(batch=2, views=3, samples=2, heads=1, head_dim=16, width=3, height=1),
    SDPAShape(batch=1, views=2, samples=33, heads=2, head_dim=32, width=2, height=3),
)
TINY_SDPA_SHAPES = SDPA_SHAPES[1:2]


def sdpa_inputs(shape: SDPAShape, dtype: torch.dtype, seed: int = 0) -> Dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    pixels = shape.width * shape.height
    qkv_shape = (shape.batch, shape.views, shape.heads, pixels, shape.head_dim)
    coords_shape = (shape.batch, shape.views, pixels, shape.views, shape.samples)
    coords = torch.stack([away_from_pixel_edges(torch.tensor(float(shape.width)), coords_shape, dtype, generator),
                          away_from_pixel_edges(torch.tensor(float(shape.height)), coords_shape, dtype, generator)],
                         -1)
    q, k, v, grad_output = (rounded(torch.randn(qkv_shape, generator=generator, dtype=torch.float64), dtype)
                            for _ in range(4))
    return dict(q=q, k=k, v=v, coords=coords, grad_output=grad_output)


def sdpa_checks(dtype_name: str, device, tiny: bool = False) -> List[Check]:
    from deform_plugin.ops.deform_sdpa import deform_sdpa

    dtype = DTYPES[dtype_name]
    limit, loc_limit = LIMITS[dtype_name]
    checks: List[Check] = []
    for shape in TINY_SDPA_SHAPES if tiny else SDPA_SHAPES:
        inputs = sdpa_inputs(shape, dtype)
        sources = (inputs["q"], inputs["k"], inputs["v"], inputs["coords"])
        size = (shape.width, shape.height)
        ref = _reference_leaves(sources)
        ref_out = deform_sdpa(*ref, *size, backend="pytorch")
        ref_grads = _grads(ref_out, ref, inputs["grad_output"])
        with torch.no_grad():
            out = deform_sdpa(*[t.to(device, dtype) for t in sources], *size, backend="triton")
        compare(checks, f"{shape.name} forward", out, ref_out, limit)
        for coords_grad in (True, False):
            leaves = _device_leaves(sources, dtype, device)
            leaves[3].requires_grad_(coords_grad)
            differentiated = leaves if coords_grad else leaves[:3]
            out = deform_sdpa(*leaves, *size, backend="triton")
            grads = _grads(out, differentiated, inputs["grad_output"])
            mode = "backward" if coords_grad else "backward without coords grad"
            compare(checks, f"{shape.name} {mode} output", out, ref_out, limit)
            for name, grad, ref_grad, grad_limit in zip(("dq", "dk", "dv", "dcoords"), grads, ref_grads,
                                                        (limit, limit, limit, loc_limit)):
                compare(checks, f"{shape.name} {mode} {name}", grad, ref_grad, grad_limit)
        checks += _sdpa_non_finite_checks(shape, inputs, dtype, device, limit)
    return checks


def _sdpa_non_finite_checks(shape, inputs, dtype, device, limit) -> List[Check]:
    """Non-finite coordinates sample zero keys and values (score 0, still in the softmax): the reference gets a
    point far outside the map for each, which samples the same zeros."""
    from deform_plugin.ops.deform_sdpa import deform_sdpa

    coords = _non_finite_locations(inputs["coords"])
    far = torch.where(torch.isfinite(coords).all(-1, keepdim=True), coords, torch.full_like(coords, 1e3))
    size = (shape.width, shape.height)
    ref_out = deform_sdpa(inputs["q"], inputs["k"], inputs["v"], far, *size, backend="pytorch")
    leaves = _device_leaves((inputs["q"], inputs["k"], inputs["v"], coords), dtype, device)
    out = deform_sdpa(*leaves, *size, backend="triton")
    grads = _grads(out, leaves, inputs["grad_output"])
    checks: List[Check] = []
    compare(checks, f"{shape.name} non-finite coords output", out, ref_out, limit)
    finite = all(bool(torch.isfinite(grad).all()) for grad in grads)
    checks.append(Check(f"{shape.name} non-finite coords: finite gradients", 0.0 if finite else float("inf"), 0.0))
    return checks


# (rows, boxes, max_kept): odd sizes; the last walks past its kept boxes' 1024 lanes' worth of visits.
NMS_SHAPES = ((2, 37, 10), (3, 301, 64), (1, 3001, 900))
TINY_NMS_SHAPES = ((2, 13, 5),)


def nms_checks(dtype_name: str, device, tiny: bool = False) -> List[Check]:
    """Greedy NMS on Triton against its reference: kept indices and counts equal, with and without a valid mask."""
    from deform_plugin.ops import greedy_nms_first_kept, greedy_nms_first_kept_reference

    checks: List[Check] = []
    for rows, count, max_kept in TINY_NMS_SHAPES if tiny else NMS_SHAPES:
        generator = torch.Generator().manual_seed(rows * count)
        corner = torch.rand(rows, count, 2, generator=generator) * 64
        boxes = torch.cat([corner, corner + 4 + torch.rand(rows, count, 2, generator=generator) * 28], -1)
        scores = torch.rand(rows, count, generator=generator)
        for valid in (None, torch.rand(rows, count, generator=generator) < 0.7):
            expected = greedy_nms_first_kept_reference(boxes, scores, valid, 0.5, max_kept)
            got = greedy_nms_first_kept(boxes.to(device), scores.to(device),
                                        None if valid is None else valid.to(device), 0.5, max_kept, backend="triton")
            name = f"{rows}x{count} keep {max_kept}{'' if valid is None else ' masked'}"
            for part, actual, reference in zip(("kept", "count"), got, expected):
                wrong = int((actual.cpu() != reference).sum())
                checks.append(Check(f"{name} {part}: entries unequal to the reference", float(wrong), 0.0))
    return checks


def control_checks(dtype_name: str, device, tiny: bool = False) -> List[Check]:
    """The control: ``F.linear`` (cuBLAS on a GPU) and an elementwise multiply of its output, against float64. On an
    H200, initcheck names the multiply in bf16 (it does not see the writes of cuBLAS's bf16 GEMMs) and nothing in
    float32: the same report on one of our kernels reading a GEMM's output is the tool's, not a read of unwritten
    memory."""
    dtype = DTYPES[dtype_name]
    generator = torch.Generator().manual_seed(3)
    rows = 8 if tiny else 4096
    inputs = rounded(torch.randn(rows, 256, generator=generator, dtype=torch.float64), dtype)
    weight = rounded(torch.randn(128, 256, generator=generator, dtype=torch.float64), dtype)
    product = torch.nn.functional.linear(inputs.to(device, dtype), weight.to(device, dtype))
    checks: List[Check] = []
    compare(checks, f"linear {rows}x256 by 256x128, then times 2", (product * 2.0).double(),
            torch.nn.functional.linear(inputs, weight) * 2.0, LIMITS[dtype_name][0])
    return checks


# kind -> (checks(dtype_name, device, tiny), dtypes)
KERNEL_CASES: Dict[str, Tuple[Callable[..., List[Check]], Tuple[str, ...]]] = {
    "msda": (msda_checks, MSDA_DTYPES),
    "msda-fused": (fused_msda_checks, MSDA_DTYPES),
    "sdpa": (sdpa_checks, SDPA_DTYPES),
    "nms": (nms_checks, NMS_DTYPES),
    "control": (control_checks, CONTROL_DTYPES),
}
