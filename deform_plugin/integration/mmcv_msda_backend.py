"""mmcv's stock CUDA MSDA kernel as the ``'mmcv'`` backend of deform_plugin's MSDA op (for comparison runs).

Registered into the op's backend table here, so that the op itself never imports mmcv.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from deform_plugin.ops.backend import register_backend

from .mmcv_lite import compiled_mmcv_ops_available


def _mmcv_unavailable_reason(device: torch.device) -> Optional[str]:
    if not compiled_mmcv_ops_available():
        return ("backend='mmcv' needs mmcv built with its compiled ops (mmcv._ext), but this environment has none "
                "(mmcv-lite or no mmcv): install mmcv 2.1.0 with ops (MMCV_WITH_OPS=1 pip install mmcv==2.1.0) "
                "or choose backend='triton' / 'pytorch'")
    if device.type != "cuda":
        return f"backend='mmcv' runs mmcv's CUDA kernel and needs CUDA tensors, got tensors on {device}"
    return None


def _multi_scale_deformable_attn_mmcv(value, spatial_shapes, level_start_index, sampling_locations,
                                      attention_weights):
    from mmcv.ops.multi_scale_deform_attn import MultiScaleDeformableAttnFunction

    # The stock kernel needs batch % im2col_step == 0; gcd(batch, 64) is the largest such step up to its default.
    im2col_step = math.gcd(value.shape[0], 64)
    return MultiScaleDeformableAttnFunction.apply(value, spatial_shapes, level_start_index, sampling_locations,
                                                  attention_weights, im2col_step)


def register_mmcv_msda_backend() -> None:
    register_backend("msda", "mmcv", _multi_scale_deformable_attn_mmcv, _mmcv_unavailable_reason)
