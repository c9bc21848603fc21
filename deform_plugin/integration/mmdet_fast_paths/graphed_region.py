"""A training region's forward and backward replayed from CUDA graphs, one pair per input signature.

A DETR training step in bf16 is host-bound: the GPU waits while Python, the dispatcher, autocast and autograd
launch thousands of small kernels. Replaying a captured graph launches the region's whole forward (or backward) in
one call. :class:`GraphedRegion` wraps a function ``fn(*inputs) -> (outputs, constants)`` — ``outputs`` a pytree of
tensors (or None) computed on the device, ``constants`` anything that is the same for every call of one signature
(for example level tables cached on the host's sizes) — and runs each signature eagerly until it earns its graphs
under the region's :class:`~deform_plugin.cuda_graphs.CapturePolicy`, then captures the forward and the backward
(``torch.autograd.grad`` of the differentiable outputs with respect to the trainable parameters) and replays them:

- ``capture_after=2`` (the default): a shape is captured at its second call, so a run whose batches rarely repeat a
  shape (a random-resize pipeline without ``ShapeBucketsHook``) runs them eagerly instead of paying a capture each;
- ``capture_after=1``: the first call of each kind (dtypes, modes) is the eager warm-up (Triton compiles, cuDNN and
  cuBLAS create their handles); a new shape of a warmed-up kind is captured at its first call, saving its eager
  step: right where shapes recur by construction (batches padded by ``ShapeBucketsHook``). Where such a capture
  fails (a library that must run or synchronise to choose, such as ``cudnn.benchmark``), the call runs eagerly as
  the shape's warm-up and the shape is captured at its next call.

The graphs, their pool, stream, fallback and bookkeeping are a :class:`~deform_plugin.cuda_graphs.GraphCache`'s.

Inputs that require grad (for example query embeddings looked up outside the region) get their gradients from the
backward graph too; the others are data (images, sizes, masks).

Replays are exact: the same kernels run on the same values (dropout draws other random numbers than an eager run,
from the same distribution). The values the graphs read are the static input buffers (each call's inputs are copied
in), the parameters (updated in place by the optimizer) and the constants; anything else the function reads on the
host at capture time is frozen into the graph, so a region function must take every per-call value as an input
tensor. Static inputs, outputs and output gradients of every signature are views of shared buffers, and all
signatures capture on the cache's one stream into its one memory pool: only one signature's graphs run at a time,
so the memory of a region is about that of its largest signature, not the sum.

A call made while the previous replay still awaits its backward (a second forward before a backward) runs eagerly.
"""
from __future__ import annotations

import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.utils._pytree as pytree

from deform_plugin.cuda_graphs import CapturePolicy, GraphCache, SharedBuffers


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


