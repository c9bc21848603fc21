"""bf16 AMP for the DETR family's focal loss.

mmdet's ``FocalLoss`` sends CUDA tensors to mmcv's compiled ``sigmoid_focal_loss``, which has no bf16 kernel
("not implemented for 'BFloat16'"); bf16 logits are passed to it in float32 instead (exact: the conversion is
lossless). fp32 and fp16 calls are untouched.
"""
from __future__ import annotations

from typing import Callable

import torch

from .import_hooks import patch_when_imported

FOCAL_LOSS_MODULE = "mmdet.models.losses.focal_loss"
FOCAL_LOSS_GLOBAL_NAME = "_sigmoid_focal_loss"  # mmcv's SigmoidFocalLossFunction.apply, as mmdet imported it


def sigmoid_focal_loss_accepting_bf16(compiled_focal_loss: Callable) -> Callable:
    def sigmoid_focal_loss(input, *args, **kwargs):
        if input.dtype == torch.bfloat16:
            input = input.float()
        return compiled_focal_loss(input, *args, **kwargs)

    sigmoid_focal_loss.wrapped_by_deform_plugin = compiled_focal_loss
    return sigmoid_focal_loss


def _let_focal_loss_take_bf16(module) -> None:
    current = getattr(module, FOCAL_LOSS_GLOBAL_NAME, None)
    if current is not None and not hasattr(current, "wrapped_by_deform_plugin"):
        setattr(module, FOCAL_LOSS_GLOBAL_NAME, sigmoid_focal_loss_accepting_bf16(current))


def install_bf16_focal_loss() -> None:
    patch_when_imported(FOCAL_LOSS_MODULE, _let_focal_loss_take_bf16)
