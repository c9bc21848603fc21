"""DirectLaunches: the first launch of a variant goes through Triton, later ones call its compiled launcher with the
same arguments; anything else (a new variant, a launch hook, CPU tensors, the interpreter) goes through Triton.

Triton's launcher itself is exercised by every kernel test on a GPU; here a stand-in kernel records the calls.
"""
import pytest
import torch

from deform_plugin.ops import triton_support
from deform_plugin.ops.triton_support import DirectLaunches, pointer_alignment_bits

pytest.importorskip("triton")


class _Compiled:
    def __init__(self, log):
        self.function = "function handle"
        self.packed_metadata = "packed metadata"
        self.run = lambda *args: log.append(("direct",) + args)


class _Kernel:
    """Stands for a JITFunction: ``kernel[grid](*args, **options)`` launches through Triton and returns the
    compiled kernel."""

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def launch(*args, **options):
            self.log.append(("triton", grid, args, options))
            return _Compiled(self.log)
        return launch


@pytest.fixture
def on_cuda_without_interpreter(monkeypatch):
    monkeypatch.setattr(triton_support, "triton_interpreter_enabled", lambda: False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: f"stream of cuda:{index}",
                        raising=False)
    return torch.device("cuda", 0)


def test_the_second_launch_of_a_variant_calls_the_compiled_launcher(on_cuda_without_interpreter):
    kernel = _Kernel()
    launches = DirectLaunches(kernel)
    device = on_cuda_without_interpreter
    args = ("value", "out", 7, 32, "CONSTEXPR")
    launches.launch((4, 8, 2), "variant a", device, args, num_warps=4, num_stages=1)
    launches.launch((5, 8, 2), "variant a", device, args, num_warps=4, num_stages=1)
    assert kernel.log[0] == ("triton", (4, 8, 2), args, dict(num_warps=4, num_stages=1))
    # Triton's own run(): grid, stream, function, packed metadata, launch metadata and hooks (none), then every
    # argument in signature order.
    assert kernel.log[1] == ("direct", 5, 8, 2, "stream of cuda:0", "function handle", "packed metadata", None,
                             None, None) + args
    launches.launch((4, 8, 2), "variant b", device, args, num_warps=4, num_stages=1)
    assert kernel.log[2][0] == "triton" and len(kernel.log) == 3


def test_launch_hooks_send_every_launch_through_triton(on_cuda_without_interpreter, monkeypatch):
    from triton import knobs
    kernel = _Kernel()
    launches = DirectLaunches(kernel)
    launches.launch((1, 1, 1), "v", on_cuda_without_interpreter, ("x",), num_warps=1, num_stages=1)
    launches.launch((1, 1, 1), "v", on_cuda_without_interpreter, ("x",), num_warps=1, num_stages=1)
    chain = knobs.runtime.launch_exit_hook
    monkeypatch.setattr(chain, "calls", [lambda *args: None])  # a profiler's hook in Triton's chain
    launches.launch((1, 1, 1), "v", on_cuda_without_interpreter, ("x",), num_warps=1, num_stages=1)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *args: None)  # a plain callable
    launches.launch((1, 1, 1), "v", on_cuda_without_interpreter, ("x",), num_warps=1, num_stages=1)
    assert [entry[0] for entry in kernel.log] == ["triton", "direct", "triton", "triton"]


def test_cpu_tensors_and_the_interpreter_always_go_through_triton(monkeypatch):
    kernel = _Kernel()
    launches = DirectLaunches(kernel)
    for _ in range(2):
        launches.launch((1, 1, 1), "v", torch.device("cpu"), ("x",), num_warps=1, num_stages=1)
    monkeypatch.setattr(triton_support, "triton_interpreter_enabled", lambda: True)
    for _ in range(2):
        launches.launch((1, 1, 1), "v", torch.device("cuda", 0), ("x",), num_warps=1, num_stages=1)
    assert [entry[0] for entry in kernel.log] == ["triton"] * 4


def test_pointer_alignment_bits_tell_offset_views_apart():
    base = torch.zeros(64)
    assert pointer_alignment_bits(base, base[4:]) == 0b11
    assert pointer_alignment_bits(base, base[1:]) == 0b10
    assert pointer_alignment_bits(base[1:], base) == 0b01
