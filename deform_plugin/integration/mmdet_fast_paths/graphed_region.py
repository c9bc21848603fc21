"""A training region's forward and backward replayed from CUDA graphs, one pair per input signature.

A DETR training step in bf16 is host-bound: the GPU waits while Python, the dispatcher, autocast and autograd
launch thousands of small kernels. Replaying a captured graph launches the region's whole forward (or backward) in
one call. :class:`GraphedRegion` wraps a function ``fn(*inputs) -> (outputs, constants)`` — ``outputs`` a pytree of
tensors (or None) computed on the device, ``constants`` anything that is the same for every call of one signature
(for example level tables cached on the host's sizes) — and runs it:

- eagerly the first time a signature is seen: that call is the warm-up (Triton compiles, cuDNN/cuBLAS handles
  and plans);
- the second time, it captures the forward and the backward (``torch.autograd.grad`` of the differentiable outputs
  with respect to the trainable parameters) and replays them from then on.

A signature that differs from a warmed-up one only in its input shapes (a new image size in the same dtype and
mode) is captured at its first call instead: the kernels it runs are compiled already (ours do not recompile for new
sizes) and the libraries' handles exist, and what is new for the shape (cuDNN's plans) is chosen on the host during
the capture. That saves the eager warm-up step, the costliest iteration a new shape has. Where such a capture fails
(a library that must run or synchronise to choose, such as ``cudnn.benchmark``), the call runs eagerly as the
warm-up and the signature is captured at its next call, as a new kind is.

Inputs that require grad (for example query embeddings looked up outside the region) get their gradients from the
backward graph too; the others are data (images, sizes, masks).

Replays are exact: the same kernels run on the same values (dropout draws other random numbers than an eager run,
from the same distribution). The values the graphs read are the static input buffers (each call's inputs are copied
in), the parameters (updated in place by the optimizer) and the constants; anything else the function reads on the
host at capture time is frozen into the graph, so a region function must take every per-call value as an input
tensor. Static inputs, outputs and output gradients of every signature are views of shared buffers, and all
signatures capture on one stream into one memory pool: only one signature's graphs run at a time, so the memory of a
region is about that of its largest signature, not the sum. (The caching allocator hands a freed block only to
requests on the stream it was allocated on: a fresh capture stream per signature would strand every earlier
signature's activation memory in the pool.)

A signature falls back to eager (with one log line) when its capture after a warm-up fails (one that runs out of
memory is tried once more after the allocator's unused cached blocks are released), or beyond ``max_graphs``
signatures.
A call made while the previous replay still awaits its backward (a second forward before a backward) runs eagerly
too.
"""
from __future__ import annotations

import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.utils._pytree as pytree
from mmengine.logging import print_log


class _SharedBuffers:
    """Flat device buffers, one per role, that every signature's static tensors view; they grow, never shrink."""

    def __init__(self):
        self._buffers: Dict[Any, torch.Tensor] = {}

    def view_like(self, role, like: torch.Tensor) -> torch.Tensor:
        numel = like.numel()
        key = (role, like.dtype, like.device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            # Graphs captured before keep their views of the old buffer alive.
            buffer = torch.empty(max(numel, 1), dtype=like.dtype, device=like.device)
            self._buffers[key] = buffer
        return buffer[:numel].view(like.shape)


class _Captured:
    """One signature's graphs and the static tensors they read and write."""

    def __init__(self):
        self.forward_graph: Optional[torch.cuda.CUDAGraph] = None
        self.backward_graph: Optional[torch.cuda.CUDAGraph] = None
        self.static_inputs: List[torch.Tensor] = []
        self.input_needs_grad: List[bool] = []
        self.static_input_grads: List[Optional[torch.Tensor]] = []
        self.static_outputs: List[Optional[torch.Tensor]] = []
        self.output_spec = None
        self.differentiable: List[bool] = []
        self.static_output_grads: List[torch.Tensor] = []
        self.params: List[torch.nn.Parameter] = []
        self.param_has_grad: List[bool] = []
        self.params_have_slots = False
        self.constants: Any = None


class _CallWithParameters(torch.nn.Module):
    """``fn`` as the forward of a module that holds ``module``: ``torch.func.functional_call`` can then run ``fn``
    with ``module``'s parameters replaced."""

    def __init__(self, module: torch.nn.Module, fn: Callable):
        super().__init__()
        self.module = module
        self.fn = fn

    def forward(self, *inputs):
        return self.fn(*inputs)


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, region: "GraphedRegion", entry: _Captured, num_inputs: int, *inputs_and_params):
        for static, value in zip(entry.static_inputs, inputs_and_params[:num_inputs]):
            static.copy_(value)
        region.replay_forward(entry)
        ctx.region, ctx.entry = region, entry
        outputs = tuple(out.detach() for out in entry.static_outputs if out is not None)
        ctx.mark_non_differentiable(*[out for out, differentiable in zip(outputs, entry.differentiable)
                                      if not differentiable])
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *output_grads):
        entry = ctx.entry
        grads = [grad for grad, differentiable in zip(output_grads, entry.differentiable) if differentiable]
        for static, grad in zip(entry.static_output_grads, grads):
            if grad is None:
                static.zero_()
            else:
                static.copy_(grad)
        input_grads, param_grads = ctx.region.replay_backward(entry)
        return (None, None, None) + tuple(input_grads) + tuple(param_grads)