def _parameter_slots(module: torch.nn.Module, aliases: Dict[int, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """For ``torch.func.functional_call``: every place in ``module`` that holds a parameter of ``aliases`` (keyed by
    the parameter's id), each named once, with its alias.

    A module registered under several names (Deformable-DETR's class and box branches shared by every decoder layer)
    is one place, named once: functional_call's own handling of tied weights sets and restores such a module's
    attribute once per name, and leaves the alias in it. Distinct modules sharing one parameter are one place each.
    """
    slots = {}
    for module_name, submodule in module.named_modules():  # every distinct module once
        for name, parameter in submodule.named_parameters(recurse=False):
            if id(parameter) in aliases:
                slots[f"{module_name}.{name}" if module_name else name] = aliases[id(parameter)]
    return slots


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
    """Run ``fn`` eagerly until a signature earns its graphs under ``policy``, from captured CUDA graphs after.

    Args:
        fn: ``fn(*inputs) -> (outputs, constants)``; ``inputs`` are tensors on one CUDA device (data such as
            images and sizes, or tensors that require grad), ``outputs`` a pytree of tensors and Nones.
        module: the module whose trainable parameters the backward graph differentiates.
        name: used in log lines.
        policy: when a signature is captured and how many are kept (:class:`~deform_plugin.cuda_graphs.CapturePolicy`;
            its default captures a shape at its second call).
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

    def __init__(self, fn: Callable, module: torch.nn.Module, name: str, policy: Optional[CapturePolicy] = None,
                 parameter_filter: Optional[Callable[[str], bool]] = None, reports_signatures: bool = True,
                 gradient_slots=None):
        self.fn = fn
        self.module = module
        self.name = name
        self.graphs = GraphCache(name, policy)
        self.parameter_filter = parameter_filter
        self.reports_signatures = reports_signatures
        self.gradient_slots = gradient_slots
        self.shared = SharedBuffers()
        self.param_grad_buffers: Dict[int, torch.Tensor] = {}
        self.slotted_params: set = set()  # ids of the parameters whose gradient buffer is their slot
        # Host time running the forward and the backward under capture (the host's launches and the libraries'
        # per-shape planning), instantiation included.
        self.capture_run_seconds = {"forward": 0.0, "backward": 0.0}
        # The autograd node of the last replay until its backward runs (weakly: a graph dropped without a backward
        # frees the region).
        self.awaiting_backward: Optional[weakref.ref] = None

    # What benchmarks and tests read, kept by the cache.
    policy = property(lambda self: self.graphs.policy)
    captured = property(lambda self: self.graphs.entries)
    eager_reasons = property(lambda self: self.graphs.eager_reasons)
    calls_seen = property(lambda self: self.graphs.calls)
    first_call_captures = property(lambda self: self.graphs.first_call_captures)
    first_call_capture_failures = property(lambda self: self.graphs.unwarmed_capture_failures)
    replays = property(lambda self: self.graphs.replays)
    eager_calls = property(lambda self: self.graphs.eager_calls)
    capture_seconds = property(lambda self: self.graphs.capture_seconds)

    @property
    def capture_phase_seconds(self) -> Dict[str, float]:
        """Where the capture time went: running the forward and the backward under capture, and of those,
        instantiating the graphs."""
        return dict(self.capture_run_seconds, instantiate=self.graphs.instantiate_seconds)

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

    @staticmethod
    def _described(key: tuple) -> str:
        return f" inputs {[list(entry[0]) for entry in key[:-3]]}"

    def __call__(self, *inputs: torch.Tensor) -> Tuple[Any, Any]:
        if not (torch.is_grad_enabled() and all(x.device.type == self.device_type for x in inputs)):
            return self._eager(inputs)
        key = self.signature(inputs)
        entry = self.graphs.entries.get(key)
        if entry is None:
            if not self.graphs.earns_capture(key, self.kind(key)):
                return self._eager(inputs, key)
            entry = self.graphs.capture(key, lambda: self.capture(inputs), inputs[0].device, self._described(key),
                                        release_cached_memory=self.release_cached_memory)
            if entry is None:
                return self._eager(inputs, key)
        if self.awaiting_backward is not None and self.awaiting_backward() is not None:
            # The last replay's autograd graph lives and its backward has not run: a replay of any signature would
            # overwrite the activations (shared pool) and outputs (shared buffers) that backward reads.
            return self._eager(inputs, key)
        outputs = _Replay.apply(self, entry, len(inputs), *inputs, *entry.params)
        self.graphs.replays += 1
        differentiable = [out for out in outputs if out.grad_fn is not None]
        self.awaiting_backward = weakref.ref(differentiable[0].grad_fn) if differentiable else None
        leaves, it = [], iter(outputs)
        for static in entry.static_outputs:
            leaves.append(None if static is None else next(it))
        return pytree.tree_unflatten(leaves, entry.output_spec), entry.constants

    def _eager(self, inputs, key=None):
        self.graphs.note_eager_call(key)
        return self.fn(*inputs)

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
    def release_cached_memory(self, device: torch.device) -> None:
        """Return the caching allocator's unused blocks to the driver (after a capture ran out of memory)."""
        self.graphs.release_cached_memory(device)

    def capture(self, inputs: Sequence[torch.Tensor]) -> _Captured:
        """Capture the forward and backward graphs of ``inputs``' signature."""
        entry = _Captured()
        region_inputs, input_indices = self._static_inputs(entry, inputs)
        named = [(name, p) for name, p in self.module.named_parameters()
                 if p.requires_grad and (self.parameter_filter is None or self.parameter_filter(name))]
        entry.params = [p for _, p in named]
        self._gradient_buffers(entry)
        # The capture differentiates fresh leaves that share the parameters' storage (so replays read the current
        # weights): the parameters' own autograd accumulators belong to the eager stream, and the backward engine
        # would synchronise the capturing stream with it, which a capture cannot do.
        aliases = {id(p): p.detach().requires_grad_() for _, p in named}
        holder = _CallWithParameters(self.module, self.fn)
        replaced = _parameter_slots(holder, aliases)
        captured = {}

        def run_forward():
            outputs, constants = torch.func.functional_call(holder, replaced, region_inputs, tie_weights=False)
            captured["differentiable"] = self._keep_outputs(entry, outputs, constants)

        def run_backward():
            self._differentiate(entry, captured.pop("differentiable"), input_indices,
                                [region_inputs[i] for i in input_indices], list(aliases.values()))

        device = inputs[0].device
        if device.type != "cuda":  # graphs emulated by a subclass (tests)
            entry.forward_graph = self.capture_graph(run_forward)
            entry.backward_graph = self.capture_graph(run_backward)
            return entry
        autocast_on, autocast_dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
        with self.graphs.capture_stream(device), \
                torch.autocast("cuda", dtype=autocast_dtype, enabled=autocast_on, cache_enabled=False):
            # Autocast's weight cache is off: a cached cast would be captured once and never recomputed after the
            # optimizer changes the weight.
            started = time.perf_counter()
            entry.forward_graph = self.capture_graph(run_forward)
            forward_done = time.perf_counter()
            entry.backward_graph = self.capture_graph(run_backward)
            self.capture_run_seconds["forward"] += forward_done - started
            self.capture_run_seconds["backward"] += time.perf_counter() - forward_done
        return entry

    def _static_inputs(self, entry: _Captured, inputs: Sequence[torch.Tensor]):
        """The static input buffers, filled with ``inputs``; what the captured forward reads (fresh leaves where an
        input requires grad) and the indices of those inputs."""
        entry.static_inputs = [self.shared.view_like(("input", i), x) for i, x in enumerate(inputs)]
        entry.input_needs_grad = [x.requires_grad for x in inputs]
        with torch.no_grad():
            for static, value in zip(entry.static_inputs, inputs):
                static.copy_(value)
        region_inputs = tuple(static.detach().requires_grad_() if needs else static
                              for static, needs in zip(entry.static_inputs, entry.input_needs_grad))
        return region_inputs, [i for i, needs in enumerate(entry.input_needs_grad) if needs]

    def _gradient_buffers(self, entry: _Captured) -> None:
        """Each parameter's gradient buffer (its slot where it has one), made once for every signature."""
        for p in entry.params:
            if id(p) not in self.param_grad_buffers:
                slot = None if self.gradient_slots is None else self.gradient_slots.slot(p)
                self.param_grad_buffers[id(p)] = (torch.zeros_like(p, memory_format=torch.preserve_format)
                                                  if slot is None else slot)
                if slot is not None:
                    self.slotted_params.add(id(p))
        entry.params_have_slots = all(id(p) in self.slotted_params for p in entry.params)

    def _keep_outputs(self, entry: _Captured, outputs, constants) -> List[torch.Tensor]:
        """Copy the forward's outputs into the static outputs (made at the first capture); the differentiable
        ones."""
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
        if not entry.differentiable:
            entry.differentiable = [leaf.requires_grad for leaf in leaves if leaf is not None]
        return [leaf for leaf in leaves if leaf is not None and leaf.requires_grad]

    def _differentiate(self, entry: _Captured, differentiable, input_indices, input_leaves, parameter_leaves):
        """The backward: gradients of ``differentiable`` (given the static output gradients) into the parameters'
        gradient buffers and the static input gradients."""
        if not entry.static_output_grads:
            entry.static_output_grads = [self.shared.view_like(("output_grad", i), leaf)
                                         for i, leaf in enumerate(differentiable)]
        grads = torch.autograd.grad(differentiable, input_leaves + parameter_leaves,
                                    grad_outputs=entry.static_output_grads, allow_unused=True)
        input_grads, grads = grads[:len(input_leaves)], grads[len(input_leaves):]
        if not entry.static_input_grads:
            entry.static_input_grads = [None] * len(entry.static_inputs)
            for i, grad in zip(input_indices, input_grads):
                if grad is not None:
                    entry.static_input_grads[i] = self.shared.view_like(("input_grad", i), grad)
        entry.param_has_grad = [grad is not None for grad in grads]
        pairs = [(self.param_grad_buffers[id(p)], grad) for p, grad in zip(entry.params, grads) if grad is not None]
        pairs += [(entry.static_input_grads[i], grad) for i, grad in zip(input_indices, input_grads)
                  if grad is not None]
        if pairs:
            torch._foreach_copy_([buffer for buffer, _ in pairs], [grad for _, grad in pairs])

    def capture_graph(self, work: Callable[[], None]):
        """A graph that replays the kernels ``work()`` launches (``work`` runs once, now)."""
        return self.graphs.capture_graph(work)[0]
