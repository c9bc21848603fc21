"""The ONNX export path of the MSDA entry points: its formulation against the reference, and the exported graphs in
ONNX Runtime, through both exporters (TorchScript, ``dynamo=False``; torch.export, the default)."""
from __future__ import annotations

import pytest
import torch

from deform_plugin.ops.msda import (fused_multi_scale_deformable_attn, multi_scale_deformable_attn,
                                    multi_scale_deformable_attn_reference, sampling_locations_from_offsets)
from deform_plugin.ops.msda.export import (fused_multi_scale_deformable_attn_export, in_onnx_export,
                                           multi_scale_deformable_attn_export)

onnx = pytest.importorskip("onnx")
onnxruntime = pytest.importorskip("onnxruntime")

# (h, w) per level: single level, non-square odd sizes, a 1-pixel level.
SHAPES = {
    "L1-5x7": [(5, 7)],
    "L3-odd": [(7, 5), (3, 4), (1, 1)],
}
TS_OPSET = 17
DYNAMO_OPSET = 18  # the dynamo exporter's lowest opset with its own translations


def level_tables(shapes):
    spatial_shapes = torch.tensor(shapes, dtype=torch.long)
    sizes = spatial_shapes.prod(1)
    return spatial_shapes, torch.cat([sizes.new_zeros(1), sizes.cumsum(0)[:-1]]), int(sizes.sum())


def make_inputs(shapes, batch=2, queries=6, heads=2, head_dim=5, points=3, dtype=torch.float64, seed=0):
    """Locations over [-0.3, 1.3] (some outside every map), plus one NaN, one inf and one huge coordinate."""
    generator = torch.Generator().manual_seed(seed)
    spatial_shapes, level_start_index, num_keys = level_tables(shapes)
    levels = len(shapes)
    value = torch.randn(batch, num_keys, heads, head_dim, generator=generator, dtype=dtype)
    locations = torch.rand(batch, queries, heads, levels, points, 2, generator=generator, dtype=dtype) * 1.6 - 0.3
    locations[0, 0, 0, 0, 0, 0] = float("nan")
    locations[1, 1, 1, -1, 1, 1] = float("inf")
    locations[0, 2, 1, 0, 2, 0] = -1e30
    weights = torch.rand(batch, queries, heads, levels, points, generator=generator, dtype=dtype)
    return value, spatial_shapes, level_start_index, locations, weights


def assert_standard_onnx(path):
    """Only operators of the default ONNX domain, GridSample among them."""
    model = onnx.load(path)
    onnx.checker.check_model(model)
    domains = {node.domain for node in model.graph.node}
    assert domains <= {"", "ai.onnx"}, domains
    assert "GridSample" in {node.op_type for node in model.graph.node}


def run_onnx(path, inputs):
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    return torch.from_numpy(session.run(None, {k: v.numpy() for k, v in inputs.items() if k in names})[0])


@pytest.mark.parametrize("shapes", list(SHAPES.values()), ids=list(SHAPES))
def test_export_formulation_matches_reference_float64(shapes):
    value, spatial_shapes, level_start_index, locations, weights = make_inputs(shapes)
    expected = multi_scale_deformable_attn_reference(value, spatial_shapes, level_start_index, locations, weights)
    got = multi_scale_deformable_attn_export(value, spatial_shapes, level_start_index, locations, weights)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_non_finite_and_far_locations_contribute_zero():
    spatial_shapes, level_start_index, num_keys = level_tables(SHAPES["L1-5x7"])
    value = torch.randn(1, num_keys, 1, 4, dtype=torch.float64)
    # (B=1, Q=4, H=1, L=1, P=1, 2): NaN, -inf, huge and just-outside (pixel x = 2 * 7 - 0.5) locations.
    locations = torch.tensor([[float("nan"), 0.5], [0.5, float("-inf")], [1e30, 0.5], [2.0, 0.5]],
                             dtype=torch.float64).view(1, 4, 1, 1, 1, 2)
    weights = torch.ones(1, 4, 1, 1, 1, dtype=torch.float64)
    got = multi_scale_deformable_attn_export(value, spatial_shapes, level_start_index, locations, weights)
    assert torch.equal(got, torch.zeros_like(got))


