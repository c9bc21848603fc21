"""The exported graph's check: ONNX Runtime against PyTorch on one image (:func:`verify_onnx`), detections compared
rank by rank (:func:`compare_detections`, :class:`VerifyReport`)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch

from .export import INPUT_NAMES, ExportError, ExportModel, random_image

# Encoder logits of the proposals ONNX Runtime picks may differ from PyTorch's top-k by float32 rounding only.
PROPOSAL_ATOL = 1e-3


@dataclass
class VerifyReport:
    """ONNX Runtime against PyTorch on one image.

    Ranks are compared one to one; where ONNX Runtime's k-th detection differs from PyTorch's, it still counts as
    matched if PyTorch has the same (label, box) at a rank whose score is within ``score_atol`` (two near-equal
    scores may swap places under float32 rounding).

    Two-stage detectors rank the encoder's proposals by top-k first, and DINO pairs the i-th proposal with the i-th
    learned query, so two near-equal encoder scores that swap places change the detections. With random weights such
    near-ties are everywhere. PyTorch therefore runs with ONNX Runtime's proposal order, after checking that this
    order is a valid top-k of PyTorch's own scores (``proposal_score_max_abs``).
    """

    score_max_abs: float
    box_max_abs: float
    box_max_rel: float
    swapped_near_ties: int
    unmatched_ranks: List[int] = field(default_factory=list)
    box_rtol: float = 1e-3
    score_atol: float = 1e-4
    # Two-stage only: how many of the num_queries proposal positions ONNX Runtime ordered differently, and the largest
    # difference between PyTorch's encoder scores of ONNX Runtime's picks and PyTorch's own top-k (sorted).
    proposals_reordered: Optional[int] = None
    proposal_score_max_abs: Optional[float] = None
    proposal_atol: float = PROPOSAL_ATOL
    # Mask families: a box also matches within box_atol pixels (a mask-boundary pixel whose logit is within rounding
    # of 0 may flip and move the mask's box by one), and the smallest IoU of matched masks.
    box_atol: float = 0.0
    mask_min_iou: Optional[float] = None
    mask_iou_min: float = 0.99

    @property
    def passed(self) -> bool:
        # Matched ranks are within box_rtol (or box_atol) by construction.
        proposals_ok = self.proposal_score_max_abs is None or self.proposal_score_max_abs <= self.proposal_atol
        masks_ok = self.mask_min_iou is None or self.mask_min_iou >= self.mask_iou_min
        return not self.unmatched_ranks and self.score_max_abs <= self.score_atol and proposals_ok and masks_ok

    def lines(self) -> List[str]:
        lines = [
            f"scores: max abs error {self.score_max_abs:.3g} (limit {self.score_atol:g})",
            f"boxes:  max abs error {self.box_max_abs:.3g} px, max relative error {self.box_max_rel:.3g} "
            f"(limit {self.box_rtol:g}, relative to max(|coordinate|, 1 px)) over matched ranks",
            f"labels: {len(self.unmatched_ranks)} unmatched ranks"
            + (f" {self.unmatched_ranks[:10]}" if self.unmatched_ranks else "")
            + f", {self.swapped_near_ties} near-tie swaps",
        ]
        if self.mask_min_iou is not None:
            lines.append(f"masks:  smallest IoU of matched masks {self.mask_min_iou:.6f} (limit "
                         f"{self.mask_iou_min:g}); boxes also match within {self.box_atol:g} px")
        if self.proposals_reordered is not None:
            lines.append(f"two-stage proposals: ONNX Runtime's top-k is PyTorch's within "
                         f"{self.proposal_score_max_abs:.3g} (limit {self.proposal_atol:g}, encoder logits); "
                         f"{self.proposals_reordered} positions "
                         "ordered differently among near-equal scores (PyTorch reran with ONNX Runtime's order)")
        return lines


def _box_rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return ((a - b).abs() / b.abs().clamp(min=1.0)).amax(-1)


def compare_detections(got: Sequence[torch.Tensor], expected: Sequence[torch.Tensor], box_rtol: float = 1e-3,
                       score_atol: float = 1e-4, box_atol: float = 0.0) -> VerifyReport:
    """Compare ``(boxes, scores, labels[, masks])`` of one image (batch 1) as :class:`VerifyReport` describes."""
    boxes, scores, labels = (t[0] for t in got[:3])
    exp_boxes, exp_scores, exp_labels = (t[0] for t in expected[:3])

    def box_matches(box, others):
        return (_box_rel(box[None], others) <= box_rtol) | ((box[None] - others).abs().amax(-1) <= box_atol)

    score_err = float((scores - exp_scores).abs().max())
    unmatched, swaps, box_abs, box_rel = [], 0, 0.0, 0.0
    partner = {}  # rank -> the expected rank it matched
    for rank in range(len(scores)):
        if labels[rank] == exp_labels[rank] and bool(box_matches(boxes[rank], exp_boxes[rank][None])[0]):
            partner[rank] = rank
            box_abs = max(box_abs, float((boxes[rank] - exp_boxes[rank]).abs().max()))
            box_rel = max(box_rel, float(_box_rel(boxes[rank], exp_boxes[rank])))
            continue
        candidates = (((exp_scores - scores[rank]).abs() <= score_atol) & (exp_labels == labels[rank])).nonzero()
        candidates = candidates.flatten()
        close = candidates[box_matches(boxes[rank], exp_boxes[candidates])] if len(candidates) else candidates
        if len(close):
            swaps += 1
            partner[rank] = int(close[0])
            box_rel = max(box_rel, float(_box_rel(boxes[rank], exp_boxes[partner[rank]])))
        else:
            unmatched.append(rank)
    report = VerifyReport(score_err, box_abs, box_rel, swaps, unmatched, box_rtol, score_atol, box_atol=box_atol)
    if len(got) > 3:
        masks, exp_masks = got[3][0].bool(), expected[3][0].bool()
        ious = [_mask_iou(masks[rank], exp_masks[other]) for rank, other in partner.items()]
        report.mask_min_iou = min(ious) if ious else 1.0
    return report


def _mask_iou(a: torch.Tensor, b: torch.Tensor) -> float:
    union = int((a | b).sum())
    return 1.0 if union == 0 else int((a & b).sum()) / union


def _with_proposal_indices_output(graph) -> Optional[str]:
    """Expose the proposal top-k's indices as an extra graph output; return its name (None: no such top-k).

    The proposal top-k comes first in the graph's (topological) node order, the detections' top-k last.
    """
    import onnx

    topks = [node for node in graph.graph.node if node.op_type == "TopK"]
    if len(topks) < 2:
        return None
    name = topks[0].output[1]
    graph.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.INT64, None))
    return name


@contextlib.contextmanager
def _proposals_in_order(num_queries: int, indices: torch.Tensor, seen: list):
    """Make mmdet's proposal top-k (``torch.topk(scores (B, S), num_queries)`` in ``pre_decoder`` of DeformableDETR
    and DINO, mmdet 3.3) return ``indices``; record the scores and PyTorch's own top-k values in ``seen``."""
    original = torch.topk

    def topk(input, k, *args, **kwargs):
        values, own = original(input, k, *args, **kwargs)
        if k != num_queries or input.dim() != 2 or seen:
            return values, own
        seen.append((input, values))
        return torch.return_types.topk((input.gather(1, indices), indices))

    torch.topk = topk
    try:
        yield
    finally:
        torch.topk = original