class GraphedRegion:
    """Run ``fn`` eagerly on a signature's first call, from captured CUDA graphs on later calls.

    Args:
        fn: ``fn(*inputs) -> (outputs, constants)``; ``inputs`` are tensors on one CUDA device (data such as
            images and sizes, or tensors that require grad), ``outputs`` a pytree of tensors and Nones.
        module: the module whose trainable parameters the backward graph differentiates.
        name: used in log lines.
        max_graphs: signatures captured at most; later new signatures run eagerly.
        capture_new_shapes_at_first_call: capture a signature that differs from a warmed-up one only in its input
            shapes at its first call, without an eager warm-up (False: every signature warms up eagerly first).
        parameter_filter: which of ``module``'s trainable parameters (by name) the backward graph differentiates;
            all by default. Two regions that split one network each take their own (see
            :mod:`.graphed_training`).
        reports_signatures: whether benchmarks count this region's captures, replays and eager calls as the step's
            (False for a region that always runs beside another one, so that a shape counts once); its capture
            time counts either way.
        gradient_slots: where given (an object whose ``slot(parameter)`` returns a tensor shaped like the parameter,
            or None), the backward graph writes each parameter's gradient into its slot, and a replay makes the
            slots the parameters' ``.grad`` instead of handing copies to autograd to accumulate (host work per
            parameter and step). Only where every parameter of the region has a slot and none holds a gradient
            yet (``zero_grad(set_to_none=True)``, as mmengine's optim wrappers call it); otherwise, as under
            gradient accumulation, the gradients go through autograd. Not under DistributedDataParallel, whose
            reducer waits for every parameter's accumulation (see :mod:`deform_plugin.engine.data_parallel`).
    """

    # Graphs are CUDA graphs; tests emulate them on the CPU with a subclass that sets this to "cpu".
    device_type = "cuda"

    def __init__(self, fn: Callable, module: torch.nn.Module, name: str, max_graphs: int = 64,
                 capture_new_shapes_at_first_call: bool = True,
                 parameter_filter: Optional[Callable[[str], bool]] = None, reports_signatures: bool = True,
                 gradient_slots=None):
        self.fn = fn
        self.gradient_slots = gradient_slots
        self.module = module
        self.parameter_filter = parameter_filter
        self.reports_signatures = reports_signatures
        self.name = name
        self.max_graphs = max_graphs
        self.capture_new_shapes_at_first_call = capture_new_shapes_at_first_call
        self.captured: Dict[tuple, _Captured] = {}
        self.calls_seen: Dict[tuple, int] = {}
        self.eager_reasons: Dict[tuple, str] = {}
        self.warmed_up_kinds: set = set()  # signatures without their shapes that have run eagerly once
        self.first_call_captures = 0  # signatures captured without a warm-up (benchmarks report them)
        self.first_call_capture_failures: Dict[tuple, str] = {}  # and those that needed one after all, with why
        self.shared = _SharedBuffers()
        self.param_grad_buffers: Dict[int, torch.Tensor] = {}
        self.slotted_params: set = set()  # ids of the parameters whose gradient buffer is their slot
        self.pool = None
        self.capture_stream: Optional[torch.cuda.Stream] = None
        self.replays = 0
        self.eager_calls = 0
        self.capture_seconds = 0.0  # host time spent capturing (benchmarks report it)
        # Where it went: running the forward and the backward under capture (the host's launches and the libraries'
        # per-shape planning) and instantiating the graphs.
        self.capture_phase_seconds = {"forward": 0.0, "backward": 0.0, "instantiate": 0.0}
        # The autograd node of the last replay until its backward runs (weakly: a graph dropped without a backward
        # frees the region).
        self.awaiting_backward: Optional[weakref.ref] = None

    # -- what a call runs -------------------------------------------------------------------------------------------
    def signature(self, inputs: Sequence[torch.Tensor]) -> tuple:
        """What a capture depends on besides the input values: shapes, dtypes, devices and which inputs require
        grad, the autocast state, the module's train/eval mode and which parameters are trainable (a graph
        differentiates a fixed set)."""
        autocast = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
        trainable = sum(p.requires_grad for p in self.module.parameters())
        return tuple((tuple(x.shape), x.dtype, x.device, x.requires_grad) for x in inputs) + (
            autocast, self.module.training, trainable)

    @staticmethod
    def kind(signature: tuple) -> tuple:
        """The signature without its input shapes: what a warm-up prepares besides per-shape plans."""
        num_inputs = len(signature) - 3
        return tuple(entry[1:] for entry in signature[:num_inputs]) + signature[num_inputs:]

    def __call__(self, *inputs: torch.Tensor) -> Tuple[Any, Any]:
        if not (torch.is_grad_enabled() and all(x.device.type == self.device_type for x in inputs)):
            return self._eager(inputs)
        key = self.signature(inputs)
        entry = self.captured.get(key)
        if entry is None:
            if key in self.eager_reasons:
                return self._eager(inputs)
            seen = self.calls_seen.get(key, 0) + 1
            self.calls_seen[key] = seen
            kind = self.kind(key)
            first_call_capture = (seen == 1 and self.capture_new_shapes_at_first_call
                                  and kind in self.warmed_up_kinds)
            if seen == 1 and not first_call_capture:  # the warm-up
                self.warmed_up_kinds.add(kind)
                return self._eager(inputs)
            if len(self.captured) >= self.max_graphs:
                self._fall_back(key, f"{self.max_graphs} signatures are captured already (max_graphs)")
                return self._eager(inputs)
            entry = self._capture_or_fall_back(key, inputs, warmed_up=not first_call_capture)
            if entry is None:
                return self._eager(inputs)
        if self.awaiting_backward is not None and self.awaiting_backward() is not None:
            # The last replay's autograd graph lives and its backward has not run: a replay of any signature would
            # overwrite the activations (shared pool) and outputs (shared buffers) that backward reads.
            return self._eager(inputs)
        params = entry.params
        outputs = _Replay.apply(self, entry, len(inputs), *inputs, *params)
        self.replays += 1
        differentiable = [out for out in outputs if out.grad_fn is not None]
        self.awaiting_backward = weakref.ref(differentiable[0].grad_fn) if differentiable else None
        leaves, it = [], iter(outputs)
        for static in entry.static_outputs:
            leaves.append(None if static is None else next(it))
        return pytree.tree_unflatten(leaves, entry.output_spec), entry.constants

    def _eager(self, inputs):
        self.eager_calls += 1
        return self.fn(*inputs)

    def _fall_back(self, key, reason: str) -> None:
        self.eager_reasons[key] = reason
        print_log(f"deform_plugin: {self.name} of inputs {[list(k[0]) for k in key[:-3]]} runs eagerly: {reason}",
                  logger="current")

    # -- replay -----------------------------------------------------------------------------------------------------
    def replay_forward(self, entry: _Captured) -> None:
        entry.forward_graph.replay()

    def replay_backward(self, entry: _Captured) -> Tuple[List[Optional[torch.Tensor]], List[Optional[torch.Tensor]]]:
        """The gradients of the inputs and of the parameters (None where there is none, or where the parameter's
        ``.grad`` became its gradient slot)."""
        into_slots = self._gradients_into_slots(entry)
        entry.backward_graph.replay()
        self.awaiting_backward = None
        param_grads = [self.param_grad_buffers[id(p)] if has else None
                       for p, has in zip(entry.params, entry.param_has_grad)]
        if into_slots:
            for parameter, grad in zip(entry.params, param_grads):
                if grad is not None:
                    parameter.grad = grad
            param_grads = [None] * len(entry.params)
        grads = entry.static_input_grads + param_grads
        used = [grad for grad in grads if grad is not None]
        # Copies: autograd may keep a returned gradient as the parameter's .grad, and the next replay overwrites
        # these buffers.
        copies = iter(torch._foreach_mul(used, 1.0)) if used else iter(())
        grads = [None if grad is None else next(copies) for grad in grads]
        return grads[:len(entry.static_input_grads)], grads[len(entry.static_input_grads):]

    def _gradients_into_slots(self, entry: _Captured) -> bool:
        """Whether this replay hands the parameters their slots as ``.grad``. A parameter whose ``.grad`` is its
        slot still (not reset since the last replay) gets a copy first: the replay overwrites the slot, and
        autograd then adds the new gradient to what the parameter held."""
        if not entry.params_have_slots:
            return False
        into_slots = True
        for parameter in entry.params:
            grad = parameter.grad
            if grad is None:
                continue
            into_slots = False
            if grad.data_ptr() == self.param_grad_buffers[id(parameter)].data_ptr():
                parameter.grad = grad.clone()
        return into_slots

    # -- capture ----------------------------------------------------------------------------------------------------
    def _capture_or_fall_back(self, key, inputs, warmed_up: bool = True) -> Optional[_Captured]:
        """Capture ``key``'s signature; None where that fails. A signature that has warmed up then runs eagerly for
        good (one log line); one captured at its first call (``warmed_up=False``) runs this call eagerly as its
        warm-up and captures at the next."""
        started = time.perf_counter()
        try:
            try:
                entry = self.capture(inputs)
            except torch.OutOfMemoryError:
                if not warmed_up:
                    raise
                # The eager steps' allocator may cache most of the card in blocks the graph pool cannot use: give
                # them back to the driver and try once more before this signature runs eagerly for good.
                self.release_cached_memory(inputs[0].device)
                entry = self.capture(inputs)
        except (RuntimeError, ValueError) as error:  # torch.AcceleratorError is one; ValueError: level_tables'
            self.capture_seconds += time.perf_counter() - started
            reason = str(error).splitlines()[0]
            self._check_device_usable(inputs[0].device, reason, error)
            if warmed_up:
                self._fall_back(key, f"its capture failed ({reason})")
            else:
                self.first_call_capture_failures[key] = reason
            return None
        seconds = time.perf_counter() - started
        self.capture_seconds += seconds
        self.captured[key] = entry
        if not warmed_up:
            self.first_call_captures += 1
        phases = self.capture_phase_seconds
        print_log(f"deform_plugin: {self.name} captured inputs {[list(k[0]) for k in key[:-3]]} in {seconds:.3f} s "
                  f"(all captures so far: forward {phases['forward']:.2f} s, backward {phases['backward']:.2f} s, "
                  f"of which {phases['instantiate']:.2f} s instantiating graphs)", logger="current")
        return entry

    def _check_device_usable(self, device: torch.device, reason: str, error: BaseException) -> None:
        """Raise a clear error where a failed capture left CUDA unusable (the step cannot go on)."""
        if device.type != "cuda":
            return
        try:
            torch.cuda.synchronize(device)
            torch.empty(1, device=device).uniform_()
        except RuntimeError as broken:
            raise RuntimeError(f"deform_plugin: the CUDA graph capture of {self.name} failed ({reason}) and left "
                               f"CUDA unusable ({str(broken).splitlines()[0]}); turn the cuda_graphs fast path off "
                               "for this model") from error

    def release_cached_memory(self, device: torch.device) -> None:
        """Return the caching allocator's unused blocks to the driver (after a capture ran out of memory)."""
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()

    def capture(self, inputs: Sequence[torch.Tensor]) -> _Captured:
        """Capture the forward and backward graphs of ``inputs``' signature (which has been run eagerly before)."""
        device = inputs[0].device
        entry = _Captured()
        entry.static_inputs = [self.shared.view_like(("input", i), x) for i, x in enumerate(inputs)]
        entry.input_needs_grad = [x.requires_grad for x in inputs]
        with torch.no_grad():
            for static, value in zip(entry.static_inputs, inputs):
                static.copy_(value)
        # What the captured forward reads: the static buffers, as fresh leaves where the input requires grad.
        region_inputs = tuple(static.detach().requires_grad_() if needs else static
                              for static, needs in zip(entry.static_inputs, entry.input_needs_grad))
        input_indices = [i for i, needs in enumerate(entry.input_needs_grad) if needs]
        input_leaves = [region_inputs[i] for i in input_indices]
        named = [(name, p) for name, p in self.module.named_parameters()
                 if p.requires_grad and (self.parameter_filter is None or self.parameter_filter(name))]
        entry.params = [p for _, p in named]
        for p in entry.params:
            if id(p) not in self.param_grad_buffers:
                slot = None if self.gradient_slots is None else self.gradient_slots.slot(p)
                self.param_grad_buffers[id(p)] = (torch.zeros_like(p, memory_format=torch.preserve_format)
                                                  if slot is None else slot)
                if slot is not None:
                    self.slotted_params.add(id(p))
        entry.params_have_slots = all(id(p) in self.slotted_params for p in entry.params)
        # The capture differentiates fresh leaves that share the parameters' storage (so replays read the current
        # weights): the parameters' own autograd accumulators belong to the eager stream, and the backward engine
        # would synchronise the capturing stream with it, which a capture cannot do.
        aliases = {name: p.detach().requires_grad_() for name, p in named}
        holder = _CallWithParameters(self.module, self.fn)
        if self.pool is None and device.type == "cuda":
            self.pool = torch.cuda.graph_pool_handle()
        autocast_on, autocast_dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
        captured = {}

        def run_forward():
            outputs, constants = torch.func.functional_call(
                holder, {f"module.{name}": alias for name, alias in aliases.items()}, region_inputs)
            leaves, spec = pytree.tree_flatten(outputs)
            if entry.output_spec is None:
                entry.output_spec, entry.constants = spec, constants
                for i, leaf in enumerate(leaves):
                    if leaf is not None and not isinstance(leaf, torch.Tensor):
                        raise RuntimeError(f"{self.name} returned a {type(leaf).__name__}, not a tensor")
                    entry.static_outputs.append(None if leaf is None else self.shared.view_like(("output", i), leaf))
            for static, leaf in zip(entry.static_outputs, leaves):
                if static is not None:
                    static.copy_(leaf)
            captured["differentiable"] = [leaf for leaf in leaves if leaf is not None and leaf.requires_grad]
            if not entry.differentiable:
                entry.differentiable = [leaf.requires_grad for leaf in leaves if leaf is not None]

        def run_backward():
            differentiable = captured.pop("differentiable")
            if not entry.static_output_grads:
                entry.static_output_grads = [self.shared.view_like(("output_grad", i), leaf)
                                             for i, leaf in enumerate(differentiable)]
            grads = torch.autograd.grad(differentiable, input_leaves + list(aliases.values()),
                                        grad_outputs=entry.static_output_grads, allow_unused=True)
            input_grads, grads = grads[:len(input_leaves)], grads[len(input_leaves):]
            if not entry.static_input_grads:
                entry.static_input_grads = [None] * len(inputs)
                for i, grad in zip(input_indices, input_grads):
                    if grad is not None:
                        entry.static_input_grads[i] = self.shared.view_like(("input_grad", i), grad)
            entry.param_has_grad = [grad is not None for grad in grads]
            pairs = [(self.param_grad_buffers[id(p)], grad) for p, grad in zip(entry.params, grads)
                     if grad is not None]
            pairs += [(entry.static_input_grads[i], grad) for i, grad in zip(input_indices, input_grads)
                      if grad is not None]
            if pairs:
                torch._foreach_copy_([buffer for buffer, _ in pairs], [grad for _, grad in pairs])

        if device.type != "cuda":  # graphs emulated by a subclass (tests)
            entry.forward_graph = self.capture_graph(run_forward)
            entry.backward_graph = self.capture_graph(run_backward)
            return entry
        if self.capture_stream is None:
            self.capture_stream = torch.cuda.Stream(device=device)
        side = self.capture_stream
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), \
                torch.autocast("cuda", dtype=autocast_dtype, enabled=autocast_on, cache_enabled=False):
            # Autocast's weight cache is off: a cached cast would be captured once and never recomputed after the
            # optimizer changes the weight.
            started = time.perf_counter()
            entry.forward_graph = self.capture_graph(run_forward)
            forward_done = time.perf_counter()
            entry.backward_graph = self.capture_graph(run_backward)
            self.capture_phase_seconds["forward"] += forward_done - started
            self.capture_phase_seconds["backward"] += time.perf_counter() - forward_done
        torch.cuda.current_stream(device).wait_stream(side)
        return entry

    def capture_graph(self, work: Callable[[], None]):
        """A graph that replays the kernels ``work()`` launches (``work`` runs once, now)."""
        graph = torch.cuda.CUDAGraph()
        # 'thread_local': the data loader's pinning thread may call CUDA while this thread captures.
        graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
        try:
            work()
        finally:
            ended = time.perf_counter()
            graph.capture_end()  # instantiates the graph
            self.capture_phase_seconds["instantiate"] += time.perf_counter() - ended
        return graph