def test_fused_export_formulation_matches_reference_float64():
    value, spatial_shapes, level_start_index, _, _ = make_inputs(SHAPES["L3-odd"])
    generator = torch.Generator().manual_seed(1)
    reference_points = torch.rand(2, 6, 3, 4, generator=generator, dtype=torch.float64)
    offsets = torch.randn(2, 6, 2, 3, 3, 2, generator=generator, dtype=torch.float64)
    logits = torch.randn(2, 6, 2, 3, 3, generator=generator, dtype=torch.float64)
    weights = logits.flatten(-2).softmax(-1).view_as(logits)
    locations = sampling_locations_from_offsets(reference_points, offsets, spatial_shapes)
    expected = multi_scale_deformable_attn_reference(value, spatial_shapes, level_start_index, locations, weights)
    got = fused_multi_scale_deformable_attn_export(value, spatial_shapes, level_start_index, reference_points,
                                                   offsets, logits)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_not_in_onnx_export_outside_an_export():
    assert not in_onnx_export()


class PlainMSDA(torch.nn.Module):
    def __init__(self, backend):
        super().__init__()
        self.backend = backend

    def forward(self, value, spatial_shapes, level_start_index, locations, weights):
        return multi_scale_deformable_attn(value, spatial_shapes, level_start_index, locations, weights,
                                           backend=self.backend)


class FusedMSDA(PlainMSDA):
    def forward(self, value, spatial_shapes, level_start_index, reference_points, offsets, logits):
        return fused_multi_scale_deformable_attn(value, spatial_shapes, level_start_index, reference_points, offsets,
                                                 logits, backend=self.backend)


def export(module, inputs, path, dynamo):
    args = tuple(inputs.values())
    if dynamo:
        torch.onnx.export(module, args, str(path), input_names=list(inputs), dynamo=True, opset_version=DYNAMO_OPSET,
                          verbose=False)
    else:
        torch.onnx.export(module, args, str(path), input_names=list(inputs), dynamo=False, opset_version=TS_OPSET)
    assert_standard_onnx(str(path))


def float32_inputs(shapes):
    value, spatial_shapes, level_start_index, locations, weights = make_inputs(shapes, dtype=torch.float32)
    return dict(value=value, spatial_shapes=spatial_shapes, level_start_index=level_start_index,
                locations=locations, weights=weights)


@pytest.mark.parametrize("backend", ["auto", "triton", "pytorch"])
def test_plain_entry_exports_whatever_the_backend_torchscript(backend, tmp_path):
    inputs = float32_inputs(SHAPES["L3-odd"])
    export(PlainMSDA(backend).eval(), inputs, tmp_path / "msda.onnx", dynamo=False)
    expected = multi_scale_deformable_attn_reference(*(t.double() if t.is_floating_point() else t
                                                       for t in inputs.values()))
    torch.testing.assert_close(run_onnx(tmp_path / "msda.onnx", inputs).double(), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("backend", ["auto", "triton", "pytorch"])
def test_fused_entry_exports_whatever_the_backend_torchscript(backend, tmp_path):
    value, spatial_shapes, level_start_index, _, _ = make_inputs(SHAPES["L3-odd"], dtype=torch.float32)
    generator = torch.Generator().manual_seed(2)
    inputs = dict(value=value, spatial_shapes=spatial_shapes, level_start_index=level_start_index,
                  reference_points=torch.rand(2, 6, 3, 2, generator=generator),
                  offsets=torch.randn(2, 6, 2, 3, 3, 2, generator=generator),
                  logits=torch.randn(2, 6, 2, 3, 3, generator=generator))
    export(FusedMSDA(backend).eval(), inputs, tmp_path / "fused.onnx", dynamo=False)
    expected = fused_multi_scale_deformable_attn(*(t.double() if t.is_floating_point() else t
                                                   for t in inputs.values()), backend="pytorch")
    torch.testing.assert_close(run_onnx(tmp_path / "fused.onnx", inputs).double(), expected, rtol=0, atol=1e-5)


def test_dynamo_export_reads_level_sizes_when_the_graph_runs(tmp_path):
    """torch.export cannot read the tables while tracing: the graph reads them when it runs, so the same file takes
    other level sizes that tile the same keys (traced with 7x5 + 3x4 + 1x1, run also with 6x6 + 2x5 + 1x2)."""
    traced = float32_inputs(SHAPES["L3-odd"])
    export(PlainMSDA("triton").eval(), traced, tmp_path / "msda.onnx", dynamo=True)
    retiled = dict(traced, spatial_shapes=torch.tensor([(6, 6), (2, 5), (1, 2)]),
                   level_start_index=torch.tensor([0, 36, 46]))
    for feeds in (traced, retiled):
        expected = multi_scale_deformable_attn_reference(*(t.double() if t.is_floating_point() else t
                                                           for t in feeds.values()))
        torch.testing.assert_close(run_onnx(tmp_path / "msda.onnx", feeds).double(), expected, rtol=0, atol=1e-5)
