"""The detector targets: a small DINO's captured training steps and its graph inference, against eager runs.

The detector is the repository's DINO config (``configs/dino``) shrunk so that a step takes a fraction of a second
natively and seconds under a sanitizer: a ResNet-18, two encoder and two decoder layers, 50 queries; the attention
itself (8 heads of 32 channels, 4 levels, 4 points) is the real one, so the same kernel variants run.

- ``graph-train``: ``apply_fast_paths(cuda_graphs=True)`` with a shape captured at its first call once the kind is
  warmed up; four steps on one padded shape (the eager warm-up, the capture and its replay, two replays, the last
  with other image sizes inside the padding), each against an eager model on the same weights (sync-free forward,
  the same kernels, dropout off).
- ``graph-infer``: ``enable_fast_inference`` as shipped (DINO: the backbone at each input's own size, captured at
  its second call; the feature maps padded to a 128 px feature bucket, whose transformer graph is captured at its
  first call once the kind warmed up); four predictions in one feature bucket (eager, captured and replayed,
  replayed, replayed for another image size), each against the same detector's eager predict on the unpadded
  input (the feature buckets' detections are the unpadded ones).

Both run CUDA graphs, so the caching allocator must stay on: under compute-sanitizer, memcheck and initcheck then
miss accesses that stay inside a pooled block (see :mod:`.run`).
"""
from __future__ import annotations

import copy
from typing import List, Sequence, Tuple

import torch

from deform_plugin.benchmarks.common import REPO_ROOT, init_weights_quietly

from .kernel_cases import Check

DINO_CONFIG = REPO_ROOT / "configs" / "dino" / "dino-4scale_r50_8xb2-12e_coco_deform-plugin.py"
AMP = {"fp32": None, "bf16": torch.bfloat16}
# Relative loss and gradient-norm limits against the eager step (fp32: accumulation order of atomics only).
TRAIN_LIMITS = {"fp32": (1e-4, 1e-3), "bf16": (2e-2, 5e-2)}
# Largest difference of the top scores, and of their boxes in pixels, against eager inference at the same bucket.
INFER_LIMITS = {"fp32": (1e-4, 1e-2), "bf16": (2e-2, 2.0)}
TOP_SCORES = 20
# Training: one padded shape (odd sides), images of other sizes inside it at the last step.
TRAIN_SHAPE = (131, 173)
TRAIN_IMAGE_SIZES = (((131, 173), (117, 150)), ((131, 173), (117, 150)), ((131, 173), (117, 150)),
                     ((125, 160), (131, 141)))
# Inference: batch 1, two image sizes of one 32-px bucket (128 x 160).
INFER_IMAGE_SIZES = ((117, 151), (117, 151), (117, 151), (101, 139))


def small_dino(device, dtype=torch.float32, training: bool = True):
    """The repository's DINO config shrunk (see the module), initialised with seed 0, on ``device``."""
    from mmdet.registry import MODELS
    from mmdet.utils import register_all_modules
    from mmengine.config import Config

    import deform_plugin  # noqa: F401  (registers our module; the mmcv-lite stand-in)
    register_all_modules()
    cfg = Config.fromfile(str(DINO_CONFIG))
    model_cfg = cfg.model
    model_cfg.backbone.depth = 18
    model_cfg.backbone.init_cfg = None  # no download
    model_cfg.neck.in_channels = [128, 256, 512]
    model_cfg.num_queries = 50
    model_cfg.encoder.num_layers = 2
    model_cfg.decoder.num_layers = 2
    torch.manual_seed(0)
    model = MODELS.build(model_cfg)
    init_weights_quietly(model)  # level_embed is uninitialised memory until then
    for module in model.modules():  # replays draw other dropout numbers than eager runs
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model.to(device=device, dtype=dtype).train(training)


def detection_batch(padded: Tuple[int, int], sizes: Sequence[Tuple[int, int]], device, seed: int = 0,
                    num_gts: Sequence[int] = (3, 5)):
    """Normalised float inputs ``(len(sizes), 3, *padded)`` (zero padding) and their DetDataSamples with random
    ground-truth boxes inside each image."""
    from mmdet.structures import DetDataSample
    from mmengine.structures import InstanceData
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.zeros(len(sizes), 3, *padded)
    samples = []
    for index, (height, width) in enumerate(sizes):
        inputs[index, :, :height, :width] = torch.randn(3, height, width, generator=generator)
        sample = DetDataSample(metainfo=dict(img_shape=(height, width), ori_shape=(height, width),
                                             batch_input_shape=padded, pad_shape=padded, scale_factor=(1.0, 1.0)))
        count = num_gts[index % len(num_gts)]
        centre = torch.rand(count, 2, generator=generator) * 0.6 + 0.2
        half = torch.rand(count, 2, generator=generator) * 0.15 + 0.05
        boxes = torch.cat([centre - half, centre + half], 1) * torch.tensor([width, height, width, height])
        sample.gt_instances = InstanceData(bboxes=boxes.to(device),
                                           labels=torch.randint(0, 80, (count,), generator=generator).to(device))
        samples.append(sample)
    return inputs.to(device), samples


def _relative(actual: float, expected: float) -> float:
    return abs(actual - expected) / max(abs(expected), 1e-30) if actual == actual else float("inf")


