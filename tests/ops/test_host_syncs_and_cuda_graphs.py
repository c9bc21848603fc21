"""The public ops never wait for the GPU in the steady state, and they capture in CUDA graphs.

On a CPU: the level tables are read on the host once per tensor, never again. On a GPU: forward and backward of the
plain op, the fused op, the module and deform_sdpa run under ``torch.cuda.set_sync_debug_mode("error")`` after one
warm-up call, and the public op and the module capture with ``torch.cuda.graph`` and replay to the eager result.
"""
import contextlib

import pytest
import torch

from deform_plugin.ops import deform_sdpa, fused_multi_scale_deformable_attn, multi_scale_deformable_attn
from deform_plugin.ops.msda.level_tables import level_table_host_reads, make_level_tables

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
requires_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device: syncs and graphs are CUDA concepts")
LEVELS = [(12, 20), (6, 10), (3, 5)]


def _tables():
    shapes = torch.tensor(LEVELS, device=DEVICE)
    sizes = shapes.prod(1)
    return shapes, torch.cat([sizes.new_zeros(1), sizes.cumsum(0)[:-1]])


def _plain_inputs(generator, batch=2, queries=33, heads=4, head_dim=16, points=3):
    num_keys = sum(h * w for h, w in LEVELS)
    value = torch.randn(batch, num_keys, heads, head_dim, generator=generator).to(DEVICE)
    locations = torch.rand(batch, queries, heads, len(LEVELS), points, 2, generator=generator).to(DEVICE)
    weights = torch.rand(batch, queries, heads, len(LEVELS), points, generator=generator).softmax(-1).to(DEVICE)
    return [t.requires_grad_() for t in (value, locations, weights)]


def _fused_inputs(generator, batch=2, queries=33, heads=4, head_dim=16, points=3):
    num_keys = sum(h * w for h, w in LEVELS)
    value = torch.randn(batch, num_keys, heads, head_dim, generator=generator).to(DEVICE)
    reference = torch.rand(batch, queries, len(LEVELS), 2, generator=generator).to(DEVICE)
    offsets = torch.randn(batch, queries, heads, len(LEVELS), points, 2, generator=generator).to(DEVICE)
    logits = torch.randn(batch, queries, heads, len(LEVELS), points, generator=generator).to(DEVICE)
    return [t.requires_grad_() for t in (value, reference, offsets, logits)]


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_level_tables_are_read_on_the_host_once_per_tensor(fused):
    backend = "triton" if ON_GPU else "pytorch"
    generator = torch.Generator().manual_seed(0)
    shapes, starts = _tables()
    before = level_table_host_reads()
    for _ in range(3):
        if fused:
            value, reference, offsets, logits = _fused_inputs(generator)
            out = fused_multi_scale_deformable_attn(value, shapes, starts, reference, offsets, logits,
                                                    backend=backend)
        else:
            value, locations, weights = _plain_inputs(generator)
            out = multi_scale_deformable_attn(value, shapes, starts, locations, weights, backend=backend)
        out.sum().backward()
    assert level_table_host_reads() - before == 2  # each of the two table tensors, once
    # New tensors (mmdet builds them once per forward) are read once each; an in-place change is read again.
    shapes2, starts2 = _tables()
    value, locations, weights = _plain_inputs(generator)
    multi_scale_deformable_attn(value, shapes2, starts2, locations, weights, backend=backend)
    assert level_table_host_reads() - before == 4
    starts2.add_(0)
    multi_scale_deformable_attn(value, shapes2, starts2, locations, weights, backend=backend)
    assert level_table_host_reads() - before == 5


class _CountingTable(torch.Tensor):
    """A level table that counts every read of its values on the host (on CUDA each one waits for the GPU)."""

    reads = 0
    HOST_READS = {"tolist", "item", "numpy", "__int__", "__index__", "__bool__", "__float__"}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in cls.HOST_READS:
            _CountingTable.reads += 1
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_no_per_call_host_read_of_the_tables(fused):
    # Independent of the op's own bookkeeping: the tables themselves count how often anyone reads them.
    generator = torch.Generator().manual_seed(4)
    shapes, starts = (t.cpu().as_subclass(_CountingTable) for t in _tables())
    _CountingTable.reads = 0
    for _ in range(4):
        if fused:
            value, reference, offsets, logits = (t.detach().cpu() for t in _fused_inputs(generator))
            fused_multi_scale_deformable_attn(value, shapes, starts, reference, offsets, logits, backend="pytorch")
        else:
            value, locations, weights = (t.detach().cpu() for t in _plain_inputs(generator))
            multi_scale_deformable_attn(value, shapes, starts, locations, weights, backend="pytorch")
    assert _CountingTable.reads == 2  # the first call read each table once; the three others read nothing


