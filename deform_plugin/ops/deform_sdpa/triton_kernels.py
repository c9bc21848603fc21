"""Triton kernels of deformable scaled dot-product attention: bilinear sampling fused into a flash-style softmax.

One program handles one query (batch, view, head, pixel); pixels vary fastest over the programs. It walks the query's
``num_views * num_samples`` sampling points in blocks of ``BLOCK_T``, gathers the four bilinear corners of the keys
and values straight from the input maps, and keeps an online softmax, so the sampled keys and values never reach
global memory. The backward
recomputes the probabilities from the saved base-2 log-sum-exp and scatters key/value gradients to the four
corners with atomics. All arithmetic is float32 whatever the storage dtype. Addressing runs in INDEX_DTYPE: int32
where every tensor of the launch is small enough that no offset can overflow it (fewer registers and instructions
per gathered row), int64 otherwise.

Tensor arguments are contiguous; their shapes are commented at each pointer.
"""
from __future__ import annotations

import triton
import triton.language as tl

def tuning_configs():
    """The launch configurations autotuning tries (opt-in: see ``triton_launch.autotune_enabled``)."""
    # One warp per query keeps the reductions over a block's samples inside the warp (no shared-memory round
    # trip per block). An sm_90 compile of the fp32 forward with a real launch's alignment hints needs 75 registers
    # at BLOCK_T=8, 128 at 16 and 202 at 32, no spills.
    return [triton.Config({"BLOCK_T": block_t}, num_warps=warps)
            for block_t in (4, 8, 16, 32, 64) for warps in (1, 2, 4, 8)]


def _keep_moderate_tiles(configs, named_args, **kwargs):
    # 2 to 32 tile elements per thread: fewer starves the loads, more spills registers (see heuristic_block_t).
    block_d = {**named_args, **kwargs}["BLOCK_D"]
    kept = [config for config in configs
            if 2 <= config.kwargs["BLOCK_T"] * block_d / (32 * config.num_warps) <= 32]
    return kept or configs[:1]


@triton.jit
def _sum_of_products(a, b, mask, axis: tl.constexpr):
    """``tl.sum(a * b, axis)`` with each product rounded before the threads add them up (zero where ``mask`` is off).

    Left to itself the compiler fuses a thread's own product into the first cross-thread addition (an FMA: its own
    product unrounded, its partner's rounded), so the threads that each end up holding the sum hold values a few
    ulps apart; when the sum then moves to another layout through shared memory they write different values to the
    same word (a write-write race that compute-sanitizer racecheck reports; triton-lang/triton#7264). The select on
    ``mask``, a runtime value the compiler cannot fold, stands between the multiply and the addition. (MSDA's kernel
    file has the same function: the compile worker loads that file alone, so it imports nothing of the package.)
    """
    return tl.sum(tl.where(mask, a * b, 0.0), axis=axis)


@triton.jit
def _sample_geometry(coords_ptr, coord_offsets, sample_mask, width, height):
    """Bilinear setup of a block of samples: validity, top-left corner and fractional offsets in pixels."""
    x = tl.load(coords_ptr + coord_offsets, mask=sample_mask, other=0.0).to(tl.float32)
    y = tl.load(coords_ptr + coord_offsets + 1, mask=sample_mask, other=0.0).to(tl.float32)
    # NaN fails every comparison, so this also drops NaN and +-inf; huge finite points sample zero anyway.
    valid = sample_mask & (tl.abs(x) < 1e30) & (tl.abs(y) < 1e30)
    x = tl.where(valid, x, -1.0)
    y = tl.where(valid, y, -1.0)
    # The clamp keeps float->int conversion defined; it moves only points whose four corners are all outside.
    pixel_x = tl.minimum(tl.maximum(x * width - 0.5, -2.0), width + 1.0)
    pixel_y = tl.minimum(tl.maximum(y * height - 0.5, -2.0), height + 1.0)
    left = tl.floor(pixel_x)
    top = tl.floor(pixel_y)
    return valid, left.to(tl.int32), top.to(tl.int32), pixel_x - left, pixel_y - top