def graph_training_checks(dtype_name: str, device) -> List[Check]:
    from deform_plugin.cuda_graphs import CapturePolicy
    from deform_plugin.integration.mmdet_fast_paths import apply_fast_paths

    amp = AMP[dtype_name]
    loss_limit, grad_limit = TRAIN_LIMITS[dtype_name]
    eager = small_dino(device)
    apply_fast_paths(eager, sync_free_forward=True)
    graphed = copy.deepcopy(eager)
    apply_fast_paths(graphed, cuda_graphs=True, capture_policy=CapturePolicy(capture_after=1))
    checks: List[Check] = []
    for step, sizes in enumerate(TRAIN_IMAGE_SIZES):
        inputs, samples = detection_batch(TRAIN_SHAPE, sizes, device, seed=step)
        results = []
        for model in (eager, graphed):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(step)  # DINO's denoising queries are random
            with torch.autocast("cuda", dtype=amp or torch.float32, enabled=amp is not None):
                losses = model.loss(inputs, copy.deepcopy(samples))
            total = sum(value.sum() for value in losses.values() if isinstance(value, torch.Tensor))
            total.backward()
            results.append((float(total), [p.grad.detach().clone() for p in model.parameters()
                                           if p.grad is not None]))
        (eager_total, eager_grads), (graph_total, graph_grads) = results
        checks.append(Check(f"step {step} loss", _relative(graph_total, eager_total), loss_limit))
        finite = all(bool(torch.isfinite(g).all()) for g in graph_grads) and len(graph_grads) == len(eager_grads)
        difference = sum(float((g - e).double().norm() ** 2) for g, e in zip(graph_grads, eager_grads)) ** 0.5
        norm = sum(float(e.double().norm() ** 2) for e in eager_grads) ** 0.5
        checks.append(Check(f"step {step} gradients", difference / max(norm, 1e-30) if finite else float("inf"),
                            grad_limit))
    region = graphed.graphed_training_region
    # Step 0 is the eager warm-up; step 1 captures and replays; steps 2 and 3 replay. (A CPU runs no graphs.)
    expected = (3, 1) if torch.device(device).type == "cuda" else (0, 0)
    checks.append(Check(f"replays {region.replays}, graphs {len(region.captured)} (expected {expected[0]}, "
                        f"{expected[1]})", 0.0 if (region.replays, len(region.captured)) == expected else
                        float("inf"), 0.0))
    return checks


def _ranked(sample) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """Every detection of ``sample``, highest score first, and its count of non-finite scores and coordinates."""
    instances = sample.pred_instances
    scores, bboxes = instances.scores.float(), instances.bboxes.float()
    nonfinite = int((~torch.isfinite(scores)).sum() + (~torch.isfinite(bboxes)).sum())
    order = torch.argsort(scores, descending=True)
    return scores[order].cpu(), bboxes[order].cpu(), nonfinite


def farthest_top_box(boxes: torch.Tensor, reference_scores: torch.Tensor, reference_boxes: torch.Tensor,
                     top: int, score_limit: float) -> float:
    """How far (px, largest coordinate difference) the farthest of the first ``top`` of ``boxes`` lies from its
    nearest reference box, among the reference detections that could be in a top ``top`` within ``score_limit``:
    those scoring at least the reference's ``top``-th score less ``score_limit``. Detections whose scores are
    tied to within the tolerance may swap places across the cut-off; a box that moved may not. Both sets are
    ordered by score, highest first."""
    if len(reference_scores) == 0:
        return 0.0 if len(boxes) == 0 else float("inf")
    cut = reference_scores[min(top, len(reference_scores)) - 1] - score_limit
    candidates = reference_boxes[reference_scores >= cut]
    return (boxes[:top, None] - candidates[None]).abs().amax(-1).amin(1).max().item() if len(boxes) else 0.0


def graph_inference_checks(dtype_name: str, device) -> List[Check]:
    from deform_plugin.apis import enable_fast_inference
    from deform_plugin.integration.mmdet_fast_paths import apply_fast_paths

    amp = AMP[dtype_name]
    score_limit, box_limit = INFER_LIMITS[dtype_name]
    detector = small_dino(device, training=False)
    reference = copy.deepcopy(detector)
    apply_fast_paths(reference, sdpa_attention=True, sync_free_forward=True)  # enable_fast_inference's paths
    graph_inference = enable_fast_inference(detector)["graph_inference"]
    checks: List[Check] = []
    for call, size in enumerate(INFER_IMAGE_SIZES):
        inputs, samples = detection_batch(size, [size], device, seed=10 + call % 3)
        tops = []
        with torch.no_grad(), torch.autocast("cuda", dtype=amp or torch.float32, enabled=amp is not None):
            for model in (reference, detector):
                tops.append(_ranked(model.predict(inputs, copy.deepcopy(samples))[0]))
        (ref_scores, ref_boxes, _), (scores, boxes, nonfinite) = tops
        checks.append(Check(f"call {call} ({size[0]}x{size[1]}) non-finite scores and boxes: {nonfinite}",
                            float(nonfinite), 0.0))
        score_diff = ((scores[:TOP_SCORES] - ref_scores[:TOP_SCORES]).abs().max().item() if nonfinite == 0
                      else float("inf"))
        checks.append(Check(f"call {call} top-{TOP_SCORES} scores max abs diff", score_diff, score_limit))
        box_diff = (farthest_top_box(boxes, ref_scores, ref_boxes, TOP_SCORES, score_limit) if nonfinite == 0
                    else float("inf"))
        checks.append(Check(f"call {call} top-{TOP_SCORES} boxes: farthest from a reference box within the score "
                            "tolerance of the top (px)", box_diff, box_limit))
    stats = graph_inference.stats()
    # The transformer's graph: call 0 runs eagerly (the kind's warm-up), call 1 captures and replays, calls 2 and 3
    # replay. (A CPU: none.)
    expected = (1, 3) if torch.device(device).type == "cuda" else (0, 0)
    checks.append(Check(f"graphs {stats['graphs']}, replays {stats['replays']} (expected {expected[0]}, "
                        f"{expected[1]})", 0.0 if (stats["graphs"], stats["replays"]) == expected else float("inf"),
                        0.0))
    return checks
