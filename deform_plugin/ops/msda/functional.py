"""Public entry points of the MSDA op: validate, pick a backend, run it."""
from __future__ import annotations

import logging
import threading
import weakref
from typing import Callable, Dict, Optional, Tuple

import torch
from torch._C._autograd import _profiler_enabled
from torch.profiler import record_function

from ..backend import get_default_backend, registered_backend, resolve_backend
from ..triton_support import triton_interpreter_enabled, triton_unavailable_reason, warm_up_triton
from .checks import MSDAShape, check_fused_msda_inputs, check_msda_inputs
from .export import fused_multi_scale_deformable_attn_export, in_onnx_export, multi_scale_deformable_attn_export
from .level_tables import host_level_tables
from .reference import multi_scale_deformable_attn_reference, sampling_locations_from_offsets

OP_NAME = "msda"
# The profiler's name for the op's work (entered only while a profiler runs: the range costs a few microseconds).
PROFILER_RANGE = "deform_plugin::msda"


class _ValidatedCalls:
    """The outcome of validating a call (its sizes) and resolving its backend, kept for calls that repeat it.

    A detector calls the op with the same level-table tensors and the same shapes in every layer of every step, and
    validation plus backend resolution cost more host time than the kernel launch of a decoder-sized call. A call
    whose table tensors (the same objects, unmodified), shapes, dtypes, devices and backend choice equal those of an
    accepted call skips both: none of them can fail where the accepted call passed. Any other call is validated in
    full, so bad input still gets its error.
    """

    def __init__(self, check: Callable[..., MSDAShape], max_entries: int = 256):
        self._check = check
        self._max_entries = max_entries
        self._entries: Dict[tuple, Tuple[weakref.ref, weakref.ref, MSDAShape, str]] = {}

    def shape_and_backend(self, backend: Optional[str], value: torch.Tensor, spatial_shapes: torch.Tensor,
                          level_start_index: torch.Tensor, *per_query: torch.Tensor) -> Tuple[MSDAShape, str]:
        if torch.compiler.is_compiling():  # traced tensors: validate every trace (it reads no table then)
            return self._accept(backend, value, spatial_shapes, level_start_index, per_query)
        try:
            key = (id(spatial_shapes), spatial_shapes._version, id(level_start_index), level_start_index._version,
                   spatial_shapes.dtype, level_start_index.dtype, value.shape, value.dtype, value.device,
                   tuple((t.shape, t.dtype, t.device) for t in per_query),
                   backend, get_default_backend() if backend is None else None)
        except AttributeError:  # not tensors: the full check names the bad argument
            return self._accept(backend, value, spatial_shapes, level_start_index, per_query)
        entry = self._entries.get(key)
        # The weak references tell a table from a newer tensor that reuses a dead one's id.
        if entry is not None and entry[0]() is spatial_shapes and entry[1]() is level_start_index:
            return entry[2], entry[3]
        shape, name = self._accept(backend, value, spatial_shapes, level_start_index, per_query)
        if len(self._entries) >= self._max_entries:
            del self._entries[next(iter(self._entries))]
        self._entries[key] = (weakref.ref(spatial_shapes), weakref.ref(level_start_index), shape, name)
        return shape, name

    def _accept(self, backend, value, spatial_shapes, level_start_index, per_query):
        shape = self._check(value, spatial_shapes, level_start_index, *per_query)
        return shape, resolve_backend(OP_NAME, backend, value.device)


_plain_calls = _ValidatedCalls(check_msda_inputs)
_fused_calls = _ValidatedCalls(check_fused_msda_inputs)


