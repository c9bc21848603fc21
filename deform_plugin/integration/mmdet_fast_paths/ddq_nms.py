"""The ``float32_nms`` fast path: DDQ-DETR's NMS takes its boxes and scores in float32 (at least), so that it runs
under autocast and decides as float32 NMS decides on the values the step computed.

mmdet 3.3.0's DDQ-DETR calls mmcv's ``batched_nms`` in ``DDQDETR.pre_decoder`` (the encoder's proposals that become
the distinct queries; in training also the dense queries' sort, ``nms_cfg=None``) and in
``DDQTransformerDecoder.select_distinct_queries`` (the distinct queries between decoder layers). Under autocast
(``tools/train.py --amp-dtype bfloat16``, or ``--amp``) the class scores leave a ``Linear`` in bf16 (fp16), and
``sigmoid`` and ``max`` keep that dtype; the boxes are float32 (the box branch's bf16 output is added to float32
proposals, in the decoder to float32 references). With ``split_thr`` boxes or more (mmcv's default 10000: the encoder's
proposals at COCO sizes, over 20000 tokens at 800x1333), ``batched_nms`` runs NMS group by group and collects the
kept scores in ``scores.new_zeros(...)``, a bf16 tensor, from the ``dets`` that ``nms`` made by concatenating the
float32 boxes with the scores (float32 by type promotion): the index-put raises "Index put requires the source and
destination dtypes match". Stock mmdet fails there whichever NMS kernel runs (mmcv's compiled CPU or CUDA ones or
mmcv-lite's stand-in): the failure is in mmcv's Python. Below ``split_thr`` the call runs; mmcv's compiled kernels
read the boxes as ``float*`` and would refuse bf16 boxes, which DDQ-DETR does not pass.

Here both methods call ``batched_nms`` with their boxes and scores cast to float32 where they are of a lower
precision (float32 and float64 pass as they are: ``Tensor.to`` returns the tensor itself, so in float32 training the
fast path is a no-op and stock's float64 tests run unchanged). NMS then decides in float32 on the values the step
computed: exactly what float32 NMS decides on the bf16 scores cast up. It can differ from a float32 model's choice
only as the bf16 values differ from float32 ones (bf16 scores tie more often). Only the kept indices leave
``batched_nms`` (the methods discard its boxes and scores), so nothing downstream changes dtype.

The two methods stay mmdet's own code: each is rebuilt from its code object with one global name, ``batched_nms``,
bound to the casting call, and set on the instances only. No line of mmdet's is copied (nothing to drift from the
release it mirrors), and other DDQ-DETRs in the process, and mmdet's modules, are left as they are.
"""
from __future__ import annotations

import types
from typing import Callable

import torch
from torch import nn

__all__ = ["enable_float32_nms", "float32_batched_nms", "has_ddq_nms", "method_with_float32_nms"]


def _at_least_float32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def float32_batched_nms(batched_nms: Callable) -> Callable:
    """``batched_nms`` (mmcv's signature) called with its boxes and scores in float32 where they are bf16 or fp16,
    and its class indices on the boxes' device: DDQ-DETR's decoder passes CPU indices, which mmcv's per-class branch
    (more boxes than its ``split_thr``) indexes with the device's kept indices."""

    def batched_nms_in_float32(boxes, scores, idxs, nms_cfg, class_agnostic=False):
        return batched_nms(_at_least_float32(boxes), _at_least_float32(scores), idxs.to(boxes.device), nms_cfg,
                           class_agnostic)

    return batched_nms_in_float32


def method_with_float32_nms(method: types.FunctionType) -> types.FunctionType:
    """``method``'s own code with its global ``batched_nms`` the one of :func:`float32_batched_nms`.

    Its other globals are those of its module when the switch is turned on (a function's globals must be a dict).
    """
    namespace = dict(method.__globals__)
    namespace["batched_nms"] = float32_batched_nms(namespace["batched_nms"])
    rebuilt = types.FunctionType(method.__code__, namespace, method.__name__, method.__defaults__, method.__closure__)
    rebuilt.__kwdefaults__ = method.__kwdefaults__
    rebuilt.__qualname__ = method.__qualname__
    rebuilt.__doc__ = method.__doc__
    return rebuilt


def _nms_methods():
    """(class, method name): the DDQ-DETR methods of mmdet 3.3.0 that call ``batched_nms``."""
    from mmdet.models.detectors import DDQDETR
    from mmdet.models.layers import DDQTransformerDecoder
    return (DDQDETR, "pre_decoder"), (DDQTransformerDecoder, "select_distinct_queries")


def has_ddq_nms(model: nn.Module) -> bool:
    """Whether ``model`` holds a DDQ-DETR detector or decoder (a module whose NMS ``float32_nms`` is for)."""
    classes = tuple(stock_class for stock_class, _ in _nms_methods())
    return any(isinstance(module, classes) for module in model.modules())


def enable_float32_nms(model: nn.Module) -> int:
    """Give every DDQ-DETR detector of ``model`` whose ``pre_decoder`` is mmdet's, and every DDQ decoder whose
    ``select_distinct_queries`` is mmdet's, the method with its NMS in float32 (see the module); returns how many
    methods changed (two per DDQ-DETR)."""
    changed = 0
    for stock_class, name in _nms_methods():
        method = getattr(stock_class, name)
        rebuilt = None
        for module in model.modules():
            if isinstance(module, stock_class) and getattr(type(module), name) is method and name not in vars(module):
                rebuilt = rebuilt or method_with_float32_nms(method)
                setattr(module, name, types.MethodType(rebuilt, module))
                changed += 1
    return changed