def test_tables_made_on_the_host_are_never_read_and_are_reused():
    generator = torch.Generator().manual_seed(5)
    before = level_table_host_reads()
    shapes, starts = make_level_tables(LEVELS, DEVICE)
    assert make_level_tables(LEVELS, DEVICE)[0] is shapes  # the same sizes give the same tensors
    expected_shapes, expected_starts = _tables()
    assert torch.equal(shapes, expected_shapes) and torch.equal(starts, expected_starts)
    value, locations, weights = _plain_inputs(generator)
    out = multi_scale_deformable_attn(value, shapes, starts, locations, weights)
    out.sum().backward()
    assert level_table_host_reads() == before


def test_tables_made_inside_a_graph_capture_are_written_by_kernels_and_not_kept(monkeypatch):
    # A capture cannot copy from the host (and a table it makes holds its values only once the graph replays):
    # tables of new sizes are filled by captured kernels, known to the op without a read, and never reused by an
    # eager call.
    from deform_plugin.ops.msda import level_tables
    levels = [(9, 14), (5, 7), (3, 4), (2, 2)]
    before = level_table_host_reads()
    monkeypatch.setattr(level_tables, "_in_graph_capture", lambda device: True)
    monkeypatch.setattr(level_tables, "_copied_to_device", lambda values, device: pytest.fail("copied in a capture"))
    shapes, starts = make_level_tables(levels, DEVICE)
    assert make_level_tables(levels, DEVICE)[0] is not shapes
    assert shapes.tolist() == [list(level) for level in levels] and starts.tolist() == [0, 126, 161, 173]
    assert level_tables.host_level_tables(shapes, starts) == (tuple(levels), (0, 126, 161, 173))
    assert level_table_host_reads() == before
    monkeypatch.undo()
    eager = make_level_tables(levels, DEVICE)
    assert eager[0] is not shapes and make_level_tables(levels, DEVICE)[0] is eager[0]