def multi_scale_deformable_attn(value: torch.Tensor, spatial_shapes: torch.Tensor, level_start_index: torch.Tensor,
                                sampling_locations: torch.Tensor, attention_weights: torch.Tensor,
                                backend: Optional[str] = None) -> torch.Tensor:
    """Multi-scale deformable attention (Deformable-DETR), a drop-in for mmcv's op with any batch size.

    Args:
        value: ``(B, S, H, D)`` values of all levels, each level's map flattened row-major, levels concatenated.
        spatial_shapes: ``(L, 2)`` integer (h, w) of each level.
        level_start_index: ``(L,)`` offset of each level in S: ``[0, h0*w0, h0*w0 + h1*w1, ...]``.
        sampling_locations: ``(B, Q, H, L, P, 2)`` normalized (x, y); pixel = x * w - 0.5 (mmcv's convention).
            Locations outside the map, NaN or infinite contribute zero.
        attention_weights: ``(B, Q, H, L, P)`` weight of each sample (usually a softmax over L*P).
        backend: ``'auto'``, ``'triton'``, ``'pytorch'``, a registered backend (``'mmcv'`` where mmcv's compiled
            ops are installed) or None for the process default (see :mod:`deform_plugin.ops.backend`).

    Returns:
        ``(B, Q, H*D)`` in the dtype of ``value``.

    The level tables are read on the host once per tensor object (see :mod:`.checks`): pass the same tensors to
    every call of a forward, as mmdet does, and no call waits for the GPU.

    Example:
        >>> value = torch.randn(2, 12 * 20 + 6 * 10, 8, 32)
        >>> shapes = torch.tensor([[12, 20], [6, 10]])
        >>> starts = torch.tensor([0, 240])
        >>> loc = torch.rand(2, 100, 8, 2, 4, 2)
        >>> weights = torch.rand(2, 100, 8, 2, 4).softmax(-1)
        >>> multi_scale_deformable_attn(value, shapes, starts, loc, weights).shape
        torch.Size([2, 100, 256])
    """
    if in_onnx_export():  # standard ONNX operators whatever the backend (see .export)
        check_msda_inputs(value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
        return multi_scale_deformable_attn_export(value, spatial_shapes, level_start_index, sampling_locations,
                                                  attention_weights)
    shape, name = _plain_calls.shape_and_backend(backend, value, spatial_shapes, level_start_index,
                                                 sampling_locations, attention_weights)
    if shape.is_empty:
        return value.new_zeros((shape.batch, shape.num_queries, shape.num_heads * shape.head_dim))
    if _profiling():
        with record_function(PROFILER_RANGE):
            return _run(name, value, spatial_shapes, level_start_index, sampling_locations, attention_weights)
    return _run(name, value, spatial_shapes, level_start_index, sampling_locations, attention_weights)


_triton_op_module = None


def _triton_op():
    # Imported at the first Triton call (the op loads without triton installed), then kept: an import statement
    # in the call path costs host time on every call.
    global _triton_op_module
    if _triton_op_module is None:
        from . import triton_op
        _triton_op_module = triton_op
    return _triton_op_module


_warm_up_thread: Optional[threading.Thread] = None
_warm_up_lock = threading.Lock()


def prepare_triton_in_background() -> Optional[threading.Thread]:
    """Start, on a daemon thread, the one-time host work of the process's first Triton MSDA call, and return it.

    That work (Triton's cache key and lazy imports, see :func:`warm_up_triton`; the custom ops' registration with
    the dispatcher, ~0.15 s) would otherwise fall in the first training iteration or the first image. Started while
    a run builds its model and its data loader's workers start, it overlaps them. A call that comes first does the
    rest itself. Once per process: later calls return the first thread. None (nothing started) where the Triton
    kernels cannot run on CUDA.
    """
    global _warm_up_thread
    if _warm_up_thread is not None:
        return _warm_up_thread
    if triton_interpreter_enabled() or not torch.cuda.is_available() or \
            triton_unavailable_reason(torch.device("cuda")) is not None:
        return None
    with _warm_up_lock:
        if _warm_up_thread is None:
            _warm_up_thread = _start_triton_warm_up()
        return _warm_up_thread


def prepare_first_call_in_background(backend: Optional[str] = None) -> Optional[threading.Thread]:
    """:func:`prepare_triton_in_background` where ``backend`` (None: the process default) can resolve to Triton;
    None otherwise. For a module to call when it is built: the work then overlaps the rest of the model's building
    and its weights' loading."""
    requested = backend if backend is not None else get_default_backend()
    if requested not in ("auto", "triton"):
        return None
    return prepare_triton_in_background()


def _start_triton_warm_up() -> threading.Thread:

    def prepare():
        try:
            warm_up_triton()
            _triton_op()
        except Exception as error:  # a warm-up only: the first call does the same work and reports real errors
            logging.getLogger(__name__).debug("Triton warm-up stopped: %r", error)

    thread = threading.Thread(target=prepare, name="deform_plugin-triton-warm-up", daemon=True)
    thread.start()
    return thread


def _profiling() -> bool:
    # Under torch.compile the profiler sees the compiled graph's own ranges; the flag is not traceable anyway.
    return not torch.compiler.is_compiling() and _profiler_enabled()


def _run(name, value, spatial_shapes, level_start_index, sampling_locations, attention_weights):
    if name == "triton":
        return _triton_op().multi_scale_deformable_attn_triton(value, spatial_shapes, level_start_index,
                                                               sampling_locations, attention_weights)
    if name == "pytorch":
        if not torch.compiler.is_compiling():
            # The host copies the checks made: the reference then never reads a table tensor itself.
            spatial_shapes, level_start_index = host_level_tables(spatial_shapes, level_start_index)
        return multi_scale_deformable_attn_reference(value, spatial_shapes, level_start_index, sampling_locations,
                                                     attention_weights)
    return registered_backend(OP_NAME, name).implementation(value, spatial_shapes, level_start_index,
                                                            sampling_locations, attention_weights)


def fused_multi_scale_deformable_attn(value: torch.Tensor, spatial_shapes: torch.Tensor,
                                      level_start_index: torch.Tensor, reference_points: torch.Tensor,
                                      sampling_offsets: torch.Tensor, attention_logits: torch.Tensor,
                                      backend: Optional[str] = None) -> torch.Tensor:
    """MSDA from the module's raw predictions: softmax and location arithmetic fused into the op.

    Computes ``multi_scale_deformable_attn(value, ..., locations, softmax(attention_logits over L*P))`` with
    ``locations`` from :func:`~deform_plugin.ops.msda.reference.sampling_locations_from_offsets`. The Triton
    backend does the softmax and the location arithmetic inside its kernels (no intermediate tensors); the other
    backends compose PyTorch ops.

    Args:
        value: ``(B, S, H, D)``.
        spatial_shapes, level_start_index: as in :func:`multi_scale_deformable_attn`.
        reference_points: ``(B, Q, L, 2)`` normalized points or ``(B, Q, L, 4)`` normalized boxes (cx, cy, w, h).
        sampling_offsets: ``(B, Q, H, L, P, 2)`` raw offsets predicted by the module.
        attention_logits: ``(B, Q, H, L, P)`` raw logits; the softmax runs over the last L*P values per head.
        backend: as in :func:`multi_scale_deformable_attn`.

    Returns:
        ``(B, Q, H*D)`` in the dtype of ``value``.
    """
    if in_onnx_export():  # standard ONNX operators whatever the backend (see .export)
        check_fused_msda_inputs(value, spatial_shapes, level_start_index, reference_points, sampling_offsets,
                                attention_logits)
        return fused_multi_scale_deformable_attn_export(value, spatial_shapes, level_start_index, reference_points,
                                                        sampling_offsets, attention_logits)
    shape, name = _fused_calls.shape_and_backend(backend, value, spatial_shapes, level_start_index, reference_points,
                                                 sampling_offsets, attention_logits)
    if shape.is_empty:
        return value.new_zeros((shape.batch, shape.num_queries, shape.num_heads * shape.head_dim))
    if name == "triton":
        fused_triton = _triton_op().fused_multi_scale_deformable_attn_triton
        if _profiling():
            with record_function(PROFILER_RANGE):
                return fused_triton(value, spatial_shapes, level_start_index, reference_points, sampling_offsets,
                                    attention_logits)
        return fused_triton(value, spatial_shapes, level_start_index, reference_points, sampling_offsets,
                            attention_logits)
    weights = attention_logits.flatten(-2).softmax(-1).view_as(attention_logits)
    locations = sampling_locations_from_offsets(reference_points, sampling_offsets, spatial_shapes)
    return multi_scale_deformable_attn(value, spatial_shapes, level_start_index, locations, weights, backend=name)
