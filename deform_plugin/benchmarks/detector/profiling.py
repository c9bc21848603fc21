"""Where a training step's time goes, from torch.profiler and named ranges.

Ranges (``torch.profiler.record_function``, prefix ``deform_plugin::``), none patched into the code they name:

- ``train_step``, ``forward`` (data preprocessor, forward, losses), ``backward``, ``optimizer`` (gradient clipping,
  step, zero_grad) and ``wait_for_device`` (this benchmark's own end-of-step synchronisation): the profiled step
  (:func:`profiled_train_step`) runs mmengine's ``train_step`` pieces itself, each in its range;
- ``msda``: entered by deform_plugin's MSDA op whenever a profiler runs;
- ``matching``: around every assigner's ``assign`` (:func:`matching_ranges`), and entered by the batched matching
  fast path's pass that solves a step's assignments ahead (its ``assign`` calls then only look them up; with the
  batched losses, none is made); rows with the matching fast path add ``matching.cost_terms``,
  ``matching.wait_and_copy_to_host`` and ``matching.scipy`` inside it.

Per step, :func:`analyse_profile` reports the device time by component (CUDA kernel time; on a CPU, op self-time),
the host time by component (CPU self-time of the ops and runtime calls that issued that work), the GPU-busy
fraction, kernels per step, host syncs per step (synchronising CUDA runtime calls), host reads per step
(``aten::_local_scalar_dense``: ``.item()``, ``bool(tensor)`` and friends, which wait for the device on a GPU) and
the host time in each named range. Work inside ``wait_for_device`` is the benchmark's, not the step's: it is left
out of the host times and counts.

The profiler's own cost falls on the host (each op and launch it records), so a host-bound step is slower under it
and its GPU looks idler than it is. :func:`profile_training` therefore also times the same steps without the
profiler: ``busy_fraction_unprofiled`` is the device's busy time per step (the union of kernel intervals, which
the profiler hardly changes) over that unprofiled wall time, the fraction a user's step keeps the GPU busy.
"""
from __future__ import annotations

import math
import re
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Optional

import torch

from deform_plugin.benchmarks.detector.timing import synchronize

