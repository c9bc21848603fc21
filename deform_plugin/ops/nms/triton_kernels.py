"""Triton kernel of greedy NMS: one program walks one row's boxes in visit order.

Greedy NMS is sequential along a row: whether a box is kept depends on every decision before it. The program keeps
the coordinates and areas of the boxes kept so far in registers, as ``BLOCK_K``-lane vectors (lane ``k`` holds the
``k``-th kept box), tests each visited box against all of them at once, and stops as soon as ``max_kept`` boxes
are kept or the row's last valid box is visited: with thousands of candidate boxes and a few hundred to keep, the
early exit is most of the speed. One warp per program keeps the "suppressed by any kept box" reduction inside the
warp, with no shared-memory barrier per step. The next box is loaded one step ahead, so its load overlaps the
current step's test.

The test is the reference's (:mod:`.reference`, step 3) in float32, operation for operation; the launcher turns off
fused multiply-add so that ``area_a + area_b - w * h`` rounds exactly as there.

Tensor arguments are contiguous; their shapes are commented at each pointer.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def greedy_nms_kernel(
    boxes_ptr,  # (B, N, 4) float32: each row's boxes in visit order
    valid_ptr,  # (B, N) int8 in visit order, nonzero where a box may be kept (unread without HAS_VALID)
    visit_end_ptr,  # (B,) int64: one past each row's last valid position (unread without HAS_VALID)
    kept_ptr,  # (B, max_kept) int64 out: visit positions of the kept boxes, then -1
    count_ptr,  # (B,) int64 out: boxes kept per row
    num_boxes,
    max_kept,
    iou_threshold,
    HAS_VALID: tl.constexpr,
    BLOCK_K: tl.constexpr,  # a power of two >= min(max_kept, num_boxes): one lane per kept box
):
    # Scalars are int64 throughout: free here, and the interpreter checks every int32 operation for overflow.
    row = tl.program_id(0).to(tl.int64)
    zero = tl.zeros([], dtype=tl.int64)
    if HAS_VALID:
        # Invalid boxes sort last (key -inf): stopping after the last valid one skips them all.
        visit_end = tl.load(visit_end_ptr + row)
    else:
        visit_end = zero + num_boxes
    last_position = visit_end - 1
    max_kept = zero + max_kept
    row_kept = kept_ptr + row * max_kept

    lanes = tl.arange(0, BLOCK_K)
    # Lanes past the kept boxes hold an empty box (x1 = y1 = +inf, x2 = y2 = -inf) of infinite area: its inter is
    # 0 (or NaN) and its union +inf (or NaN), so it never suppresses anything and needs no `lanes < count` mask.
    kept_x1 = tl.full([BLOCK_K], float("inf"), dtype=tl.float32)
    kept_y1 = tl.full([BLOCK_K], float("inf"), dtype=tl.float32)
    kept_x2 = tl.full([BLOCK_K], -float("inf"), dtype=tl.float32)
    kept_y2 = tl.full([BLOCK_K], -float("inf"), dtype=tl.float32)
    kept_area = tl.full([BLOCK_K], float("inf"), dtype=tl.float32)
    count = zero
    position = zero

    # Box `position` and whether it is valid; the loop loads box `position + 1` one step ahead through next_box
    # and next_valid. Its validity is read only while the loop goes on, that is, while it is a box of the row.
    box = boxes_ptr + row * num_boxes * 4
    present = visit_end > 0
    x1 = tl.load(box, mask=present, other=0.0)
    y1 = tl.load(box + 1, mask=present, other=0.0)
    x2 = tl.load(box + 2, mask=present, other=0.0)
    y2 = tl.load(box + 3, mask=present, other=0.0)
    next_box = box + 4
    if HAS_VALID:
        next_valid = valid_ptr + row * num_boxes
        is_valid = tl.load(next_valid, mask=present, other=0) != 0
        next_valid += 1
    while (position < visit_end) & (count < max_kept):
        has_next = position < last_position
        next_x1 = tl.load(next_box, mask=has_next, other=0.0)
        next_y1 = tl.load(next_box + 1, mask=has_next, other=0.0)
        next_x2 = tl.load(next_box + 2, mask=has_next, other=0.0)
        next_y2 = tl.load(next_box + 3, mask=has_next, other=0.0)
        next_box += 4

        area = (x2 - x1) * (y2 - y1)
        width = tl.maximum(tl.minimum(kept_x2, x2) - tl.maximum(kept_x1, x1), 0.0)
        height = tl.maximum(tl.minimum(kept_y2, y2) - tl.maximum(kept_y1, y1), 0.0)
        inter = width * height
        union = kept_area + area - inter
        suppressed = tl.max((inter > iou_threshold * union).to(tl.int32), axis=0) != 0
        if HAS_VALID:
            keep = is_valid & ~suppressed
            is_valid = tl.load(next_valid, mask=has_next, other=0) != 0
            next_valid += 1
        else:
            keep = ~suppressed
        into_lane = keep & (lanes == count.to(tl.int32))  # count <= N: int32 lanes compare in half the instructions
        kept_x1 = tl.where(into_lane, x1, kept_x1)
        kept_y1 = tl.where(into_lane, y1, kept_y1)
        kept_x2 = tl.where(into_lane, x2, kept_x2)
        kept_y2 = tl.where(into_lane, y2, kept_y2)
        kept_area = tl.where(into_lane, area, kept_area)
        tl.store(row_kept + count, position, mask=keep)
        count += keep.to(tl.int64)
        position += 1
        x1, y1, x2, y2 = next_x1, next_y1, next_x2, next_y2

    # The fixed-shape output: -1 after the last kept box, BLOCK_K columns at a time (max_kept exceeds BLOCK_K
    # where it exceeds N). A while loop, since the interpreter cannot range() over a runtime bound.
    start = zero
    while start < max_kept:
        columns = start + lanes.to(tl.int64)
        tl.store(row_kept + columns, tl.full([BLOCK_K], -1, dtype=tl.int64),
                 mask=(columns >= count) & (columns < max_kept))
        start += BLOCK_K
    tl.store(count_ptr + row, count)
