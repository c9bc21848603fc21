"""Host launcher of the greedy-NMS Triton kernel: visit order, gathers, one launch, indices back.

Everything here is a device operation with shapes fixed by the inputs (``torch.sort``, gathers, one ``amax``, the
kernel): no ``.item()``, no copy to the host and no data-dependent shape, so the whole path captures in a CUDA
graph. It takes inputs that :mod:`.checks` already accepted.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..triton_support import launch_device, next_power_of_2
from .checks import GreedyNMSCall, triton_unsupported_reasons
from .reference import visit_order
from .triton_kernels import greedy_nms_kernel

# One warp per row: the kernel's only reduction ("is box i suppressed by any kept box") then stays inside the warp.
NUM_WARPS = 1


def greedy_nms_first_kept_launch(boxes: torch.Tensor, scores: torch.Tensor, valid: Optional[torch.Tensor],
                                 iou_threshold: float, max_kept: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Greedy NMS on Triton. Returns ``kept (B, max_kept) int64`` (original indices, then -1) and ``count (B,)``."""
    batch, num_boxes = scores.shape
    call = GreedyNMSCall(batch, num_boxes, iou_threshold, max_kept)
    reasons = triton_unsupported_reasons(call)
    if reasons:
        raise ValueError("backend='triton' cannot run these inputs: " + "; ".join(reasons))
    if call.is_empty:
        return (torch.full((batch, max_kept), -1, dtype=torch.int64, device=boxes.device),
                torch.zeros(batch, dtype=torch.int64, device=boxes.device))

    order = visit_order(scores, valid)
    visited_boxes = boxes.float().gather(1, order[..., None].expand(-1, -1, 4)).contiguous()
    if valid is not None:
        visited_valid = valid.gather(1, order).to(torch.int8)
        positions = torch.arange(1, num_boxes + 1, dtype=torch.int64, device=boxes.device)
        visit_end = torch.where(visited_valid != 0, positions, 0).amax(-1)
    else:
        # Never read (HAS_VALID is off): any int8 and int64 tensors on the device will do.
        visited_valid = visited_boxes.new_empty(0, dtype=torch.int8)
        visit_end = visited_boxes.new_empty(0, dtype=torch.int64)
    kept_positions = torch.empty((batch, max_kept), dtype=torch.int64, device=boxes.device)
    count = torch.empty(batch, dtype=torch.int64, device=boxes.device)
    # Lanes for at most min(max_kept, N) kept boxes, a power of two: N below max_kept compiles at most log2 variants.
    # Up to 1024 lanes the kept boxes fit in registers (about 240 per thread for sm_90, no spills); beyond, they
    # spill to local memory: still correct, slower per step.
    block_k = next_power_of_2(min(max_kept, num_boxes))
    with launch_device(boxes):
        greedy_nms_kernel[(batch,)](visited_boxes, visited_valid, visit_end, kept_positions, count, num_boxes,
                                    max_kept, iou_threshold, HAS_VALID=valid is not None, BLOCK_K=block_k,
                                    num_warps=NUM_WARPS, enable_fp_fusion=False)
    # Visit positions back to original indices; -1 stays -1.
    kept = torch.where(kept_positions >= 0, order.gather(1, kept_positions.clamp_min(0)), -1)
    return kept, count
