"""Graphed regions and graph inference on the CPU: CUDA graphs emulated by re-running the captured work, and a small
region to run.

:class:`EmulatedGraphRegion` is :class:`GraphedRegion` with its capture replaced, so that its replay machinery
(static buffers shared by signatures, the autograd function, gradient copies, fallbacks) runs without a GPU.
:class:`SmallNet`, :func:`small_region` and :func:`forward_backward` give it a few linear layers to capture.
:class:`EmulatedGraphInference` does the same for :class:`GraphInference` (static inputs and outputs, signatures,
the policy).
"""
import torch
import torch.utils._pytree as pytree
from torch import nn

from deform_plugin.cuda_graphs import CapturePolicy
from deform_plugin.integration.mmdet_fast_paths.graphed_region import GraphedRegion
from deform_plugin.integration.mmdet_graph_inference import GraphInference


class ReRunGraph:
    """A stand-in for a CUDA graph on the CPU: replaying runs the captured work again."""

    def __init__(self, work):
        self.work = work

    def replay(self):
        with torch.enable_grad():
            self.work()


class EmulatedGraphRegion(GraphedRegion):
    """A region whose graphs re-run the captured work on the CPU; it captures a new shape of a warmed-up kind at its
    first call (``capture_after=1``) unless given another policy."""

    device_type = "cpu"

    def __init__(self, *args, policy=None, **kwargs):
        super().__init__(*args, policy=policy or CapturePolicy(capture_after=1), **kwargs)

    def capture_graph(self, work):
        # A capture launches nothing: keep the random state as it was (dropout draws at the replay only).
        state = torch.get_rng_state()
        work()
        torch.set_rng_state(state)
        return ReRunGraph(work)


class SmallNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.b = nn.Linear(5, 3)
        self.unused = nn.Linear(2, 2)
        self.frozen = nn.Linear(3, 3).requires_grad_(False)


def small_region(net):
    def fn(x, scale):
        hidden = torch.tanh(net.a(x)) * scale[:, None]
        out = net.frozen(net.b(hidden))
        return dict(out=out, flags=[hidden > 0, None]), ("constant", x.shape[0])
    return fn


def forward_backward(call, x, scale, grad_seed):
    outputs, constants = call(x, scale)
    generator = torch.Generator().manual_seed(grad_seed)
    upstream = torch.randn(outputs["out"].shape, generator=generator, dtype=outputs["out"].dtype)
    (outputs["out"] * upstream).sum().backward()
    return outputs, constants


class ReRunInferenceGraph:
    """Replaying re-runs the captured forward on the static inputs and writes its outputs where the capture's are."""

    def __init__(self, work, outputs):
        self.work, self.outputs = work, outputs

    def replay(self):
        for static, fresh in zip(pytree.tree_leaves(self.outputs), pytree.tree_leaves(self.work())):
            static.copy_(fresh)


class EmulatedGraphInference(GraphInference):
    """Graphs that re-run the captured work on the CPU and write its outputs where the capture's are."""

    device_type = "cpu"

    def capture_graph(self, work):
        outputs = work()
        return ReRunInferenceGraph(work, outputs), outputs
