"""Triton kernels of multi-scale deformable attention (forward, backward, deterministic grad_value reduction).

One program handles BLOCK_Q queries of one (image, head): it walks the levels and points, gathers the four corner
rows of ``head_dim`` channels per sample as a [BLOCK_Q, BLOCK_D] tile, and accumulates in float32 (float64 for
float64 storage) whatever the storage dtype. Coordinates are always computed in float32 or wider.

With FUSED the kernels take the module's raw predictions instead of locations and weights: reference points plus
offsets give the locations (mmcv's arithmetic, 2-d points or 4-d boxes), and the softmax over levels x points of the
raw logits gives the weights, so neither intermediate tensor exists in memory.

Index arithmetic runs in INDEX_DTYPE: int32 where every tensor of the launch is small enough that no offset can
overflow it (fewer registers and instructions, so more programs per SM), int64 otherwise (tensors may exceed 2^31
elements).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _sum_of_products(a, b, mask, axis: tl.constexpr):
    """``tl.sum(a * b, axis)`` with each product rounded before the threads add them up (zero where ``mask`` is off).

    Left to itself the compiler fuses a thread's own product into the first cross-thread addition (an FMA: its own
    product unrounded, its partner's rounded), so the threads that each end up holding the sum hold values a few
    ulps apart; when the sum then moves to another layout through shared memory they write different values to the
    same word (a write-write race that compute-sanitizer racecheck reports; triton-lang/triton#7264). The select on
    ``mask``, a runtime value the compiler cannot fold, stands between the multiply and the addition.
    """
    return tl.sum(tl.where(mask, a * b, 0.0), axis=axis)


@triton.jit
def _softmax_stats(logit_ptr, sample_base, q_mask,
                   NUM_LP: tl.constexpr, BLOCK_LP: tl.constexpr, ACC_DTYPE: tl.constexpr):
    # The L*P logits of one (query, head) are contiguous: one [BLOCK_Q, BLOCK_LP] tile gives max and sum at once.
    cols = tl.arange(0, BLOCK_LP)
    col_mask = cols < NUM_LP
    logits = tl.load(logit_ptr + sample_base[:, None] + cols[None, :],
                     mask=q_mask[:, None] & col_mask[None, :], other=float("-inf")).to(ACC_DTYPE)
    row_max = tl.max(logits, axis=1)
    # Masked-out rows are all -inf; keep their statistics finite so no NaN is born there.
    row_max = tl.where(q_mask, row_max, 0.0)
    exp_logits = tl.where(col_mask[None, :], tl.exp(logits - row_max[:, None]), 0.0)
    row_sum = tl.sum(exp_logits, axis=1)
    row_sum = tl.where(q_mask, row_sum, 1.0)
    # One division per query; each sample's weight is then exp(logit - max) * inv_sum.
    return row_max, 1.0 / row_sum


@triton.jit
def _level_reference(ref_ptr, ref_offset, level_h, level_w, q_mask,
                     FUSED: tl.constexpr, REF_DIM: tl.constexpr, NUM_POINTS: tl.constexpr, ACC_DTYPE: tl.constexpr):
    # FUSED: a level's reference point and the factors that turn a raw offset into a normalized location (mmcv:
    # ref + offset / (w, h) for points; ref + offset / P * (box w, h) * 0.5 for boxes), loaded once per level
    # rather than per point. A multiplication by a reciprocal differs from mmcv's division by at most one rounding.
    if FUSED:
        ref_x = tl.load(ref_ptr + ref_offset, mask=q_mask, other=0.0).to(ACC_DTYPE)
        ref_y = tl.load(ref_ptr + ref_offset + 1, mask=q_mask, other=0.0).to(ACC_DTYPE)
        if REF_DIM == 2:
            scale_x = tl.zeros_like(ref_x) + 1.0 / level_w
            scale_y = tl.zeros_like(ref_y) + 1.0 / level_h
        else:
            scale_x = tl.load(ref_ptr + ref_offset + 2, mask=q_mask, other=0.0).to(ACC_DTYPE) * (0.5 / NUM_POINTS)
            scale_y = tl.load(ref_ptr + ref_offset + 3, mask=q_mask, other=0.0).to(ACC_DTYPE) * (0.5 / NUM_POINTS)
    else:
        ref_x = tl.zeros_like(q_mask.to(ACC_DTYPE))
        ref_y = ref_x
        scale_x = ref_x
        scale_y = ref_x
    return ref_x, ref_y, scale_x, scale_y


@triton.jit
def _sample_location(loc_ptr, loc_offset, ref_x, ref_y, scale_x, scale_y, q_mask,
                     FUSED: tl.constexpr, ACC_DTYPE: tl.constexpr):
    # Returns the normalized location (x, y), plus the raw offsets (FUSED) that the backward needs.
    raw_x = tl.load(loc_ptr + loc_offset, mask=q_mask, other=0.0).to(ACC_DTYPE)
    raw_y = tl.load(loc_ptr + loc_offset + 1, mask=q_mask, other=0.0).to(ACC_DTYPE)
    if FUSED:
        loc_x = ref_x + raw_x * scale_x
        loc_y = ref_y + raw_y * scale_y
    else:
        loc_x = raw_x
        loc_y = raw_y
    return loc_x, loc_y, raw_x, raw_y


@triton.jit
def _pixel_coordinates(loc_x, loc_y, level_h, level_w):
    # pixel = x * w - 0.5 (mmcv). A sample is taken only inside (-1, w) x (-1, h) (mmcv's rule; false for NaN and
    # inf too): at pixel -1 exactly the one in-map corner has weight 0, and 0 * inf there would be NaN. Untaken
    # samples are parked at -2, where all four corners are outside, so the float -> int conversion stays defined.
    pixel_x = loc_x * level_w - 0.5
    pixel_y = loc_y * level_h - 0.5
    taken = (pixel_x > -1.0) & (pixel_x < level_w) & (pixel_y > -1.0) & (pixel_y < level_h)
    pixel_x = tl.where(taken, pixel_x, -2.0)
    pixel_y = tl.where(taken, pixel_y, -2.0)
    x0f = tl.floor(pixel_x)
    y0f = tl.floor(pixel_y)
    return taken, pixel_x - x0f, pixel_y - y0f, x0f.to(tl.int32), y0f.to(tl.int32)


@triton.jit
def _forward_level(acc, level, value_ptr, shapes_ptr, starts_ptr, loc_ptr, weight_ptr, ref_ptr, value_base,
                   row_stride, sample_base, batch, num_queries, query, q_mask, channel, tile_mask, row_max, inv_sum,
                   NUM_LEVELS: tl.constexpr, NUM_POINTS: tl.constexpr, REF_DIM: tl.constexpr, FUSED: tl.constexpr,
                   ACC_DTYPE: tl.constexpr, INDEX_DTYPE: tl.constexpr):
    # All points of one level: 4 corner gathers of [BLOCK_Q, BLOCK_D] per point, accumulated into acc.
    level_h = tl.load(shapes_ptr + 2 * level).to(tl.int32)
    level_w = tl.load(shapes_ptr + 2 * level + 1).to(tl.int32)
    level_start = tl.load(starts_ptr + level).to(INDEX_DTYPE)
    level_hf = level_h.to(ACC_DTYPE)
    level_wf = level_w.to(ACC_DTYPE)
    ref_offset = ((batch * num_queries + query) * NUM_LEVELS + level) * REF_DIM
    ref_x, ref_y, scale_x, scale_y = _level_reference(ref_ptr, ref_offset, level_hf, level_wf, q_mask, FUSED,
                                                      REF_DIM, NUM_POINTS, ACC_DTYPE)
    for point in tl.static_range(NUM_POINTS):
        sample = sample_base + level * NUM_POINTS + point
        loc_x, loc_y, _, _ = _sample_location(loc_ptr, sample * 2, ref_x, ref_y, scale_x, scale_y, q_mask, FUSED,
                                              ACC_DTYPE)
        weight = tl.load(weight_ptr + sample, mask=q_mask, other=0.0).to(ACC_DTYPE)
        if FUSED:
            weight = tl.exp(weight - row_max) * inv_sum
        taken, frac_x, frac_y, x0, y0 = _pixel_coordinates(loc_x, loc_y, level_hf, level_wf)
        for corner in tl.static_range(4):
            dx = corner % 2
            dy = corner // 2
            cx = x0 + dx
            cy = y0 + dy
            inside = taken & (cx >= 0) & (cx < level_w) & (cy >= 0) & (cy < level_h)
            wx = frac_x if dx == 1 else 1.0 - frac_x
            wy = frac_y if dy == 1 else 1.0 - frac_y
            key = level_start + (cy * level_w + cx).to(INDEX_DTYPE)
            rows = tl.load(value_ptr + value_base + key[:, None] * row_stride + channel[None, :],
                           mask=tile_mask & inside[:, None], other=0.0).to(ACC_DTYPE)
            acc += (weight * wx * wy)[:, None] * rows
    return acc


# The sizes that follow the image (keys, queries) are not specialised: Triton would otherwise compile a variant per
# value class (divisible by 16, equal to 1), and a training run on randomly resized images meets every class.
@triton.jit(do_not_specialize=["num_keys", "num_queries"])
def msda_forward_kernel(
    value_ptr,        # (B, S, H, D)
    shapes_ptr,       # (L, 2) integer (h, w)
    starts_ptr,       # (L,) integer offset of each level in S
    loc_ptr,          # (B, Q, H, L, P, 2) normalized locations; the sampling offsets when FUSED
    weight_ptr,       # (B, Q, H, L, P) attention weights; the attention logits when FUSED
    ref_ptr,          # (B, Q, L, REF_DIM) reference points (FUSED only)
    out_ptr,          # (B, Q, H, D)
    num_keys, num_queries, num_heads, head_dim,
    NUM_LEVELS: tl.constexpr, NUM_POINTS: tl.constexpr, REF_DIM: tl.constexpr, FUSED: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_LP: tl.constexpr, ACC_DTYPE: tl.constexpr,
    INDEX_DTYPE: tl.constexpr,
):
    pid_q = tl.program_id(0).to(INDEX_DTYPE)
    head = tl.program_id(1).to(INDEX_DTYPE)
    batch = tl.program_id(2).to(INDEX_DTYPE)
    NUM_LP: tl.constexpr = NUM_LEVELS * NUM_POINTS

    query = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_mask = query < num_queries
    channel = tl.arange(0, BLOCK_D)
    tile_mask = q_mask[:, None] & (channel < head_dim)[None, :]
    row_stride = num_heads * head_dim                        # elements between two keys of value
    value_base = batch * num_keys * row_stride + head * head_dim
    query_row = (batch * num_queries + query) * num_heads + head   # (b, q, h) row of out / weights
    sample_base = query_row * NUM_LP

    if FUSED:
        row_max, inv_sum = _softmax_stats(weight_ptr, sample_base, q_mask, NUM_LP, BLOCK_LP, ACC_DTYPE)
    else:
        row_max = tl.zeros((BLOCK_Q,), dtype=ACC_DTYPE)
        inv_sum = tl.zeros((BLOCK_Q,), dtype=ACC_DTYPE)

    acc = tl.zeros((BLOCK_Q, BLOCK_D), dtype=ACC_DTYPE)
    # A run-time level loop: unrolling it (tl.static_range) measured 4-9% slower on an H200 (docs/kernels.md).
    for level in range(NUM_LEVELS):
        acc = _forward_level(acc, level, value_ptr, shapes_ptr, starts_ptr, loc_ptr, weight_ptr, ref_ptr,
                             value_base, row_stride, sample_base, batch, num_queries, query, q_mask, channel,
                             tile_mask, row_max, inv_sum, NUM_LEVELS, NUM_POINTS, REF_DIM, FUSED, ACC_DTYPE,
                             INDEX_DTYPE)
    out_offset = query_row[:, None] * head_dim + channel[None, :]
    tl.store(out_ptr + out_offset, acc.to(out_ptr.dtype.element_ty), mask=tile_mask)


@triton.jit(do_not_specialize=["num_keys", "num_queries"])
def msda_backward_kernel(
    grad_out_ptr,     # (B, Q, H, D)
    value_ptr,        # (B, S, H, D)
    shapes_ptr,       # (L, 2)
    starts_ptr,       # (L,)
    loc_ptr,          # (B, Q, H, L, P, 2) locations; the sampling offsets when FUSED
    weight_ptr,       # (B, Q, H, L, P) weights; the attention logits when FUSED
    ref_ptr,          # (B, Q, L, REF_DIM) (FUSED only)
    grad_value_ptr,   # (B, S, H, D) float32/float64, accumulated atomically (not DETERMINISTIC)
    grad_loc_ptr,     # (B, Q, H, L, P, 2) grad of locations; of the sampling offsets when FUSED
    grad_weight_ptr,  # (B, Q, H, L, P) grad of weights; of the attention logits when FUSED
    grad_ref_ptr,     # (B, Q, H, L, REF_DIM) float32/float64 per-head grad of reference points (REF_GRAD only)
    entry_key_ptr,    # (B*Q*H*L*P*4,) int64 grad_value row of each corner, -1 if none (DETERMINISTIC only)
    entry_coef_ptr,   # (B*Q*H*L*P*4,) float coefficient of grad_out in that row (DETERMINISTIC only)
    weight_scratch_ptr,  # (B, H, L*P, Q) float32/float64 per-sample weight gradients, queries fastest (FUSED only)
    offset_scratch_ptr,  # (B, H, L*P, 2, Q) per-sample offset gradients in grad_loc's dtype, queries fastest (FUSED)
    num_keys, num_queries, num_heads, head_dim,
    NUM_LEVELS: tl.constexpr, NUM_POINTS: tl.constexpr, REF_DIM: tl.constexpr, FUSED: tl.constexpr,
    DETERMINISTIC: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_LP: tl.constexpr, ACC_DTYPE: tl.constexpr,
    INDEX_DTYPE: tl.constexpr,
    REF_GRAD: tl.constexpr,  # FUSED only: whether the reference points need a gradient (else nothing is stored)
):
    pid_q = tl.program_id(0).to(INDEX_DTYPE)
    head = tl.program_id(1).to(INDEX_DTYPE)
    batch = tl.program_id(2).to(INDEX_DTYPE)
    NUM_LP: tl.constexpr = NUM_LEVELS * NUM_POINTS

    query = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    q_mask = query < num_queries
    channel = tl.arange(0, BLOCK_D)
    tile_mask = q_mask[:, None] & (channel < head_dim)[None, :]
    row_stride = num_heads * head_dim
    value_base = batch * num_keys * row_stride + head * head_dim
    query_row = (batch * num_queries + query) * num_heads + head
    sample_base = query_row * NUM_LP
    grad_out = tl.load(grad_out_ptr + query_row[:, None] * head_dim + channel[None, :],
                       mask=tile_mask, other=0.0).to(ACC_DTYPE)

    if FUSED:
        row_max, inv_sum = _softmax_stats(weight_ptr, sample_base, q_mask, NUM_LP, BLOCK_LP, ACC_DTYPE)

    for level in range(NUM_LEVELS):
        level_h = tl.load(shapes_ptr + 2 * level).to(tl.int32)
        level_w = tl.load(shapes_ptr + 2 * level + 1).to(tl.int32)
        level_start = tl.load(starts_ptr + level).to(INDEX_DTYPE)
        level_hf = level_h.to(ACC_DTYPE)
        level_wf = level_w.to(ACC_DTYPE)
        ref_offset = ((batch * num_queries + query) * NUM_LEVELS + level) * REF_DIM
        ref_x, ref_y, scale_x, scale_y = _level_reference(ref_ptr, ref_offset, level_hf, level_wf, q_mask, FUSED,
                                                          REF_DIM, NUM_POINTS, ACC_DTYPE)
        if REF_GRAD:
            grad_ref_x = tl.zeros((BLOCK_Q,), dtype=ACC_DTYPE)
            grad_ref_y = tl.zeros((BLOCK_Q,), dtype=ACC_DTYPE)
            grad_box_w = tl.zeros((BLOCK_Q,), dtype=ACC_DTYPE)
            grad_box_h = tl.zeros((BLOCK_Q,), dtype=ACC_DTYPE)
        for point in tl.static_range(NUM_POINTS):
            sample = sample_base + level * NUM_POINTS + point
            loc_x, loc_y, raw_x, raw_y = _sample_location(loc_ptr, sample * 2, ref_x, ref_y, scale_x, scale_y,
                                                          q_mask, FUSED, ACC_DTYPE)
            weight = tl.load(weight_ptr + sample, mask=q_mask, other=0.0).to(ACC_DTYPE)
            if FUSED:
                weight = tl.exp(weight - row_max) * inv_sum
            taken, frac_x, frac_y, x0, y0 = _pixel_coordinates(loc_x, loc_y, level_hf, level_wf)
            # The weight gradient and the two bilinear derivatives are linear in the corner rows. The fused kernel
            # contracts each row with grad_out as it arrives (one [BLOCK_Q] dot per corner, no [BLOCK_Q, BLOCK_D]
            # accumulator live across corners): with its softmax and reference-point work it is register-bound,
            # and fewer registers let an SM hold more programs. The plain kernel accumulates the rows and
            # contracts three tiles per sample: per-corner dots lengthen each sample's dependent chain, which made
            # decoder-sized calls (few programs, latency-bound) ~20 us slower on an H200 and encoder-sized ones no
            # faster (docs/kernels.md).
            if FUSED:
                grad_weight = tl.zeros((BLOCK_Q,), dtype=ACC_DTYPE)
                grad_frac_x = tl.zeros((BLOCK_Q,), dtype=ACC_DTYPE)
                grad_frac_y = tl.zeros((BLOCK_Q,), dtype=ACC_DTYPE)
            else:
                sampled = tl.zeros((BLOCK_Q, BLOCK_D), dtype=ACC_DTYPE)
                d_frac_x = tl.zeros((BLOCK_Q, BLOCK_D), dtype=ACC_DTYPE)
                d_frac_y = tl.zeros((BLOCK_Q, BLOCK_D), dtype=ACC_DTYPE)
            for corner in tl.static_range(4):
                dx = corner % 2
                dy = corner // 2
                cx = x0 + dx
                cy = y0 + dy
                inside = taken & (cx >= 0) & (cx < level_w) & (cy >= 0) & (cy < level_h)
                wx = frac_x if dx == 1 else 1.0 - frac_x
                wy = frac_y if dy == 1 else 1.0 - frac_y
                sign_x = 1.0 if dx == 1 else -1.0
                sign_y = 1.0 if dy == 1 else -1.0
                key = level_start + (cy * level_w + cx).to(INDEX_DTYPE)
                row_offset = value_base + key[:, None] * row_stride + channel[None, :]
                corner_mask = tile_mask & inside[:, None]
                rows = tl.load(value_ptr + row_offset, mask=corner_mask, other=0.0).to(ACC_DTYPE)
                if FUSED:
                    dot = _sum_of_products(grad_out, rows, corner_mask, 1)
                    grad_weight += (wx * wy) * dot
                    grad_frac_x += (sign_x * wy) * dot
                    grad_frac_y += (sign_y * wx) * dot
                else:
                    sampled += (wx * wy)[:, None] * rows
                    d_frac_x += (sign_x * wy)[:, None] * rows
                    d_frac_y += (sign_y * wx)[:, None] * rows
                coef = weight * wx * wy
                if DETERMINISTIC:
                    entry = sample * 4 + corner
                    value_row = (batch * num_keys + key) * num_heads + head
                    tl.store(entry_key_ptr + entry, tl.where(inside, value_row, -1), mask=q_mask)
                    tl.store(entry_coef_ptr + entry, coef, mask=q_mask)
                else:
                    tl.atomic_add(grad_value_ptr + row_offset, coef[:, None] * grad_out, mask=corner_mask,
                                  sem="relaxed")
            if not FUSED:
                grad_weight = _sum_of_products(grad_out, sampled, tile_mask, 1)
                grad_frac_x = _sum_of_products(grad_out, d_frac_x, tile_mask, 1)
                grad_frac_y = _sum_of_products(grad_out, d_frac_y, tile_mask, 1)
            # Chain rule through pixel = loc * size - 0.5; zero where the sample was not taken.
            grad_pixel_x = tl.where(taken, weight * grad_frac_x, 0.0)
            grad_pixel_y = tl.where(taken, weight * grad_frac_y, 0.0)
            grad_loc_x = grad_pixel_x * level_wf
            grad_loc_y = grad_pixel_y * level_hf
            if FUSED:
                if REF_DIM == 2:
                    # loc = ref + offset / size, so d loc / d offset * d pixel / d loc = 1.
                    grad_raw_x = grad_pixel_x
                    grad_raw_y = grad_pixel_y
                else:
                    grad_raw_x = grad_loc_x * scale_x
                    grad_raw_y = grad_loc_y * scale_y
                    if REF_GRAD:
                        grad_box_w += grad_loc_x * raw_x * (0.5 / NUM_POINTS)
                        grad_box_h += grad_loc_y * raw_y * (0.5 / NUM_POINTS)
                if REF_GRAD:
                    grad_ref_x += grad_loc_x
                    grad_ref_y += grad_loc_y
            else:
                grad_raw_x = grad_loc_x
                grad_raw_y = grad_loc_y
            if FUSED:
                # The softmax backward below needs all L*P weight gradients of a query. They wait in scratch
                # laid out queries fastest, where a sample's [BLOCK_Q] store fills whole sectors; the offsets'
                # gradients wait there too and leave with them as one contiguous run per query. Stored in the
                # outputs' layout, each [BLOCK_Q] store would put a few bytes into BLOCK_Q sectors: L2
                # operations, in a kernel that the L2's throughput bounds (grad_value's reductions).
                lp_row = (batch * num_heads + head) * NUM_LP + level * NUM_POINTS + point
                tl.store(weight_scratch_ptr + lp_row * num_queries + query, grad_weight, mask=q_mask)
                tl.store(offset_scratch_ptr + (lp_row * 2) * num_queries + query, grad_raw_x, mask=q_mask)
                tl.store(offset_scratch_ptr + (lp_row * 2 + 1) * num_queries + query, grad_raw_y, mask=q_mask)
            else:
                # x and y in one 8-byte store per query: half the partially written sectors of two stores.
                xy = tl.arange(0, 2)
                tl.store(grad_loc_ptr + sample[:, None] * 2 + xy[None, :], tl.join(grad_raw_x, grad_raw_y),
                         mask=q_mask[:, None] & (xy < 2)[None, :])
                tl.store(grad_weight_ptr + sample, grad_weight, mask=q_mask)
        if REF_GRAD:
            grad_ref_offset = (query_row * NUM_LEVELS + level) * REF_DIM
            tl.store(grad_ref_ptr + grad_ref_offset, grad_ref_x, mask=q_mask)
            tl.store(grad_ref_ptr + grad_ref_offset + 1, grad_ref_y, mask=q_mask)
            if REF_DIM == 4:
                tl.store(grad_ref_ptr + grad_ref_offset + 2, grad_box_w, mask=q_mask)
                tl.store(grad_ref_ptr + grad_ref_offset + 3, grad_box_h, mask=q_mask)
    if FUSED:
        # Softmax backward, d logit_j = w_j * (g_j - sum_k w_k g_k), on the query's L*P weight gradients, back from
        # scratch as one [BLOCK_Q, BLOCK_LP] tile once every thread of the program has stored its own (they do not
        # stay live in registers through the gather loop).
        tl.debug_barrier()
        lp_cols = tl.arange(0, BLOCK_LP)
        lp_mask = q_mask[:, None] & (lp_cols < NUM_LP)[None, :]
        lp_rows = (batch * num_heads + head) * NUM_LP + lp_cols[None, :]
        grad_weights = tl.load(weight_scratch_ptr + lp_rows * num_queries + query[:, None], mask=lp_mask,
                               other=0.0).to(ACC_DTYPE)
        lp_offset = sample_base[:, None] + lp_cols[None, :]
        logits = tl.load(weight_ptr + lp_offset, mask=lp_mask, other=float("-inf")).to(ACC_DTYPE)
        weights = tl.exp(logits - row_max[:, None]) * inv_sum[:, None]
        weighted_sum = _sum_of_products(weights, grad_weights, lp_mask, 1)
        tl.store(grad_weight_ptr + lp_offset, weights * (grad_weights - weighted_sum[:, None]), mask=lp_mask)
        grad_x = tl.load(offset_scratch_ptr + (lp_rows * 2) * num_queries + query[:, None], mask=lp_mask, other=0.0)
        grad_y = tl.load(offset_scratch_ptr + (lp_rows * 2 + 1) * num_queries + query[:, None], mask=lp_mask,
                         other=0.0)
        # (x, y) pairs in the offsets' layout: one contiguous run of 2 * L * P values per query.
        grad_xy = tl.reshape(tl.join(grad_x, grad_y), (BLOCK_Q, 2 * BLOCK_LP))
        xy_cols = tl.arange(0, 2 * BLOCK_LP)
        tl.store(grad_loc_ptr + sample_base[:, None] * 2 + xy_cols[None, :], grad_xy,
                 mask=q_mask[:, None] & (xy_cols < 2 * NUM_LP)[None, :])


@triton.jit
def msda_grad_value_segments_kernel(
    grad_out_ptr,     # (B, Q, H, D)
    order_ptr,        # (E,) int64 entries sorted by grad_value row (stable: ties keep entry order)
    bounds_ptr,       # (R + 1,) int64 first sorted position of each grad_value row
    entry_coef_ptr,   # (E,) coefficient of each entry
    grad_value_ptr,   # (R, D) = (B, S, H, D)
    head_dim, entries_per_query_row,
    BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, ACC_DTYPE: tl.constexpr,
):
    # One program per grad_value row, summing its entries in a fixed order: bit-identical from run to run.
    row = tl.program_id(0).to(tl.int64)
    channel = tl.arange(0, BLOCK_D)
    channel_mask = channel < head_dim
    begin = tl.load(bounds_ptr + row)
    end = tl.load(bounds_ptr + row + 1)
    acc = tl.zeros((BLOCK_D,), dtype=ACC_DTYPE)
    # A while loop rather than range(begin, end): the interpreter cannot iterate over loaded bounds.
    chunk = begin
    while chunk < end:
        position = chunk + tl.arange(0, BLOCK_E)
        entry_mask = position < end
        entry = tl.load(order_ptr + position, mask=entry_mask, other=0)
        coef = tl.load(entry_coef_ptr + entry, mask=entry_mask, other=0.0).to(ACC_DTYPE)
        query_row = entry // entries_per_query_row
        grad_out = tl.load(grad_out_ptr + query_row[:, None] * head_dim + channel[None, :],
                           mask=entry_mask[:, None] & channel_mask[None, :], other=0.0).to(ACC_DTYPE)
        acc += _sum_of_products(coef[:, None], grad_out, entry_mask[:, None] & channel_mask[None, :], 0)
        chunk += BLOCK_E
    tl.store(grad_value_ptr + row * head_dim + channel, acc.to(grad_value_ptr.dtype.element_ty), mask=channel_mask)