@triton.jit
def _corner_rows(plane, left, top, valid, width, height, head_dim):
    """Element offsets of the four bilinear corners' rows (top-left, top-right, bottom-left, bottom-right) and
    whether each lies in the map. Offsets of corners outside the map are out of range: their loads are masked."""
    column_0_in = (left >= 0) & (left < width)
    column_1_in = (left >= -1) & (left < width - 1)
    row_0_in = valid & (top >= 0) & (top < height)
    row_1_in = valid & (top >= -1) & (top < height - 1)
    # The corners are neighbours in the map: one multiply-add per sample, then additions.
    row_00 = (plane + top * width + left) * head_dim
    row_10 = row_00 + width * head_dim
    return (row_00, row_00 + head_dim, row_10, row_10 + head_dim,
            row_0_in & column_0_in, row_0_in & column_1_in, row_1_in & column_0_in, row_1_in & column_1_in)


@triton.jit
def _corner_weights(frac_x, frac_y):
    """The four corners' bilinear weights, in _corner_rows' order."""
    return (1.0 - frac_x) * (1.0 - frac_y), frac_x * (1.0 - frac_y), (1.0 - frac_x) * frac_y, frac_x * frac_y


@triton.jit
def _load_rows(ptr, rows, inside, offs_d, mask_d, EVEN_D: tl.constexpr):
    """A (BLOCK_T, BLOCK_D) float32 tile of the rows at element offsets ``rows``; rows outside the map read 0."""
    mask = inside[:, None] if EVEN_D else inside[:, None] & mask_d[None, :]
    return tl.load(ptr + rows[:, None] + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)


