"""One cache of CUDA graphs, keyed by call signature: what training regions and graph inference share.

A user of the cache (:class:`deform_plugin.integration.mmdet_fast_paths.graphed_region.GraphedRegion` for a
training forward and backward, :class:`deform_plugin.integration.mmdet_graph_inference.GraphInference` for a
detector's forward) asks it, for each call whose signature has no graph, whether to capture now
(:meth:`GraphCache.earns_capture`, under a :class:`~.policy.CapturePolicy`), and builds its graphs through
:meth:`GraphCache.capture`, which gives them:

- one side stream for every capture: the caching allocator hands a freed block only to requests on the stream it was
  allocated on, so a stream per signature would strand each one's memory;
- one memory pool for every graph: only one graph runs at a time, so the graphs' activations share it;
- one retry after the allocator's unused cached blocks are released, where a capture runs out of memory;
- an eager fallback with one log line where a capture fails, and a clear error where the failure left CUDA unusable;
- the bookkeeping benchmarks report: captures, replays, eager calls, host time spent capturing, and the device
  memory the captures added to the pool.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Dict, Hashable, Optional, Set

import torch
from mmengine.logging import print_log

from .policy import CapturePolicy

MIB = 1 << 20


class GraphCache:
    """Per-signature CUDA graphs under one :class:`~.policy.CapturePolicy`.

    Args:
        name: used in log lines.
        policy: when a signature earns its capture and how many graphs are kept.
    """

    def __init__(self, name: str, policy: Optional[CapturePolicy] = None):
        self.name = name
        self.policy = policy or CapturePolicy()
        self.entries: Dict[Hashable, Any] = {}
        self.calls: Dict[Hashable, int] = {}  # calls of each signature that had no graph
        self.eager_reasons: Dict[Hashable, str] = {}  # signatures that run eagerly for good, with why
        self.ran_eagerly: Set[Hashable] = set()  # signatures warmed up by an eager call of their own
        self.warmed_up_kinds: Set[Hashable] = set()
        self.unwarmed_capture_failures: Dict[Hashable, str] = {}
        self.first_call_captures = 0  # captures without an eager call of the signature before
        self.replays = 0
        self.eager_calls = 0
        self.capture_seconds = 0.0
        self.instantiate_seconds = 0.0  # of capture_seconds, instantiating graphs
        self.graph_memory_bytes = 0  # device memory the captures added to the pool
        self.capped: Optional[str] = None  # why new signatures run eagerly, once a cap is reached
        self.pool = None
        self.stream: Optional[torch.cuda.Stream] = None

    # -- the policy -------------------------------------------------------------------------------------------------
    def earns_capture(self, key: Hashable, kind: Hashable = None, capture_after: Optional[int] = None) -> bool:
        """Count a call of ``key`` that has no graph; whether it is captured now (else it runs eagerly).

        The first call of each ``kind`` runs eagerly whatever the policy: it compiles kernels and creates the
        libraries' handles, which a capture cannot do. ``capture_after`` overrides the policy's for this call."""
        if key in self.entries:
            raise RuntimeError(f"{self.name}: signature {key!r} has a graph already")
        seen = self.calls[key] = self.calls.get(key, 0) + 1
        if key in self.eager_reasons:
            return False
        if kind not in self.warmed_up_kinds:
            self.warmed_up_kinds.add(kind)
            return False
        if seen < (self.policy.capture_after if capture_after is None else capture_after):
            return False
        reason = self.cap_reached()
        if reason is not None:
            # Never a graph dropped for another: a working set over the cap would recapture in a loop.
            self.eager_reasons[key] = reason
            if self.capped is None:
                self.capped = reason
                print_log(f"deform_plugin: {self.name}: {reason}; new input signatures run eagerly from now on",
                          logger="current")
            return False
        return True

    def cap_reached(self) -> Optional[str]:
        policy = self.policy
        if len(self.entries) >= policy.max_graphs:
            return f"{policy.max_graphs} signatures are captured (max_graphs)"
        if policy.max_graph_memory_mb is not None and self.graph_memory_bytes >= policy.max_graph_memory_mb * MIB:
            return (f"the graphs hold {self.graph_memory_bytes / MIB:.0f} MiB (max_graph_memory_mb="
                    f"{policy.max_graph_memory_mb:g})")
        return None

    def note_eager_call(self, key: Hashable = None) -> None:
        self.eager_calls += 1
        if key is not None:
            self.ran_eagerly.add(key)

    def fall_back(self, key: Hashable, reason: str, described_as: str = "") -> None:
        """``key`` runs eagerly for good, with one log line saying why."""
        self.eager_reasons[key] = reason
        print_log(f"deform_plugin: {self.name}{described_as} runs eagerly: {reason}", logger="current")

    # -- capture ----------------------------------------------------------------------------------------------------
    def capture(self, key: Hashable, build: Callable[[], Any], device: torch.device, described_as: str = "",
                release_cached_memory: Optional[Callable[[torch.device], None]] = None):
        """``build()`` captures ``key``'s graphs (through :meth:`capture_graph`, on :meth:`capture_stream`) and
        returns its entry, which the cache keeps; None where the capture fails.

        A signature that has run eagerly before falls back to eager for good when its capture fails (a capture that
        runs out of memory is tried once more after releasing the allocator's unused cached blocks). One that has
        not is captured again after its next eager call, which warms up what the capture could not choose (a
        library that must run or synchronise to pick a plan). ``release_cached_memory`` replaces
        :meth:`release_cached_memory` before the retry."""
        warmed_up = key in self.ran_eagerly
        started = time.perf_counter()
        reserved = self._reserved(device)
        try:
            try:
                entry = build()
            except torch.OutOfMemoryError:
                if not warmed_up:
                    raise
                (release_cached_memory or self.release_cached_memory)(device)
                reserved = self._reserved(device)
                entry = build()
        except (RuntimeError, ValueError) as error:  # torch.AcceleratorError is one; ValueError: level tables'
            self.capture_seconds += time.perf_counter() - started
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            self._check_device_usable(device, reason, error)
            if warmed_up:
                self.fall_back(key, f"its capture failed ({reason})", described_as)
            else:
                self.unwarmed_capture_failures[key] = reason
                self.calls[key] = 0  # captured again after an eager call of its own
            return None
        seconds = time.perf_counter() - started
        self.capture_seconds += seconds
        self.graph_memory_bytes += max(0, self._reserved(device) - reserved)
        self.entries[key] = entry
        if not warmed_up:
            self.first_call_captures += 1
        print_log(f"deform_plugin: {self.name}{described_as} captured in {seconds:.3f} s ({len(self.entries)} "
                  f"graphs, {self.capture_seconds:.2f} s capturing, {self.graph_memory_bytes / MIB:.0f} MiB added)",
                  logger="current")
        return entry

    @contextlib.contextmanager
    def capture_stream(self, device: torch.device):
        """Run the block on the captures' side stream, ordered after the current stream's work and before its next."""
        if torch.device(device).type != "cuda":
            yield None
            return
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=device)
        self.stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self.stream):
            yield self.stream
        torch.cuda.current_stream(device).wait_stream(self.stream)

    def capture_graph(self, work: Callable[[], Any]):
        """A graph that replays the kernels ``work()`` launches (``work`` runs once, now, on the current stream),
        in the cache's pool; returns ``(graph, what work returned)``."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # 'thread_local': the data loader's pinning thread may call CUDA while this thread captures.
        graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
        try:
            result = work()
        finally:
            ended = time.perf_counter()
            graph.capture_end()  # instantiates the graph
            self.instantiate_seconds += time.perf_counter() - ended
        return graph, result

    # -- memory and failures ----------------------------------------------------------------------------------------
    @staticmethod
    def _reserved(device: torch.device) -> int:
        device = torch.device(device)
        return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0

    @staticmethod
    def release_cached_memory(device: torch.device) -> None:
        """Return the caching allocator's unused blocks to the driver (after a capture ran out of memory): the eager
        calls may hold most of the card in blocks that the graphs' pool cannot use."""
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()

    def _check_device_usable(self, device: torch.device, reason: str, error: BaseException) -> None:
        """Raise a clear error where a failed capture left CUDA unusable (nothing can go on)."""
        if torch.device(device).type != "cuda":
            return
        try:
            torch.cuda.synchronize(device)
            torch.empty(1, device=device).uniform_()
        except RuntimeError as broken:
            raise RuntimeError(f"deform_plugin: the CUDA graph capture of {self.name} failed ({reason}) and left "
                               f"CUDA unusable ({str(broken).splitlines()[0]}); run this model without CUDA "
                               "graphs") from error

    def stats(self) -> Dict[str, Any]:
        """What benchmarks report: graphs, replays, eager calls, capture time and the memory the graphs added."""
        return dict(graphs=len(self.entries), replays=self.replays, eager_calls=self.eager_calls,
                    capture_seconds=self.capture_seconds, first_call_captures=self.first_call_captures,
                    graph_memory_mb=self.graph_memory_bytes / MIB, fallbacks=len(self.eager_reasons),
                    capped=self.capped)


class SharedBuffers:
    """Flat device buffers, one per role, that every signature's static tensors view: the static inputs and outputs
    of all signatures take the memory of the largest. They grow, never shrink."""

    def __init__(self):
        self._buffers: Dict[Any, torch.Tensor] = {}

    def view_like(self, role: Hashable, like: torch.Tensor) -> torch.Tensor:
        numel = like.numel()
        key = (role, like.dtype, like.device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            # Graphs captured before keep their views of the old buffer alive.
            buffer = torch.empty(max(numel, 1), dtype=like.dtype, device=like.device)
            self._buffers[key] = buffer
        return buffer[:numel].view(like.shape)
