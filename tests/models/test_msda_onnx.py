"""The drop-in MultiScaleDeformableAttention exported with torch.onnx.export, whatever its backend, run in ONNX
Runtime against the module itself (Triton backend under the interpreter on CPU): fp32, max abs error <= 1e-4."""
from __future__ import annotations

import pytest
import torch

import deform_plugin  # noqa: F401  (installs the integration)
from deform_plugin.models import MultiScaleDeformableAttention

onnx = pytest.importorskip("onnx")
onnxruntime = pytest.importorskip("onnxruntime")

SHAPES = [(6, 7), (3, 4), (2, 2)]
EMBED_DIMS, HEADS, POINTS, QUERIES, BATCH = 32, 4, 3, 7, 2
INPUT_NAMES = ("query", "value", "reference_points", "spatial_shapes", "level_start_index", "key_padding_mask")


class MSDACall(torch.nn.Module):
    """The module called as mmdet's encoder and decoder layers call it (keyword tables, batch-first)."""

    def __init__(self, attention, with_mask):
        super().__init__()
        self.attention = attention
        self.with_mask = with_mask

    def forward(self, query, value, reference_points, spatial_shapes, level_start_index, key_padding_mask):
        return self.attention(query, value=value, reference_points=reference_points, spatial_shapes=spatial_shapes,
                              level_start_index=level_start_index,
                              key_padding_mask=key_padding_mask if self.with_mask else None)


def make_module(backend):
    torch.manual_seed(0)
    module = MultiScaleDeformableAttention(embed_dims=EMBED_DIMS, num_heads=HEADS, num_levels=len(SHAPES),
                                           num_points=POINTS, batch_first=True, dropout=0.0, backend=backend)
    module.init_weights()
    with torch.no_grad():  # offsets and logits that move the samples (some outside the maps) and vary the weights
        module.sampling_offsets.weight.normal_(0, 0.5)
        module.attention_weights.weight.normal_(0, 0.2)
    return module.eval()


def make_inputs(box_reference):
    generator = torch.Generator().manual_seed(1)
    spatial_shapes = torch.tensor(SHAPES)
    sizes = spatial_shapes.prod(1)
    level_start_index = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)[:-1]])
    num_value = int(sizes.sum())
    reference_points = torch.rand(BATCH, QUERIES, len(SHAPES), 4 if box_reference else 2, generator=generator)
    if box_reference:
        reference_points[..., 2:] *= 0.5
    key_padding_mask = torch.zeros(BATCH, num_value, dtype=torch.bool)
    key_padding_mask[1, -9:] = True
    key_padding_mask[0, :5] = True
    return dict(query=torch.randn(BATCH, QUERIES, EMBED_DIMS, generator=generator),
                value=torch.randn(BATCH, num_value, EMBED_DIMS, generator=generator),
                reference_points=reference_points, spatial_shapes=spatial_shapes,
                level_start_index=level_start_index, key_padding_mask=key_padding_mask)


def export_and_compare(backend, box_reference, with_mask, dynamo, path):
    # The Triton backend runs where it can: CUDA on a GPU machine, the interpreter on a CPU-only one (conftest).
    device = "cuda" if backend in ("triton", "auto") and torch.cuda.is_available() else "cpu"
    module = MSDACall(make_module(backend), with_mask).to(device)
    inputs = make_inputs(box_reference)
    with torch.no_grad():
        expected = module(**{k: v.to(device) for k, v in inputs.items()}).cpu()
    inputs = {k: v.to(device) for k, v in inputs.items()}
    opset = 18 if dynamo else 17  # 18: the dynamo exporter's lowest opset with its own translations
    export_kwargs = dict(verbose=False) if dynamo else {}
    torch.onnx.export(module, tuple(inputs.values()), str(path), input_names=list(INPUT_NAMES), dynamo=dynamo,
                      opset_version=opset, **export_kwargs)
    model = onnx.load(str(path))
    assert {node.domain for node in model.graph.node} <= {"", "ai.onnx"}
    assert "GridSample" in {node.op_type for node in model.graph.node}
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    got = session.run(None, {k: v.cpu().numpy() for k, v in inputs.items() if k in names})[0]
    error = (torch.from_numpy(got) - expected).abs().max().item()
    assert error <= 1e-4, f"max abs error {error:.3g}"
    assert expected.abs().max() > 0.1  # not a vacuous comparison


@pytest.mark.parametrize("with_mask", [False, True], ids=["no-mask", "key-padding-mask"])
@pytest.mark.parametrize("box_reference", [False, True], ids=["ref2d", "ref4d"])
@pytest.mark.parametrize("backend", ["pytorch", "triton", "auto"])
def test_module_exports_torchscript(backend, box_reference, with_mask, tmp_path):
    export_and_compare(backend, box_reference, with_mask, dynamo=False, path=tmp_path / "msda.onnx")


# The default exporter takes ~3 s a call on a small CPU: one case per backend, between them every input variant.
@pytest.mark.parametrize("backend,box_reference,with_mask", [
    pytest.param("pytorch", False, True, id="pytorch-ref2d-key-padding-mask"),
    pytest.param("triton", True, False, id="triton-ref4d-no-mask"),
    pytest.param("auto", True, True, id="auto-ref4d-key-padding-mask"),
])
def test_module_exports_dynamo(backend, box_reference, with_mask, tmp_path):
    export_and_compare(backend, box_reference, with_mask, dynamo=True, path=tmp_path / "msda.onnx")
