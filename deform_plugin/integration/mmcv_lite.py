"""Everything deform_plugin knows of mmcv-lite: the one answer to "are mmcv's compiled ops present?" and a
stand-in for mmcv's compiled extension ``mmcv._ext`` where they are not.

mmcv-lite ships mmcv's Python code without the compiled ops, so ``import mmcv.ops`` (and through it
``import mmdet.models``) fails: every ``mmcv.ops`` module calls ``ext_loader.load_ext('_ext', [...])`` at import
time. The stand-in module answers those look-ups:

* the few ops that the DETR family calls outside MSDA get PyTorch implementations with the compiled op's calling
  convention (sigmoid focal loss, which mmdet's ``FocalLoss`` takes for CUDA tensors; NMS; and MSDA itself, so that
  mmcv's own ``MultiScaleDeformableAttnFunction`` also runs);
* every other op is a callable that raises ``NotImplementedError`` naming the op and how to get it.

It is installed only when no compiled ``mmcv._ext`` can be found, and marks itself with ``__deform_plugin_standin__``.

Processes that must stay free of deform_plugin (the stock side of tests and benchmarks) ask the same questions by
running this file, which imports only the standard library and torch at module level:
``python deform_plugin/integration/mmcv_lite.py compiled-ops`` exits 0 when mmcv's compiled ops are present (the
Makefile asks it before installing mmcv-lite), and :func:`install_placeholder_ext` (reached with
``runpy.run_path``) lets mmdet import on a CPU with mmcv-lite while serving no op at all.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Callable, Dict

import torch

STANDIN_FLAG = "__deform_plugin_standin__"
MODULE_NAME = "mmcv._ext"


def _compute(input: torch.Tensor) -> torch.Tensor:
    # float32 at least, as the CUDA kernel computes (it reads half inputs into float math).
    return input.to(torch.promote_types(input.dtype, torch.float32))


def sigmoid_focal_loss_forward(input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor, output: torch.Tensor,
                               gamma: float = 2.0, alpha: float = 0.25) -> None:
    """Element-wise sigmoid focal loss written into ``output``, as mmcv's kernel computes it.

    ``target`` holds a class index per row; the index ``num_classes`` (or any index >= it) is background.
    """
    compute = _compute(input)
    prob = compute.sigmoid()
    positive = target[:, None] == torch.arange(input.shape[1], device=input.device)[None, :]
    tiny = torch.finfo(torch.float32).tiny  # the kernel's FLT_MIN
    term_pos = (1 - prob).pow(gamma) * prob.clamp_min(tiny).log()
    term_neg = prob.pow(gamma) * (1 - prob).clamp_min(tiny).log()
    loss = torch.where(positive, -alpha * term_pos, -(1 - alpha) * term_neg)
    loss = loss * _class_weight(weight, target, loss)
    output.copy_(loss.to(output.dtype))


def sigmoid_focal_loss_backward(input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor,
                                grad_input: torch.Tensor, gamma: float = 2.0, alpha: float = 0.25) -> None:
    """d(loss)/d(input) of :func:`sigmoid_focal_loss_forward`, written into ``grad_input``."""
    compute = _compute(input)
    prob = compute.sigmoid()
    positive = target[:, None] == torch.arange(input.shape[1], device=input.device)[None, :]
    tiny = torch.finfo(torch.float32).tiny  # the kernel's FLT_MIN
    term_pos = (1 - prob).pow(gamma) * (1 - prob - gamma * prob * prob.clamp_min(tiny).log())
    term_neg = prob.pow(gamma) * (gamma * (1 - prob) * (1 - prob).clamp_min(tiny).log() - prob)
    grad = torch.where(positive, -alpha * term_pos, -(1 - alpha) * term_neg)
    grad = grad * _class_weight(weight, target, grad)
    grad_input.copy_(grad.to(grad_input.dtype))


def _class_weight(weight: torch.Tensor, target: torch.Tensor, like: torch.Tensor):
    if weight.numel() == 0:
        return 1.0
    # Background rows (target >= num_classes) have no class weight; the kernel would read out of bounds there.
    in_range = target < weight.numel()
    per_row = torch.where(in_range, weight.to(like.dtype)[target.clamp_max(weight.numel() - 1)],
                          torch.ones_like(like[:, 0]))
    return per_row[:, None]


def nms(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float = 0.5, offset: int = 0) -> torch.Tensor:
    """Greedy NMS: indices of kept boxes in descending score order (mmcv's ``nms`` contract)."""
    if boxes.numel() == 0:
        return boxes.new_zeros(0, dtype=torch.long)
    order = scores.argsort(descending=True)
    boxes = boxes[order].float()
    area = (boxes[:, 2] - boxes[:, 0] + offset) * (boxes[:, 3] - boxes[:, 1] + offset)
    top_left = torch.maximum(boxes[:, None, :2], boxes[None, :, :2])
    bottom_right = torch.minimum(boxes[:, None, 2:], boxes[None, :, 2:])
    size = (bottom_right - top_left + offset).clamp_min(0)
    inter = size[..., 0] * size[..., 1]
    iou = inter / (area[:, None] + area[None, :] - inter).clamp_min(1e-12)
    overlaps = (iou > iou_threshold).cpu()
    suppressed = torch.zeros(len(boxes), dtype=torch.bool)
    kept = []
    for i in range(len(boxes)):
        if not suppressed[i]:
            kept.append(i)
            suppressed |= overlaps[i]
    keep = torch.tensor(kept, dtype=torch.long, device=order.device)
    return order[keep]


def ms_deform_attn_forward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
                           im2col_step=None):
    """mmcv's compiled MSDA forward, served by deform_plugin's op (any batch size, im2col_step ignored)."""
    from deform_plugin.ops import multi_scale_deformable_attn
    return multi_scale_deformable_attn(value, spatial_shapes, level_start_index, sampling_locations,
                                       attention_weights)