# The sizes that follow the image (pixels, width, height) are not specialised, so a new image size compiles nothing.
@triton.jit(do_not_specialize=["num_pixels", "width", "height"])
def deform_sdpa_forward_kernel(
    q_ptr,  # (B, V, H, N, D)
    k_ptr,  # (B, V, H, N, D)
    v_ptr,  # (B, V, H, N, D)
    coords_ptr,  # (B, V, N, V, S, 2) normalized (x, y)
    out_ptr,  # (B, V, H, N, D)
    lse_ptr,  # (B, V, H, N) float32: log2 of the softmax denominator of the base-2 scores
    qk_scale,  # sm_scale * log2(e): scores in base 2 so the softmax can use exp2
    num_views, num_heads, num_pixels, num_samples, width, height, head_dim,
    NUM_KEYS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    INDEX_DTYPE: tl.constexpr,
):
    # Programs run in (batch, head, view, pixel) order: those resident on the GPU at one time are queries of one
    # (batch, head), and every one of them samples the same num_views maps of that head, so their corner rows hit
    # in L1. In (batch, view, head, pixel) order a wave spans ~10 heads' maps and the forward took 11% longer.
    program = tl.program_id(0).to(INDEX_DTYPE)
    pixel = program % num_pixels
    batch_head_view = program // num_pixels
    query_view = batch_head_view % num_views
    batch_head = batch_head_view // num_views
    head = batch_head % num_heads
    batch = batch_head // num_heads
    batch_view = batch * num_views + query_view
    row = (batch_view * num_heads + head) * num_pixels + pixel  # flat (batch, view, head, pixel): q, out, lse
    query = batch_view * num_pixels + pixel  # flat (batch, view, pixel): the row of coords

    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    q = tl.load(q_ptr + row * head_dim + offs_d, mask=mask_d, other=0.0).to(tl.float32) * qk_scale

    running_max = tl.full([], float("-inf"), tl.float32)
    denominator = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)  # per sample slot of a block, summed at the end
    coord_base = query * NUM_KEYS * 2
    for key_start in range(0, NUM_KEYS, BLOCK_T):
        offs_t = key_start + tl.arange(0, BLOCK_T)
        mask_t = offs_t < NUM_KEYS
        valid, left, top, frac_x, frac_y = _sample_geometry(coords_ptr, coord_base + offs_t * 2, mask_t, width,
                                                            height)
        view = offs_t // num_samples
        plane = ((batch * num_views + view) * num_heads + head) * num_pixels  # first pixel of the sampled map
        row_00, row_01, row_10, row_11, in_00, in_01, in_10, in_11 = _corner_rows(plane, left, top, valid, width,
                                                                                  height, head_dim)
        w00, w01, w10, w11 = _corner_weights(frac_x, frac_y)
        # The sampled key is formed in registers (four multiply-adds per element) and the score is one reduction
        # over channels per sample; four per-corner dot products cost four cross-thread reductions.
        sampled_key = w00[:, None] * _load_rows(k_ptr, row_00, in_00, offs_d, mask_d, EVEN_D)
        sampled_key += w01[:, None] * _load_rows(k_ptr, row_01, in_01, offs_d, mask_d, EVEN_D)
        sampled_key += w10[:, None] * _load_rows(k_ptr, row_10, in_10, offs_d, mask_d, EVEN_D)
        sampled_key += w11[:, None] * _load_rows(k_ptr, row_11, in_11, offs_d, mask_d, EVEN_D)
        v00 = _load_rows(v_ptr, row_00, in_00, offs_d, mask_d, EVEN_D)
        v01 = _load_rows(v_ptr, row_01, in_01, offs_d, mask_d, EVEN_D)
        v10 = _load_rows(v_ptr, row_10, in_10, offs_d, mask_d, EVEN_D)
        v11 = _load_rows(v_ptr, row_11, in_11, offs_d, mask_d, EVEN_D)
        scores = _sum_of_products(sampled_key, q[None, :], mask_t[:, None] & mask_d[None, :], 1)
        scores = tl.where(mask_t, scores, float("-inf"))
        # Every block holds at least one real sample, so the new maximum is finite.
        new_max = tl.maximum(running_max, tl.max(scores, 0))
        rescale = tl.exp2(running_max - new_max)
        probs = tl.exp2(scores - new_max)
        denominator = denominator * rescale + tl.sum(probs, 0)
        # The values are weighted by probability x corner weight and summed over the block's samples only at the
        # end: no reduction across threads per block.
        acc = acc * rescale + ((probs * w00)[:, None] * v00 + (probs * w01)[:, None] * v01
                               + (probs * w10)[:, None] * v10 + (probs * w11)[:, None] * v11)
        running_max = new_max

    out = tl.sum(acc, 0) / denominator
    tl.store(out_ptr + row * head_dim + offs_d, out.to(out_ptr.dtype.element_ty), mask=mask_d)
    tl.store(lse_ptr + row, running_max + tl.log2(denominator))


@triton.jit
def _corner_backward_load(k_ptr, v_ptr, rows, inside, offs_d, mask_d, q, grad_out, EVEN_D: tl.constexpr):
    """One corner's key tile, ``q . k_corner`` and ``grad_out . v_corner``."""
    key = _load_rows(k_ptr, rows, inside, offs_d, mask_d, EVEN_D)
    value = _load_rows(v_ptr, rows, inside, offs_d, mask_d, EVEN_D)
    tile_mask = inside[:, None] & mask_d[None, :]
    return (key, _sum_of_products(key, q[None, :], tile_mask, 1),
            _sum_of_products(value, grad_out[None, :], tile_mask, 1))