@requires_gpu
def test_tables_made_in_a_captured_graph_hold_their_values_after_replay():
    levels = [(11, 13), (6, 7), (3, 4)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        shapes, starts = make_level_tables(levels, DEVICE)
        total = shapes.prod(1).sum() + starts.sum()
    graph.replay()
    assert shapes.tolist() == [list(level) for level in levels] and starts.tolist() == [0, 143, 185]
    assert total.item() == 143 + 42 + 12 + 143 + 185


def test_tables_changed_in_place_are_validated_again():
    generator = torch.Generator().manual_seed(1)
    shapes, starts = _tables()
    value, locations, weights = _plain_inputs(generator)
    multi_scale_deformable_attn(value, shapes, starts, locations, weights, backend="pytorch")
    starts[1] += 1
    with pytest.raises(ValueError, match=r"level_start_index\[1\] = 241 but the levels before it cover 240 keys"):
        multi_scale_deformable_attn(value, shapes, starts, locations, weights, backend="pytorch")


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_a_repeated_call_skips_validation_and_any_other_call_is_validated(fused, monkeypatch):
    from deform_plugin.ops.msda import functional
    calls = functional._fused_calls if fused else functional._plain_calls
    validations = []
    check = calls._check
    monkeypatch.setattr(calls, "_check", lambda *args: validations.append(1) or check(*args))
    op = fused_multi_scale_deformable_attn if fused else multi_scale_deformable_attn
    make_inputs = _fused_inputs if fused else _plain_inputs
    generator = torch.Generator().manual_seed(6)
    shapes, starts = _tables()
    for _ in range(3):  # new tensors of the same shapes with the same tables, as every layer of a detector
        op(*make_inputs(generator)[:1], shapes, starts, *make_inputs(generator)[1:], backend="pytorch")
    assert len(validations) == 1
    inputs = make_inputs(generator, queries=20)  # another query count
    op(inputs[0], shapes, starts, *inputs[1:], backend="pytorch")
    assert len(validations) == 2
    # Bad input after accepted calls with the same tables still gets its error.
    inputs = make_inputs(generator)
    with pytest.raises(ValueError, match=r"has shape \(2, 33, 4, 3, 2\)"):
        op(inputs[0], shapes, starts, *inputs[1:-1], inputs[-1][..., :2], backend="pytorch")
    with pytest.raises(TypeError, match="must be an integer tensor"):
        op(inputs[0], shapes.float(), starts, *inputs[1:], backend="pytorch")
    with pytest.raises(ValueError, match="has no backend 'cuda'"):
        op(inputs[0], shapes, starts, *inputs[1:], backend="cuda")
    # Other tables holding the same values are other tensors: validated (and read) once each.
    other_shapes, other_starts = _tables()
    before = len(validations)
    op(inputs[0], other_shapes, other_starts, *inputs[1:], backend="pytorch")
    assert len(validations) == before + 1


@contextlib.contextmanager
def _syncs_are_errors():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _module(batch_first=True):
    import deform_plugin  # noqa: F401  (installs the integration where mmcv is present)
    from deform_plugin.models import MultiScaleDeformableAttention
    module = MultiScaleDeformableAttention(embed_dims=64, num_heads=4, num_levels=len(LEVELS), num_points=3,
                                           batch_first=batch_first, dropout=0.0, backend="triton").to(DEVICE)
    module.init_weights()
    return module


def _module_inputs(generator, batch=2, queries=33):
    num_keys = sum(h * w for h, w in LEVELS)
    query = torch.randn(batch, queries, 64, generator=generator).to(DEVICE).requires_grad_()
    value = torch.randn(batch, num_keys, 64, generator=generator).to(DEVICE).requires_grad_()
    reference = torch.rand(batch, queries, len(LEVELS), 2, generator=generator).to(DEVICE)
    return query, value, reference


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_steady_state_calls_never_sync(dtype):
    generator = torch.Generator().manual_seed(2)
    shapes, starts = _tables()
    plain = [t.detach().to(dtype).requires_grad_() for t in _plain_inputs(generator)]
    fused = [t.detach().to(dtype).requires_grad_() for t in _fused_inputs(generator)]
    module = _module().to(dtype)
    query, value, reference = (t.detach().to(dtype).requires_grad_(t.requires_grad)
                               for t in _module_inputs(generator))
    q, k, v = (torch.randn(1, 2, 2, 30, 16, device=DEVICE, dtype=dtype, requires_grad=True) for _ in range(3))
    coords = torch.rand(1, 2, 30, 2, 4, 2, device=DEVICE, dtype=dtype, requires_grad=True)

    def step():
        multi_scale_deformable_attn(plain[0], shapes, starts, *plain[1:]).float().sum().backward()
        fused_multi_scale_deformable_attn(fused[0], shapes, starts, *fused[1:]).float().sum().backward()
        module(query, value=value, reference_points=reference, spatial_shapes=shapes,
               level_start_index=starts).float().sum().backward()
        deform_sdpa(q, k, v, coords, 6, 5).float().sum().backward()

    step()  # warm-up: compiles, and reads each level table once
    with _syncs_are_errors():
        step()


@requires_gpu
@pytest.mark.parametrize("target", ["op", "fused_op", "module"])
def test_forward_backward_capture_in_a_cuda_graph_and_replay_to_eager(target):
    generator = torch.Generator().manual_seed(3)
    shapes, starts = _tables()
    if target == "module":
        module = _module()
        inputs = list(_module_inputs(generator))
        params = list(module.parameters())

        def forward():
            return module(inputs[0], value=inputs[1], reference_points=inputs[2], spatial_shapes=shapes,
                          level_start_index=starts)
    else:
        inputs = _plain_inputs(generator) if target == "op" else _fused_inputs(generator)
        params = []
        entry = multi_scale_deformable_attn if target == "op" else fused_multi_scale_deformable_attn

        def forward():
            return entry(inputs[0], shapes, starts, *inputs[1:])
    leaves = [t for t in inputs + params if t.requires_grad]
    grad_out = torch.randn_like(forward())

    def eager_result():
        for t in leaves:
            t.grad = None
        out = forward()
        out.backward(grad_out)
        return [out.detach().clone()] + [t.grad.detach().clone() for t in leaves]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            expected = eager_result()
    torch.cuda.current_stream().wait_stream(side)
    for t in leaves:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = forward()
        static_out.backward(grad_out)
    graph.replay()
    torch.cuda.synchronize()
    got = [static_out] + [t.grad for t in leaves]
    for actual, wanted in zip(got, expected):
        # Atomic accumulation orders differ between runs: float32 rounding, not bitwise.
        torch.testing.assert_close(actual, wanted, rtol=1e-5, atol=1e-5)