def ms_deform_attn_backward(value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
                            grad_output, grad_value, grad_sampling_loc, grad_attn_weight, im2col_step=None):
    """mmcv's compiled MSDA backward: gradients written into the three ``grad_*`` buffers."""
    from deform_plugin.ops import multi_scale_deformable_attn
    with torch.enable_grad():
        inputs = [t.detach().requires_grad_() for t in (value, sampling_locations, attention_weights)]
        output = multi_scale_deformable_attn(inputs[0], spatial_shapes, level_start_index, inputs[1], inputs[2])
        grads = torch.autograd.grad(output, inputs, grad_output)
    for buffer, grad in zip((grad_value, grad_sampling_loc, grad_attn_weight), grads):
        buffer.copy_(grad)


IMPLEMENTED_OPS: Dict[str, Callable] = {
    "sigmoid_focal_loss_forward": sigmoid_focal_loss_forward,
    "sigmoid_focal_loss_backward": sigmoid_focal_loss_backward,
    "nms": nms,
    "ms_deform_attn_forward": ms_deform_attn_forward,
    "ms_deform_attn_backward": ms_deform_attn_backward,
}


class MissingCompiledOp:
    """Placeholder for an mmcv op that needs mmcv's compiled extension; calling it explains how to get it."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"mmcv op '{self.name}' needs mmcv's compiled extension (mmcv._ext), which this environment lacks "
            "(mmcv-lite is installed). deform_plugin's stand-in serves MSDA, sigmoid focal loss and NMS only. "
            "To use this op, install mmcv with its ops: `pip uninstall mmcv-lite && "
            "MMCV_WITH_OPS=1 pip install --no-build-isolation mmcv==2.1.0` (builds from source; CUDA ops need "
            "the CUDA toolkit).")

    def __repr__(self) -> str:
        return f"<mmcv op {self.name!r}: not available without mmcv's compiled extension>"


class _StandinLoader(importlib.abc.Loader):
    """Loader of the stand-in, so the module has a real spec (``importlib.util.find_spec`` works on it)."""

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__doc__ = __doc__
        return module

    def exec_module(self, module):
        setattr(module, STANDIN_FLAG, True)
        for name, function in IMPLEMENTED_OPS.items():
            setattr(module, name, function)

        def __getattr__(name: str):
            # Dunder look-ups (inspect, pickle, copy) must fail normally; any other name is an mmcv op.
            if name.startswith("__") and name.endswith("__"):
                raise AttributeError(name)
            return MissingCompiledOp(name)

        module.__getattr__ = __getattr__


def standin_installed() -> bool:
    module = sys.modules.get(MODULE_NAME)
    return module is not None and getattr(module, STANDIN_FLAG, False)


def compiled_mmcv_ops_available() -> bool:
    """True when mmcv's real compiled extension is importable (not our stand-in)."""
    if standin_installed():
        return False
    module = sys.modules.get(MODULE_NAME)
    if module is not None:
        return getattr(module, "__spec__", None) is not None and module.__spec__.loader is not None
    return _find_compiled_ext()