def verify_onnx(path: str, model: ExportModel, image: Optional[torch.Tensor] = None, seed: int = 0,
                box_rtol: float = 1e-3, score_atol: float = 1e-4) -> VerifyReport:
    """Run ``path`` in ONNX Runtime (CPU) and ``model`` in PyTorch on ``image`` (random if None) and compare."""
    try:
        import onnx
        import onnxruntime
    except ImportError:
        raise ExportError("--verify needs onnx and onnxruntime: pip install onnx onnxruntime") from None
    if image is None:
        image = random_image(model.height, model.width, seed)
    detector = model.detector
    graph = onnx.load(path)
    proposals = _with_proposal_indices_output(graph) if getattr(detector, "as_two_stage", False) else None
    session = onnxruntime.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
    del graph
    outputs = list(model.output_names) + ([proposals] if proposals else [])
    got = [torch.from_numpy(t) for t in session.run(outputs, {INPUT_NAMES[0]: image.numpy()})]
    num_outputs = len(model.output_names)
    proposal_indices = got[num_outputs] if proposals else None
    if proposals and tuple(proposal_indices.shape) != (1, detector.num_queries):
        raise RuntimeError(f"the graph's first TopK gives {tuple(proposal_indices.shape)} indices, not the (1, "
                           f"{detector.num_queries}) proposals of mmdet 3.3's pre_decoder")
    seen: list = []
    order = (_proposals_in_order(detector.num_queries, proposal_indices, seen) if proposals
             else contextlib.nullcontext())
    with order, torch.no_grad():
        expected = model(image)
    report = compare_detections(got[:num_outputs], expected, box_rtol, score_atol, box_atol=model.box_atol)
    if proposals:
        if not seen:
            raise RuntimeError("the proposal top-k of the PyTorch model was not found (not mmdet 3.3's pre_decoder?)")
        scores, own_values = seen[0]
        picked = scores.gather(1, proposal_indices).sort(dim=1, descending=True).values
        report.proposal_score_max_abs = float((picked - own_values).abs().max())
        report.proposals_reordered = int((proposal_indices != scores.topk(detector.num_queries, dim=1).indices).sum())
    return report
