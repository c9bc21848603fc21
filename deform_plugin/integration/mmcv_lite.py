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
import math
import sys
import types
from typing import Callable, Dict

import torch

__all__ = ["MissingCompiledOp", "compiled_mmcv_ops_available", "install_mmcv_ext_standin", "install_placeholder_ext",
           "ms_deform_attn_backward", "ms_deform_attn_forward", "nms", "sigmoid_focal_loss_backward",
           "sigmoid_focal_loss_forward", "standin_installed"]

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


# Greedy NMS decides this many boxes (in score order) per step, with one small host copy per step.
_NMS_BLOCK = 256
# Boxes per spatial tile: a kept box is tested against the boxes of the tiles whose bounding box it overlaps.
_NMS_TILE = 32
# IoU pairs evaluated at once: bounds every temporary of the suppression step (4 MB of float32).
_NMS_PAIRS = 1 << 20


def nms(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float = 0.5, offset: int = 0) -> torch.Tensor:
    """Greedy NMS: indices of the kept boxes in descending score order (mmcv's compiled ``nms``).

    The same results as mmcv's CPU kernel (``mmcv/ops/csrc/pytorch/cpu/nms.cpp``): boxes are visited in the order
    of ``scores.sort(0, descending=True)`` (the very call the kernel makes, so tied scores fall the same way), and a
    kept box suppresses every later box whose IoU with it exceeds ``iou_threshold``, computed in float32 as the
    kernel does: ``w = max(0, min(x2) - max(x1) + offset)``, likewise ``h``, ``inter = w * h``,
    ``IoU = inter / (area_i + area_j - inter)`` with ``area = (x2 - x1 + offset) * (y2 - y1 + offset)``, and the
    threshold rounded to float32. (mmcv's CUDA kernel tests ``inter > threshold * union`` instead, which can differ
    from its own CPU kernel in the last bit at an IoU equal to the threshold.)

    Memory is O(N); no N x N matrix exists. Boxes are decided ``_NMS_BLOCK`` at a time in score order: the block's
    own IoU mask is resolved greedily on the host (one ``block x block / 8`` byte copy), then the block's kept boxes
    suppress later boxes on the boxes' device. For that step the boxes are grouped once into spatial tiles of
    ``_NMS_TILE`` (sorted by size class and Z-order of their centres); a kept box is tested only against the boxes
    of tiles whose bounding box it overlaps (with a non-negative threshold, boxes that do not overlap cannot
    suppress each other), ``_NMS_PAIRS`` pairs at a time; whenever fewer than half of the tiled boxes are still
    undecided, the tiles are rebuilt from those alone. Time stays quadratic only where every box overlaps every
    other without suppressing it. (Boxes with NaN coordinates may be kept where the kernel's ``std::max`` would have
    ignored the NaN.)
    """
    if boxes.numel() == 0:
        return torch.zeros(0, dtype=torch.long, device=boxes.device)
    count = len(boxes)
    order = scores.sort(0, descending=True)[1]
    x1, y1, x2, y2 = boxes[order].float().t()
    area = (x2 - x1 + offset) * (y2 - y1 + offset)
    # (5, N + 1) in score order; the last column is a box that overlaps nothing, padding the last tile.
    pad = torch.tensor([[math.inf], [math.inf], [-math.inf], [-math.inf], [0.0]], device=boxes.device)
    coords = torch.cat([torch.stack([x1, y1, x2, y2, area]), pad], 1)
    threshold = torch.tensor(float(iou_threshold), dtype=torch.float32, device=boxes.device)
    # A negative threshold lets boxes that do not even touch suppress each other (IoU 0): no pruning then.
    prune = float(threshold) >= 0
    alive = torch.ones(count + 1, dtype=torch.bool, device=boxes.device)  # undecided boxes, in score order
    alive[count] = False
    spatial = _spatial_order(coords[:, :count])
    members, tile_boxes = _tiles(coords, spatial, count)
    kept = []
    cursor = 0
    while True:
        block = alive[cursor:].nonzero().squeeze(1)[:_NMS_BLOCK] + cursor
        if not block.numel():
            break
        cursor = int(block[-1]) + 1
        block_coords = coords[:, block]
        keep = _greedy(_suppression(block_coords[:, :, None], block_coords[:, None, :], offset, threshold).triu_(1))
        kept.append(block[keep])
        alive[block] = False
        winners = block_coords[:, keep]
        if prune:
            pairs = _overlap(winners[:4, :, None], tile_boxes[:, None, :], offset).nonzero()
        else:
            pairs = torch.cartesian_prod(torch.arange(winners.shape[1], device=boxes.device),
                                         torch.arange(len(members), device=boxes.device)).view(-1, 2)
        step = max(1, _NMS_PAIRS // _NMS_TILE)
        for first in range(0, len(pairs), step):
            winner, tile = pairs[first:first + step].unbind(1)
            candidates = members[tile]
            others = coords.index_select(1, candidates.flatten()).view(5, *candidates.shape)
            suppressed = _suppression(winners[:, winner, None], others, offset, threshold)
            alive[candidates[suppressed]] = False
        if 2 * int(alive.sum()) < members.numel():
            # Most tiled boxes are decided: keep the undecided ones, in the same spatial order, in fewer tiles.
            spatial = spatial[alive[spatial]]
            members, tile_boxes = _tiles(coords, spatial, count)
    return order[torch.cat(kept)]


def _spatial_order(coords: torch.Tensor) -> torch.Tensor:
    """Positions of ``coords`` ``(5, n)`` sorted by size class (log2 of the longer side), then Z-order of centres."""
    x1, y1, x2, y2 = (torch.nan_to_num(c, nan=0.0, posinf=0.0, neginf=0.0) for c in coords[:4])
    size = torch.maximum(x2 - x1, y2 - y1).clamp(1.0, 2.0 ** 40)
    size_class = size.log2().floor().long()
    codes = []
    for centre in ((x1 + x2) / 2, (y1 + y2) / 2):
        low, high = centre.min(), centre.max()
        cell = ((centre - low) / (high - low).clamp_min(1e-6) * 65535).long().clamp(0, 65535)
        for shift, mask in ((8, 0x00FF00FF), (4, 0x0F0F0F0F), (2, 0x33333333), (1, 0x55555555)):
            cell = (cell | (cell << shift)) & mask  # spread the 16 bits to the even bit positions
        codes.append(cell)
    return torch.argsort((size_class << 32) | codes[0] | (codes[1] << 1))


def _tiles(coords: torch.Tensor, spatial: torch.Tensor, pad: int):
    """``_NMS_TILE`` consecutive positions of ``spatial`` per tile (padded with column ``pad``) and each tile's
    bounding box ``(4, tiles)``; NaN coordinates widen it to infinity, so no member can be pruned wrongly."""
    members = torch.cat([spatial, spatial.new_full(((-len(spatial)) % _NMS_TILE,), pad)]).view(-1, _NMS_TILE)
    x1, y1, x2, y2 = coords[:4, members]
    return members, torch.stack([torch.nan_to_num(x1, nan=-math.inf).amin(1),
                                 torch.nan_to_num(y1, nan=-math.inf).amin(1),
                                 torch.nan_to_num(x2, nan=math.inf).amax(1),
                                 torch.nan_to_num(y2, nan=math.inf).amax(1)])


def _overlap(first: torch.Tensor, second: torch.Tensor, offset: int) -> torch.Tensor:
    """Whether boxes ``first`` and ``second`` (x1, y1, x2, y2 along dim 0, broadcasting) intersect in mmcv's sense
    (``min(x2) - max(x1) + offset > 0`` and likewise along y). Monotone in each coordinate, exactly as the IoU's
    ``w`` and ``h``: a box overlapping no tile bounding box overlaps none of its members."""
    width = torch.minimum(first[2], second[2]).sub_(torch.maximum(first[0], second[0]))
    height = torch.minimum(first[3], second[3]).sub_(torch.maximum(first[1], second[1]))
    return (width.add_(offset) > 0) & (height.add_(offset) > 0)


def _suppression(winners: torch.Tensor, others: torch.Tensor, offset: int, threshold: torch.Tensor) -> torch.Tensor:
    """IoU of ``winners`` and ``others`` above the threshold, in mmcv's float32 operation order.

    Both are ``(5, ...)``: x1, y1, x2, y2, area along dim 0, the rest broadcasting against each other.
    """
    width = torch.minimum(winners[2], others[2]).sub_(torch.maximum(winners[0], others[0]))
    height = torch.minimum(winners[3], others[3]).sub_(torch.maximum(winners[1], others[1]))
    if offset:
        width.add_(offset)
        height.add_(offset)
    inter = _clamp_to_zero(width).mul_(_clamp_to_zero(height))
    union = torch.add(winners[4], others[4]).sub_(inter)
    return inter.div_(union) > threshold


def _clamp_to_zero(length: torch.Tensor) -> torch.Tensor:
    # The kernel's std::max(0.f, v), in place: 0 for NaN too (clamp alone keeps NaN; fmax and where are slower).
    return torch.nan_to_num_(length.clamp_min_(0), nan=0.0, posinf=math.inf, neginf=-math.inf)


def _greedy(over: torch.Tensor) -> torch.Tensor:
    """Kept positions of a block whose ``over[i, j]`` (i < j only) says that box i would suppress box j.

    The mask travels to the host packed into bits, one Python int per row; the greedy scan is a loop of big-int ORs.
    """
    count = over.shape[0]
    padded = over.new_zeros((count, -(-count // 8) * 8))
    padded[:, :count] = over
    bit_values = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=over.device)
    packed = (padded.view(count, -1, 8).to(torch.uint8) * bit_values).sum(-1).to(torch.uint8)
    data = bytes(packed.cpu().flatten().tolist())
    row_bytes = packed.shape[1]
    suppressed = 0
    keep = []
    for i in range(count):
        if not (suppressed >> i) & 1:
            keep.append(i)
            suppressed |= int.from_bytes(data[i * row_bytes:(i + 1) * row_bytes], "little")
    return torch.tensor(keep, dtype=torch.long, device=over.device)


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