def _find_compiled_ext() -> bool:
    try:
        return importlib.util.find_spec("mmcv") is not None and importlib.util.find_spec(MODULE_NAME) is not None
    except (ImportError, ValueError):
        return False


def install_placeholder_ext() -> bool:
    """For stock processes on a CPU with mmcv-lite: a bare ``mmcv._ext`` whose every op raises when called.

    mmdet's modules look their ops up at import; mmcv's own CPU paths (its pure-PyTorch MSDA) never call them.
    Without a loader, mmengine's ``mmcv_full_available()`` still reports False, as it should. Returns whether it
    was installed (False where compiled ops exist).
    """
    if MODULE_NAME in sys.modules or _find_compiled_ext():
        return False
    placeholder = types.ModuleType(MODULE_NAME)
    placeholder.__spec__ = importlib.machinery.ModuleSpec(MODULE_NAME, None)

    def __getattr__(name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return MissingCompiledOp(name)

    placeholder.__getattr__ = __getattr__
    sys.modules[MODULE_NAME] = placeholder
    return True


def install_mmcv_ext_standin() -> bool:
    """Install the stand-in when mmcv is present without its compiled ops. Returns whether it is (now) installed."""
    if standin_installed():
        return True
    if importlib.util.find_spec("mmcv") is None or compiled_mmcv_ops_available():
        return False
    spec = importlib.machinery.ModuleSpec(MODULE_NAME, _StandinLoader(), origin="deform_plugin stand-in")
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE_NAME] = module
    spec.loader.exec_module(module)
    parent = sys.modules.get("mmcv")
    if parent is not None:
        setattr(parent, "_ext", module)
    _repair_early_transformer_import()
    return True


def _repair_early_transformer_import() -> None:
    """Give ``mmcv.cnn.bricks.transformer`` the ``MultiScaleDeformableAttention`` it failed to import.

    That module imports MSDA from ``mmcv.ops`` inside ``try``; imported before the stand-in existed, it only warned
    and left the name out, and mmdet's pixel decoder then fails to import it from there. Now that ``mmcv.ops``
    imports, the name is put back, so the order of ``import mmcv...`` and ``import deform_plugin`` does not matter.
    """
    transformer = sys.modules.get("mmcv.cnn.bricks.transformer")
    if transformer is None or hasattr(transformer, "MultiScaleDeformableAttention"):
        return
    from mmcv.ops.multi_scale_deform_attn import MultiScaleDeformableAttention
    transformer.MultiScaleDeformableAttention = MultiScaleDeformableAttention


if __name__ == "__main__":
    # `python mmcv_lite.py compiled-ops`: exit status 0 when mmcv's compiled ops are present, 1 otherwise.
    if sys.argv[1:] != ["compiled-ops"]:
        raise SystemExit(f"usage: python {sys.argv[0]} compiled-ops")
    sys.exit(0 if compiled_mmcv_ops_available() else 1)
