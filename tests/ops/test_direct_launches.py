"""DirectLaunches: the first launch of a variant goes through Triton, later ones call its compiled launcher with the
same arguments (the tensors as their data pointers); anything else (a new variant, a launch hook, CPU tensors, the
interpreter) goes through Triton.

Triton's launcher itself is exercised by every kernel test on a GPU; here a stand-in kernel records the calls.
"""
import pytest
import torch

from deform_plugin.ops import triton_support
from deform_plugin.ops.triton_support import DirectLaunches, alignment_bits, data_pointers

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
    tensors, pointers, scalars = ("value", "out"), (4096, 8192), (7, 32, "CONSTEXPR")
    launches.launch((4, 8, 2), "variant a", device, tensors, pointers, scalars, num_warps=4, num_stages=1)
    launches.launch((5, 8, 2), "variant a", device, tensors, pointers, scalars, num_warps=4, num_stages=1)
    assert kernel.log[0] == ("triton", (4, 8, 2), tensors + scalars, dict(num_warps=4, num_stages=1))
    # Triton's own run(): grid, stream, function, packed metadata, launch metadata and hooks (none), then every
    # argument in signature order, the tensors as their data pointers.
    assert kernel.log[1] == ("direct", 5, 8, 2, "stream of cuda:0", "function handle", "packed metadata", None,
                             None, None) + pointers + scalars
    launches.launch((4, 8, 2), "variant b", device, tensors, pointers, scalars, num_warps=4, num_stages=1)
    assert kernel.log[2][0] == "triton" and len(kernel.log) == 3


def _launch_one(launches, device):
    launches.launch((1, 1, 1), "v", device, ("x",), (16,), (), num_warps=1, num_stages=1)


def test_launch_hooks_send_every_launch_through_triton(on_cuda_without_interpreter, monkeypatch):
    from triton import knobs
    kernel = _Kernel()
    launches = DirectLaunches(kernel)
    _launch_one(launches, on_cuda_without_interpreter)
    _launch_one(launches, on_cuda_without_interpreter)
    chain = knobs.runtime.launch_exit_hook
    monkeypatch.setattr(chain, "calls", [lambda *args: None])  # a profiler's hook in Triton's chain
    _launch_one(launches, on_cuda_without_interpreter)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *args: None)  # a plain callable
    _launch_one(launches, on_cuda_without_interpreter)
    assert [entry[0] for entry in kernel.log] == ["triton", "direct", "triton", "triton"]


def test_cpu_tensors_and_the_interpreter_always_go_through_triton(monkeypatch):
    kernel = _Kernel()
    launches = DirectLaunches(kernel)
    for _ in range(2):
        _launch_one(launches, torch.device("cpu"))
    monkeypatch.setattr(triton_support, "triton_interpreter_enabled", lambda: True)
    for _ in range(2):
        _launch_one(launches, torch.device("cuda", 0))
    assert [entry[0] for entry in kernel.log] == ["triton"] * 4


def test_pointer_alignment_bits_tell_offset_views_apart():
    base = torch.zeros(64)
    assert alignment_bits(data_pointers((base, base[4:]))) == 0b11
    assert alignment_bits(data_pointers((base, base[1:]))) == 0b10
    assert alignment_bits(data_pointers((base[1:], base))) == 0b01
    assert data_pointers((base, base[1:])) == (base.data_ptr(), base.data_ptr() + 4)