RANGE_PREFIX = "deform_plugin::"
PROFILE_COMPONENTS = ("MSDA", "GEMM", "convolution", "optimizer", "matching", "elementwise", "memcpy", "other")
# Work issued inside these ranges is charged to the component, whatever the kernel's or op's name.
RANGE_COMPONENT = {"matching": "matching", "optimizer": "optimizer", "msda": "MSDA"}
BENCHMARK_SYNC_RANGE = "wait_for_device"
# CUDA runtime/driver calls that block the host until the device (or a stream) is done. A device-to-host
# cudaMemcpyAsync is followed by cudaStreamSynchronize, and is counted through it.
SYNC_CALLS = frozenset({"cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                        "cuCtxSynchronize", "cuStreamSynchronize", "cuEventSynchronize", "cuMemcpyDtoH"})
HOST_READ_OP = "aten::_local_scalar_dense"
_RUNTIME_CALL = re.compile(r"^cu(da)?[A-Z]")
_CONV = re.compile(r"conv|cudnn|fprop|dgrad|wgrad|winograd|implicit_convolve|implicit_gemm|nhwc|nchw", re.I)
_GEMM = re.compile(r"gemm|gemv|cutlass|cublas|matmul|xmma|nvjet|sgemm|hgemm|splitk|aten::mm\b|aten::addmm|aten::bmm|"
                   r"aten::baddbmm|aten::_scaled_dot|flash|fmha|attention", re.I)
_ELEMENTWISE = re.compile(r"elementwise|vectorized|unrolled|pointwise|triton_poi|fill|copy|aten::(add|mul|sub|div|"
                          r"sigmoid|relu|exp|log|where|clamp|pow|sqrt|neg|abs|rsub|lt|gt|le|ge|eq|ne|masked_fill|"
                          r"fill_|copy_|zero_|zeros|ones|cat|stack|index|gather|scatter|sign|floor|ceil|minimum|"
                          r"maximum|tanh|gelu|erf|reciprocal|rsqrt|bitwise)", re.I)
_MEMCPY = re.compile(r"^memcpy|^memset|Memcpy|Memset", re.I)


def classify_name(name: str, msda_pattern: re.Pattern) -> str:
    if msda_pattern.search(name):
        return "MSDA"
    if _MEMCPY.search(name):
        return "memcpy"
    if _CONV.search(name):
        return "convolution"
    if _GEMM.search(name):
        return "GEMM"
    if _ELEMENTWISE.search(name):
        return "elementwise"
    return "other"


# ---------------------------------------------------------------------------------------------------------------------
# The profiled step
# ---------------------------------------------------------------------------------------------------------------------

def profiled_train_step(model, optim_wrapper, batch, device: torch.device) -> dict:
    """mmengine's ``BaseModel.train_step`` and ``OptimWrapper.update_params``, piece by piece, in named ranges.

    Same calls in the same order as ``model.train_step(batch, optim_wrapper)`` (mmengine 0.10), then a device
    synchronisation so the step's range spans its device work.
    """
    from torch.profiler import record_function
    with record_function(RANGE_PREFIX + "train_step"):
        with record_function(RANGE_PREFIX + "forward"):
            with optim_wrapper.optim_context(model):
                data = model.data_preprocessor(batch, True)
                losses = model(**data, mode="loss")
            loss, log_vars = model.parse_losses(losses)
        with record_function(RANGE_PREFIX + "backward"):
            optim_wrapper.backward(optim_wrapper.scale_loss(loss))
        if optim_wrapper.should_update():
            with record_function(RANGE_PREFIX + "optimizer"):
                optim_wrapper.step()
                optim_wrapper.zero_grad()
        with record_function(RANGE_PREFIX + BENCHMARK_SYNC_RANGE):
            synchronize(device)
    return log_vars


@contextmanager
def matching_ranges(model):
    """Name every assigner's ``assign`` calls ``deform_plugin::matching`` while the context is open."""
    try:
        from mmdet.models.task_modules.assigners.base_assigner import BaseAssigner
    except ImportError:
        yield
        return
    assigners = {}
    for module in getattr(model, "module", model).modules():
        for value in vars(module).values():
            if isinstance(value, BaseAssigner):
                assigners[id(value)] = value
    # mmdet's assigners emit no profiler range and are not nn.Modules (no hooks): an instance attribute shadows
    # the class's ``assign`` for the profiled steps only, and is removed (or the previous one put back) after.
    wrapped = []
    for assigner in assigners.values():
        wrapped.append((assigner, vars(assigner).get("assign")))
        assigner.assign = _in_range(assigner.assign, RANGE_PREFIX + "matching")
    try:
        yield
    finally:
        for assigner, own in reversed(wrapped):
            if own is None:
                del assigner.assign
            else:
                assigner.assign = own


def _in_range(function, name: str):
    from torch.profiler import record_function

    def named(*args, **kwargs):
        with record_function(name):
            return function(*args, **kwargs)
    return named


def profile_training(model, optim_wrapper, batch, device: torch.device, steps: int, trace_path: Optional[str],
                     msda_pattern: re.Pattern) -> dict:
    """Two steps outside the profiler (no first-call effects inside it: the first warms up, the second captures
    the CUDA graphs of the ``cuda_graphs`` fast path), ``steps`` steps timed without the profiler, then ``steps``
    profiled steps."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    model.train()
    for _ in range(2):
        profiled_train_step(model, optim_wrapper, batch, device)
    with matching_ranges(model):  # the same ranges as the profiled steps (near-free without a profiler)
        started = time.perf_counter()
        for _ in range(steps):
            profiled_train_step(model, optim_wrapper, batch, device)
        unprofiled_ms = 1e3 * (time.perf_counter() - started) / steps if steps else None
    with matching_ranges(model), profile(activities=activities) as prof:
        for _ in range(steps):
            profiled_train_step(model, optim_wrapper, batch, device)
    if trace_path:
        prof.export_chrome_trace(trace_path)
    result = analyse_profile(prof.events(), steps, device, msda_pattern)
    result["trace"] = trace_path
    result.update(unprofiled_step_wall_ms=unprofiled_ms,
                  busy_fraction_unprofiled=unprofiled_busy_fraction(result, unprofiled_ms))
    return result


def unprofiled_busy_fraction(result: dict, unprofiled_ms: Optional[float]) -> Optional[float]:
    """The device's busy time per profiled step over the wall time of a step without the profiler (CUDA rows)."""
    busy, wall = result.get("busy_fraction"), result.get("step_wall_ms")
    if result.get("time_kind") != "CUDA" or None in (busy, wall, unprofiled_ms) or unprofiled_ms <= 0:
        return None
    return min(1.0, busy * wall / unprofiled_ms)


# ---------------------------------------------------------------------------------------------------------------------
# Analysis
# ---------------------------------------------------------------------------------------------------------------------

def _is_range(event) -> bool:
    # Custom ops registered under the same namespace (deform_plugin::deform_sdpa_forward) are ops, not ranges.
    return event.name.startswith(RANGE_PREFIX) and getattr(event, "is_user_annotation", True) is not False


def _issuing_name(event) -> str:
    """The op a runtime call (cudaLaunchKernel, cudaMemcpyAsync, ...) was made for; the event's own name otherwise."""
    name, parent = event.name, getattr(event, "cpu_parent", None)
    while _RUNTIME_CALL.match(name) and parent is not None and not _is_range(parent):
        name, parent = parent.name, getattr(parent, "cpu_parent", None)
    return name


def _union_us(intervals) -> float:
    busy, cursor = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end > cursor:
            busy += end - max(start, cursor)
            cursor = end
    return busy


def analyse_profile(events, steps: int, device: torch.device, msda_pattern: re.Pattern) -> dict:
    """Per-step times, counts and fractions of a profile of ``steps`` :func:`profiled_train_step` calls."""
    from torch.autograd import DeviceType
    cpu_events = [e for e in events if e.device_type == DeviceType.CPU and not e.is_async]
    ranges = defaultdict(list)
    for e in cpu_events:
        if _is_range(e):
            ranges[e.name[len(RANGE_PREFIX):]].append((e.time_range.start, e.time_range.end))
    step_ranges = ranges.get("train_step", [])
    wall_us = sum(end - start for start, end in step_ranges)
    window = (min(s for s, _ in step_ranges), max(e for _, e in step_ranges)) if step_ranges else None
    benchmark_waits = ranges.get(BENCHMARK_SYNC_RANGE, [])

    def enclosing_component(t_us: float) -> Optional[str]:
        for name, component in RANGE_COMPONENT.items():
            if any(start <= t_us <= end for start, end in ranges.get(name, ())):
                return component
        return None

    step_ops = [e for e in cpu_events if not _is_range(e) and not e.name.startswith("ProfilerStep")
                and not any(start <= e.time_range.start <= end for start, end in benchmark_waits)]
    host = defaultdict(float)
    for e in step_ops:
        component = enclosing_component(e.time_range.start) or classify_name(_issuing_name(e), msda_pattern)
        host[component] += e.self_cpu_time_total
    host_reads = sum(e.name == HOST_READ_OP for e in step_ops)

    if device.type == "cuda":
        launch_time = {}
        for e in cpu_events:
            launch_time.setdefault(e.id, e.time_range.start)
        device_time, intervals = defaultdict(float), []
        for e in events:
            if e.device_type != DeviceType.CUDA or e.name.startswith(RANGE_PREFIX) or e.name.startswith("ProfilerStep"):
                continue
            start, end = e.time_range.start, e.time_range.end
            if window and not (window[0] <= start <= window[1] + 1e6):
                continue
            intervals.append((start, end))
            # The launching CPU event is named by linked_correlation_id (absent in some torch releases); without
            # a launch time the kernel is classified by its name alone.
            launched = launch_time.get(getattr(e, "linked_correlation_id", None)) or launch_time.get(e.id)
            component = enclosing_component(launched) if launched is not None else None
            device_time[component or classify_name(e.name, msda_pattern)] += end - start
        busy_us, kernel_count, time_kind = _union_us(intervals), len(intervals), "CUDA"
        host_syncs = sum(e.name in SYNC_CALLS for e in step_ops) / steps
    else:
        device_time, time_kind = host, "CPU"
        busy_us, kernel_count = sum(host.values()), len(step_ops)
        host_syncs = None  # no device to wait for: host reads are the CPU rows' count

    def per_step_ms(times):
        return {name: times.get(name, 0.0) / 1e3 / steps for name in PROFILE_COMPONENTS}
    components_ms = per_step_ms(device_time)
    return {
        "time_kind": time_kind,
        "components_ms_per_step": components_ms,
        "host_components_ms_per_step": per_step_ms(host),
        "total_ms_per_step": sum(components_ms.values()),
        "step_wall_ms": wall_us / 1e3 / steps if steps else None,
        "busy_fraction": (busy_us / wall_us) if wall_us else None,
        ("kernels_per_step" if device.type == "cuda" else "ops_per_step"): kernel_count / steps,
        "host_syncs_per_step": host_syncs,
        "host_reads_per_step": host_reads / steps,
        "host_ms_per_step": {name: sum(end - start for start, end in spans) / 1e3 / steps
                             for name, spans in ranges.items() if name != "train_step"},
    }


def profile_lines(label: str, p: dict) -> str:
    """The lines printed for one profiled row."""
    parts = ", ".join(f"{k} {v:.1f}" for k, v in p["components_ms_per_step"].items())
    busy = f"{100 * p['busy_fraction']:.0f}%" if p["busy_fraction"] is not None else "n/a"
    host_ranges = ", ".join(f"{k} {v:.2f}" for k, v in p["host_ms_per_step"].items())
    unprofiled = ""
    if p.get("busy_fraction_unprofiled") is not None:
        unprofiled = (f" (without the profiler: step wall {p['unprofiled_step_wall_ms']:.1f} ms, busy "
                      f"{100 * p['busy_fraction_unprofiled']:.0f}%)")
    lines = [f"{label} [profile] {p['time_kind']} ms/step: {parts}; step wall {p['step_wall_ms']:.1f} ms, "
             f"busy {busy}{unprofiled}; host ms/step in ranges: {host_ranges}"]
    if p["time_kind"] == "CUDA":
        host = ", ".join(f"{k} {v:.1f}" for k, v in p["host_components_ms_per_step"].items())
        lines.append(f"{label} [profile] host ms/step: {host}; kernels/step {p['kernels_per_step']:.0f}, "
                     f"host syncs/step {p['host_syncs_per_step']:.0f}, host reads/step "
                     f"{p['host_reads_per_step']:.0f}")
    else:
        lines.append(f"{label} [profile] ops/step {p['ops_per_step']:.0f}, host reads/step "
                     f"(aten::_local_scalar_dense) {p['host_reads_per_step']:.0f}; no device, so no host syncs")
    return "\n".join(lines)
