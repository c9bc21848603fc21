"""Greedy NMS with fixed-shape outputs: the reference against a worked example and against mmcv's CPU NMS, the Triton
kernel against the reference exactly, and the input checks.

On a machine without CUDA the Triton kernel runs under the interpreter (TRITON_INTERPRET=1, set by conftest.py
before triton is imported) on small rows; with CUDA the same tests run on the GPU, and the path is also captured in
a CUDA graph.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from op_devices import DEVICE, HAS_CUDA, needs_triton

from deform_plugin.ops import greedy_nms_first_kept, greedy_nms_first_kept_reference

needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device: host syncs and graphs are CUDA concepts")
BACKENDS = ["pytorch", pytest.param("triton", marks=needs_triton)]


def random_boxes(batch, num_boxes, generator, extent=64.0):
    """``(batch, num_boxes, 4)`` float32 boxes of sides 4 to 32 in an ``extent`` square: many overlap."""
    corner = torch.rand(batch, num_boxes, 2, generator=generator) * extent
    size = 4.0 + torch.rand(batch, num_boxes, 2, generator=generator) * 28.0
    return torch.cat([corner, corner + size], -1)


def distinct_scores(batch, num_boxes, generator):
    """Scores in (0, 1], all different within a row (exact in float16 and bfloat16 too for rows up to 256)."""
    ranks = torch.stack([torch.randperm(num_boxes, generator=generator) for _ in range(batch)])
    return (ranks + 1).float() / num_boxes


def pairwise_inter(boxes):
    """``(B, N, N)`` float32 intersection areas, as the op computes them."""
    low = torch.maximum(boxes[:, :, None, :2], boxes[:, None, :, :2])
    high = torch.minimum(boxes[:, :, None, 2:], boxes[:, None, :, 2:])
    return (high - low).clamp_min(0).prod(-1)


def scores_with_ties_among_disjoint_boxes(boxes, generator):
    """Distinct scores, then pairs of boxes that do not intersect at all made to share a score.

    The op visits tied scores in index order on every device (a stable sort); pairs that do not intersect keep the
    test's expectation independent of that choice beyond the order they are listed in.
    """
    batch, num_boxes = boxes.shape[:2]
    scores = distinct_scores(batch, num_boxes, generator)
    disjoint = pairwise_inter(boxes) == 0
    for row in range(batch):
        unpaired = torch.ones(num_boxes, dtype=torch.bool)
        for first in range(num_boxes):
            partners = (disjoint[row, first] & unpaired).nonzero().squeeze(1)
            partners = partners[partners > first]
            if unpaired[first] and len(partners):
                scores[row, partners[0]] = scores[row, first]
                unpaired[first] = unpaired[partners[0]] = False
    assert scores.shape[1] < 4 or (scores[:, :, None] == scores[:, None, :]).sum() > batch * num_boxes
    return scores


def assert_same(actual, expected):
    kept, count = actual
    expected_kept, expected_count = expected
    assert kept.dtype == count.dtype == torch.int64
    assert torch.equal(count.cpu(), expected_count.cpu()), (count, expected_count)
    assert torch.equal(kept.cpu(), expected_kept.cpu()), (kept, expected_kept)


# ---- the specification on a worked example ------------------------------------------------------------------------

# Input order differs from score order, so the indices returned are checked to be the original ones.
#   0: C [10, 0, 20, 10] score 0.70     IoU(A, B) = IoU(B, C) = 50 / 150 = 1/3; A and C only touch (IoU 0)
#   1: F [30, 30, 40, 40] score 0.10    far from everything
#   2: A [0, 0, 10, 10]  score 0.90
#   3: E [10, 0, 20, 10] score 0.99     C's twin (IoU 1), the highest score, marked invalid in the masked example
#   4: B [5, 0, 15, 10]  score 0.80
WORKED_BOXES = torch.tensor([[[10., 0., 20., 10.], [30., 30., 40., 40.], [0., 0., 10., 10.], [10., 0., 20., 10.],
                              [5., 0., 15., 10.]]])
WORKED_SCORES = torch.tensor([[0.70, 0.10, 0.90, 0.99, 0.80]])
WORKED_VALID = torch.tensor([[True, True, True, False, True]])
WORKED_CASES = [
    # E invalid: it is skipped and suppresses nothing. A is kept and suppresses B (1/3 > 0.3). B would have
    # suppressed C, but B is gone, and A does not overlap C: C is kept, then F.
    pytest.param(WORKED_VALID, 5, [[2, 0, 1, -1, -1]], [3], id="chain-invalid-E"),
    # The same, stopped after two kept boxes.
    pytest.param(WORKED_VALID, 2, [[2, 0]], [2], id="chain-max-kept-2"),
    # E valid: E is kept first and suppresses its twin C and B (IoU 1/3); A only touches E, so it is kept.
    pytest.param(None, 5, [[3, 2, 1, -1, -1]], [3], id="all-valid"),
]


@pytest.mark.parametrize("valid, max_kept, expected_kept, expected_count", WORKED_CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_worked_example(backend, valid, max_kept, expected_kept, expected_count):
    to = dict(device=DEVICE)
    kept, count = greedy_nms_first_kept(WORKED_BOXES.to(**to), WORKED_SCORES.to(**to),
                                        None if valid is None else valid.to(**to), 0.3, max_kept, backend=backend)
    assert kept.tolist() == expected_kept
    assert count.tolist() == expected_count


def test_worked_example_at_threshold_a_half_keeps_the_overlapping_pair():
    # IoU 1/3 does not exceed 0.5, and E, C's twin, is invalid: A, B, C and F are all kept, in score order.
    kept, count = greedy_nms_first_kept_reference(WORKED_BOXES, WORKED_SCORES, WORKED_VALID, 0.5, 5)
    assert kept.tolist() == [[2, 4, 0, 1, -1]] and count.tolist() == [4]


# ---- the reference against mmcv's CPU NMS ---------------------------------------------------------------------------

def boxes_away_from_threshold(batch, num_boxes, iou_threshold, generator, margin=1e-6):
    """Random boxes none of whose pairs has an IoU within ``margin`` of the threshold (computed in float64 from the
    float32 boxes): there, ``inter > threshold * union`` and ``inter / union > threshold`` in float32 may disagree."""
    for _ in range(100):
        boxes = random_boxes(batch, num_boxes, generator)
        wide = boxes.double()
        inter = pairwise_inter(wide)
        area = (wide[..., 2] - wide[..., 0]) * (wide[..., 3] - wide[..., 1])
        iou = inter / (area[:, :, None] + area[:, None, :] - inter)
        # An IoU of exactly 0 (no intersection) agrees at threshold 0 too: both tests ask whether inter > 0.
        if not (((iou - iou_threshold).abs() < margin) & (inter > 0)).any():
            return boxes
    raise AssertionError(f"no boxes away from threshold {iou_threshold} in 100 draws")


@pytest.mark.parametrize("max_kept", [4, 200], ids=["max-kept-4", "max-kept-200"])
@pytest.mark.parametrize("masked", [False, True], ids=["all-valid", "masked"])
@pytest.mark.parametrize("iou_threshold", [0.0, 0.1, 0.3, 0.5, 0.7, 0.95])
def test_reference_matches_mmcv_cpu_nms(iou_threshold, masked, max_kept):
    from deform_plugin.integration.mmcv_lite import nms

    generator = torch.Generator().manual_seed(int(iou_threshold * 100) + 7 * masked)
    boxes = boxes_away_from_threshold(2, 80, iou_threshold, generator)
    scores = distinct_scores(2, 80, generator)
    valid = torch.rand(2, 80, generator=generator) < 0.6 if masked else None
    kept, count = greedy_nms_first_kept_reference(boxes, scores, valid, iou_threshold, max_kept)
    for row in range(2):
        # mmcv has no mask: run it on the valid boxes alone and map its indices back.
        candidates = valid[row].nonzero().squeeze(1) if masked else torch.arange(80)
        expected = candidates[nms(boxes[row, candidates], scores[row, candidates], iou_threshold)][:max_kept]
        assert count[row].item() == len(expected)
        assert kept[row, :len(expected)].tolist() == expected.tolist()
        assert (kept[row, len(expected):] == -1).all()


# ---- the Triton kernel against the reference ------------------------------------------------------------------------

MAX_KEPT_CASES = {"1": lambda n: 1, "5": lambda n: 5, "N": lambda n: n, "N+10": lambda n: n + 10}
KERNEL_CASES = [
    pytest.param(batch, num_boxes, max_kept_name, masked,
                 id=f"B{batch}-N{num_boxes}-K{max_kept_name}-{'masked' if masked else 'all-valid'}")
    for batch, num_boxes, max_kept_name, masked in itertools.product([1, 3], [1, 7, 33, 300], MAX_KEPT_CASES,
                                                                     [False, True])
    # The interpreter walks 900 steps for three all-valid rows of 300 kept boxes: one row shows the same.
    if not (batch == 3 and num_boxes == 300 and max_kept_name in ("N", "N+10") and not masked)
]


@needs_triton
@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("batch, num_boxes, max_kept_name, masked", KERNEL_CASES)
def test_triton_matches_reference(batch, num_boxes, max_kept_name, masked):
    max_kept = MAX_KEPT_CASES[max_kept_name](num_boxes)
    seed = batch * 1000 + num_boxes * 10 + masked
    generator = torch.Generator().manual_seed(seed)
    iou_threshold = (0.3, 0.5, 0.7)[seed % 3]
    boxes = random_boxes(batch, num_boxes, generator)
    scores = scores_with_ties_among_disjoint_boxes(boxes, generator)
    valid = None
    if masked:
        # Under half valid: the kernel stops after the last valid box, which keeps interpreter runs short.
        valid = torch.rand(batch, num_boxes, generator=generator) < 0.4
        if batch > 1:
            valid[1] = False  # a row with nothing to keep
    expected = greedy_nms_first_kept_reference(boxes, scores, valid, iou_threshold, max_kept)
    actual = greedy_nms_first_kept(boxes.to(DEVICE), scores.to(DEVICE), None if valid is None else valid.to(DEVICE),
                                   iou_threshold, max_kept, backend="triton")
    assert_same(actual, expected)
    if masked and batch > 1:
        assert expected[1][1] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_tied_scores_are_visited_in_index_order(backend):
    # 40 boxes of one score along a line, each overlapping its neighbours by a third (IoU 1/3 > 0.3): in index order
    # box 0 is kept and suppresses box 1, box 2 is kept and suppresses box 3, and so on.
    left = torch.arange(40, dtype=torch.float32) * 5.0
    boxes = torch.stack([left, torch.zeros(40), left + 10.0, torch.full((40,), 10.0)], -1)[None]
    scores = torch.full((1, 40), 0.5)
    kept, count = greedy_nms_first_kept(boxes.to(DEVICE), scores.to(DEVICE), None, 0.3, 40, backend=backend)
    assert count.tolist() == [20]
    assert kept[0, :20].tolist() == list(range(0, 40, 2)) and (kept[0, 20:] == -1).all()


@needs_triton
def test_triton_invalid_boxes_among_valid_ones_neither_kept_nor_suppressing():
    # Valid boxes scored -inf sort among the invalid ones (both have key -inf, visited in index order), so the kernel
    # meets invalid boxes before its last valid one. Box 2 (invalid) is box 0's twin; box 1 (invalid) overlaps box 4
    # (IoU 9/11) and is visited before it. The valid -inf boxes 3, 4 and 5 are disjoint from each other and from
    # box 0, so all three are kept.
    boxes = torch.tensor([[[0., 0., 10., 10.], [41., 0., 51., 10.], [0., 0., 10., 10.], [20., 0., 30., 10.],
                           [40., 0., 50., 10.], [60., 0., 70., 10.]]])
    scores = torch.tensor([[0.9, -float("inf"), 0.8, -float("inf"), -float("inf"), -float("inf")]])
    valid = torch.tensor([[True, False, False, True, True, True]])
    expected = greedy_nms_first_kept_reference(boxes, scores, valid, 0.5, 6)
    assert expected[1].tolist() == [4] and expected[0][0, :4].tolist() == [0, 3, 4, 5]
    actual = greedy_nms_first_kept(boxes.to(DEVICE), scores.to(DEVICE), valid.to(DEVICE), 0.5, 6, backend="triton")
    assert_same(actual, expected)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64],
                         ids=["fp16", "bf16", "fp64"])
def test_triton_matches_reference_in_every_dtype(dtype):
    generator = torch.Generator().manual_seed(5)
    boxes = random_boxes(2, 33, generator).to(dtype)
    scores = distinct_scores(2, 33, generator).to(dtype)
    valid = torch.rand(2, 33, generator=generator) < 0.7
    expected = greedy_nms_first_kept_reference(boxes, scores, valid, 0.5, 12)
    actual = greedy_nms_first_kept(boxes.to(DEVICE), scores.to(DEVICE), valid.to(DEVICE), 0.5, 12, backend="triton")
    assert_same(actual, expected)


@needs_triton
def test_triton_custom_op_passes_opcheck():
    from deform_plugin.ops.nms.triton_op import greedy_nms_first_kept_op

    generator = torch.Generator().manual_seed(3)
    boxes = random_boxes(2, 7, generator).to(DEVICE)
    scores = distinct_scores(2, 7, generator).to(DEVICE)
    valid = (torch.rand(2, 7, generator=generator) < 0.7).to(DEVICE)
    for args in ((boxes, scores, valid, 0.5, 4), (boxes, scores, None, 0.5, 9)):
        torch.library.opcheck(greedy_nms_first_kept_op, args,
                              test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


# ---- shapes at the edges, on every backend ---------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch, num_boxes", [(2, 0), (0, 5)], ids=["no-boxes", "no-rows"])
def test_empty_inputs_give_fixed_shape_outputs(backend, batch, num_boxes):
    boxes = torch.zeros(batch, num_boxes, 4, device=DEVICE)
    scores = torch.zeros(batch, num_boxes, device=DEVICE)
    kept, count = greedy_nms_first_kept(boxes, scores, None, 0.5, 3, backend=backend)
    assert kept.shape == (batch, 3) and (kept == -1).all() and kept.dtype == torch.int64
    assert count.shape == (batch,) and (count == 0).all() and count.dtype == torch.int64


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_invalid_rows_keep_nothing(backend):
    generator = torch.Generator().manual_seed(2)
    boxes = random_boxes(2, 9, generator).to(DEVICE)
    scores = distinct_scores(2, 9, generator).to(DEVICE)
    valid = torch.zeros(2, 9, dtype=torch.bool, device=DEVICE)
    kept, count = greedy_nms_first_kept(boxes, scores, valid, 0.5, 20, backend=backend)
    assert (kept == -1).all() and kept.shape == (2, 20) and (count == 0).all()


def test_auto_backend_runs_the_reference_off_cuda():
    from deform_plugin.ops.nms import functional

    assert functional.resolve_backend(functional.OP_NAME, "auto", torch.device("cpu")) == "pytorch"
    kept, count = greedy_nms_first_kept(WORKED_BOXES, WORKED_SCORES, WORKED_VALID, 0.3, 5, backend="auto")
    assert kept.tolist() == [[2, 0, 1, -1, -1]] and count.tolist() == [3]


# ---- on a GPU: no host synchronisation, and a CUDA graph replays it --------------------------------------------------

@needs_cuda
def test_triton_path_never_syncs_and_replays_in_a_cuda_graph():
    generator = torch.Generator().manual_seed(11)
    boxes = random_boxes(2, 2000, generator, extent=400.0).cuda()
    scores = distinct_scores(2, 2000, generator).cuda()
    valid = (torch.rand(2, 2000, generator=generator) < 0.8).cuda()
    expected = greedy_nms_first_kept_reference(boxes, scores, valid, 0.6, 300)
    greedy_nms_first_kept(boxes, scores, valid, 0.6, 300, backend="triton")  # compile outside the checks
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = greedy_nms_first_kept(boxes, scores, valid, 0.6, 300, backend="triton")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_same(eager, expected)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = greedy_nms_first_kept(boxes, scores, valid, 0.6, 300, backend="triton")
    scores.copy_(distinct_scores(2, 2000, generator).cuda())
    graph.replay()
    assert_same(captured, greedy_nms_first_kept_reference(boxes, scores, valid, 0.6, 300))


# ---- bad inputs ------------------------------------------------------------------------------------------------------

def _good_arguments():
    return dict(boxes=torch.zeros(2, 5, 4), scores=torch.zeros(2, 5), valid=torch.ones(2, 5, dtype=torch.bool),
                iou_threshold=0.5, max_kept=3)


BAD_INPUTS = [
    pytest.param(dict(boxes=torch.zeros(5, 4)), ValueError, r"boxes must be \(batch, num_boxes, 4\).*\(5, 4\)",
                 id="boxes-rank"),
    pytest.param(dict(boxes=torch.zeros(2, 5, 5)), ValueError, r"boxes must be .*\(2, 5, 5\)", id="boxes-last-dim"),
    pytest.param(dict(boxes=torch.zeros(2, 5, 4, dtype=torch.int64)), TypeError,
                 "boxes must be a floating tensor .*torch.int64", id="boxes-dtype"),
    pytest.param(dict(boxes=[[0, 0, 1, 1]]), TypeError, "boxes must be a torch.Tensor, got list", id="boxes-list"),
    pytest.param(dict(scores=torch.zeros(2, 6)), ValueError, r"scores must be \(batch, num_boxes\) = \(2, 5\).*"
                 r"\(2, 6\)", id="scores-shape"),
    pytest.param(dict(scores=torch.zeros(2, 5, dtype=torch.int32)), TypeError,
                 "scores must be a floating tensor .*torch.int32", id="scores-dtype"),
    pytest.param(dict(valid=torch.ones(2, 5, dtype=torch.uint8)), TypeError, "valid must be a bool tensor.*uint8",
                 id="valid-dtype"),
    pytest.param(dict(valid=torch.ones(2, 4, dtype=torch.bool)), ValueError, r"valid must be .*\(2, 4\)",
                 id="valid-shape"),
    pytest.param(dict(scores=torch.zeros(2, 5, device="meta")), ValueError,
                 "must be on one device.*scores on meta", id="devices"),
    pytest.param(dict(max_kept=0), ValueError, "max_kept must be >= 1, got 0", id="max-kept-0"),
    pytest.param(dict(max_kept=2.0), TypeError, r"max_kept must be an integer, got float \(2.0\)",
                 id="max-kept-float"),
    pytest.param(dict(max_kept=True), TypeError, r"max_kept must be an integer, got bool", id="max-kept-bool"),
    pytest.param(dict(iou_threshold=float("nan")), ValueError, r"iou_threshold must be a finite number in \[0, 1\], "
                 "got nan", id="threshold-nan"),
    pytest.param(dict(iou_threshold=float("inf")), ValueError, "iou_threshold .*got inf", id="threshold-inf"),
    pytest.param(dict(iou_threshold=1.5), ValueError, r"iou_threshold must be .*\[0, 1\], got 1.5",
                 id="threshold-above-1"),
    pytest.param(dict(iou_threshold=-0.1), ValueError, "iou_threshold .*got -0.1", id="threshold-negative"),
    pytest.param(dict(iou_threshold=torch.tensor(0.5)), TypeError, "iou_threshold must be a real number .*Tensor",
                 id="threshold-tensor"),
    pytest.param(dict(iou_threshold="0.5"), TypeError, r"iou_threshold must be a real number.*str \('0.5'\)",
                 id="threshold-str"),
]


@pytest.mark.parametrize("changes, error, message", BAD_INPUTS)
@pytest.mark.parametrize("backend", ["pytorch", "triton"])
def test_bad_inputs_name_the_argument_and_value(backend, changes, error, message):
    # The checks run before the backend is resolved to a device, so they hold for 'triton' on any machine.
    arguments = {**_good_arguments(), **changes}
    with pytest.raises(error, match=message):
        greedy_nms_first_kept(**arguments, backend=backend)


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match="greedy_nms has no backend 'mmcv'"):
        greedy_nms_first_kept(**_good_arguments(), backend="mmcv")