@triton.jit
def _corner_backward_scatter(dk_ptr, dv_ptr, rows, inside, offs_d, mask_d, key_grad_scale, value_grad_scale, q,
                             grad_out, EVEN_D: tl.constexpr):
    """Add this corner's share of the sampled key/value gradients into dk and dv (float32 buffers)."""
    # With EVEN_D the row mask still takes the tile's shape (an AND with constant true, folded by the compiler):
    # the interpreter's atomic_add misreads a mask of another shape than its pointers.
    full_rows = tl.full((1, mask_d.shape[0]), 1, tl.int1)
    mask = inside[:, None] & (full_rows if EVEN_D else mask_d[None, :])
    offsets = rows[:, None] + offs_d[None, :]
    tl.atomic_add(dk_ptr + offsets, key_grad_scale[:, None] * q[None, :], mask=mask, sem="relaxed")
    tl.atomic_add(dv_ptr + offsets, value_grad_scale[:, None] * grad_out[None, :], mask=mask, sem="relaxed")


@triton.jit(do_not_specialize=["num_pixels", "width", "height"])
def deform_sdpa_backward_kernel(
    q_ptr,  # (B, V, H, N, D)
    k_ptr,  # (B, V, H, N, D)
    v_ptr,  # (B, V, H, N, D)
    coords_ptr,  # (B, V, N, V, S, 2)
    out_ptr,  # (B, V, H, N, D) forward output
    grad_out_ptr,  # (B, V, H, N, D)
    lse_ptr,  # (B, V, H, N) float32, from the forward
    dq_ptr,  # (B, V, H, N, D) in q's dtype, written once per query
    dk_ptr,  # (B, V, H, N, D) float32, zero-filled, accumulated atomically
    dv_ptr,  # (B, V, H, N, D) float32, zero-filled, accumulated atomically
    dcoords_ptr,  # (B, V, N, V, S, 2) float32, zero-filled, accumulated atomically over heads
    sm_scale, qk_scale,  # qk_scale = sm_scale * log2(e)
    num_views, num_heads, num_pixels, num_samples, width, height, head_dim,
    NUM_KEYS: tl.constexpr, COORDS_GRAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, INDEX_DTYPE: tl.constexpr,
):
    # (batch, view, head, pixel) order, not the forward's: programs of one head at once would add into the same
    # dk/dv rows together, and the backward measured 16% slower so (docs/deform_sdpa.md).
    row = tl.program_id(0).to(INDEX_DTYPE)  # flat (batch, view, head, pixel)
    pixel = row % num_pixels
    batch_view_head = row // num_pixels
    head = batch_view_head % num_heads
    batch_view = batch_view_head // num_heads
    batch = batch_view // num_views
    query = batch_view * num_pixels + pixel

    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    q = tl.load(q_ptr + row * head_dim + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    grad_out = tl.load(grad_out_ptr + row * head_dim + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    out = tl.load(out_ptr + row * head_dim + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    # d(loss)/d(score_t) = p_t * (grad_out . v_t - sum_t' p_t' grad_out . v_t'), and the sum is grad_out . out.
    delta = _sum_of_products(grad_out, out, mask_d, 0)
    lse = tl.load(lse_ptr + row)

    dq = tl.zeros([BLOCK_D], dtype=tl.float32)
    coord_base = query * NUM_KEYS * 2
    for key_start in range(0, NUM_KEYS, BLOCK_T):
        offs_t = key_start + tl.arange(0, BLOCK_T)
        mask_t = offs_t < NUM_KEYS
        valid, left, top, frac_x, frac_y = _sample_geometry(coords_ptr, coord_base + offs_t * 2, mask_t, width,
                                                            height)
        view = offs_t // num_samples
        plane = ((batch * num_views + view) * num_heads + head) * num_pixels

        row_00, row_01, row_10, row_11, in_00, in_01, in_10, in_11 = _corner_rows(plane, left, top, valid, width,
                                                                                  height, head_dim)
        w00, w01, w10, w11 = _corner_weights(frac_x, frac_y)
        k00, qk00, gv00 = _corner_backward_load(k_ptr, v_ptr, row_00, in_00, offs_d, mask_d, q, grad_out, EVEN_D)
        k01, qk01, gv01 = _corner_backward_load(k_ptr, v_ptr, row_01, in_01, offs_d, mask_d, q, grad_out, EVEN_D)
        k10, qk10, gv10 = _corner_backward_load(k_ptr, v_ptr, row_10, in_10, offs_d, mask_d, q, grad_out, EVEN_D)
        k11, qk11, gv11 = _corner_backward_load(k_ptr, v_ptr, row_11, in_11, offs_d, mask_d, q, grad_out, EVEN_D)
        scores = (w00 * qk00 + w01 * qk01 + w10 * qk10 + w11 * qk11) * qk_scale
        probs = tl.where(mask_t, tl.exp2(scores - lse), 0.0)
        grad_probs = w00 * gv00 + w01 * gv01 + w10 * gv10 + w11 * gv11
        grad_scores = probs * (grad_probs - delta) * sm_scale  # gradient of q . k_t before scaling

        sampled_key = (w00[:, None] * k00 + w01[:, None] * k01 + w10[:, None] * k10 + w11[:, None] * k11)
        dq += _sum_of_products(grad_scores[:, None], sampled_key, mask_t[:, None] & mask_d[None, :], 0)

        _corner_backward_scatter(dk_ptr, dv_ptr, row_00, in_00, offs_d, mask_d, grad_scores * w00, probs * w00, q,
                                 grad_out, EVEN_D)
        _corner_backward_scatter(dk_ptr, dv_ptr, row_01, in_01, offs_d, mask_d, grad_scores * w01, probs * w01, q,
                                 grad_out, EVEN_D)
        _corner_backward_scatter(dk_ptr, dv_ptr, row_10, in_10, offs_d, mask_d, grad_scores * w10, probs * w10, q,
                                 grad_out, EVEN_D)
        _corner_backward_scatter(dk_ptr, dv_ptr, row_11, in_11, offs_d, mask_d, grad_scores * w11, probs * w11, q,
                                 grad_out, EVEN_D)

        if COORDS_GRAD:
            # Gradient of the loss with respect to each corner's bilinear weight, then the chain rule through
            # w = (1 - fx or fx) * (1 - fy or fy), fx = x * width - 0.5 - floor(...).
            g00 = grad_scores * qk00 + probs * gv00
            g01 = grad_scores * qk01 + probs * gv01
            g10 = grad_scores * qk10 + probs * gv10
            g11 = grad_scores * qk11 + probs * gv11
            grad_x = ((g01 - g00) * (1.0 - frac_y) + (g11 - g10) * frac_y) * width
            grad_y = ((g10 - g00) * (1.0 - frac_x) + (g11 - g01) * frac_x) * height
            coord_offsets = coord_base + offs_t * 2
            tl.atomic_add(dcoords_ptr + coord_offsets, tl.where(valid, grad_x, 0.0), mask=mask_t, sem="relaxed")
            tl.atomic_add(dcoords_ptr + coord_offsets + 1, tl.where(valid, grad_y, 0.0), mask=mask_t,
                          sem="relaxed")

    tl.store(dq_ptr + row * head_dim + offs_d, dq.to(dq_ptr.dtype.element_ty), mask=mask_d)


deform_sdpa_forward_kernel_autotuned = triton.autotune(
    configs=tuning_configs(), key=["NUM_KEYS", "head_dim", "BLOCK_D", "EVEN_D", "INDEX_DTYPE"],
    prune_configs_by={"early_config_prune": _keep_moderate_tiles})(deform_sdpa_forward_kernel)
# The atomically accumulated buffers must be zeroed before each timed trial, or the trials add up.
deform_sdpa_backward_kernel_autotuned = triton.autotune(
    configs=tuning_configs(), key=["NUM_KEYS", "head_dim", "BLOCK_D", "COORDS_GRAD", "EVEN_D", "INDEX_DTYPE"],
    prune_configs_by={"early_config_prune": _keep_moderate_tiles},
    reset_to_zero=["dk_ptr", "dv_ptr", "dcoords_ptr"])(deform_sdpa_backward_kernel)
