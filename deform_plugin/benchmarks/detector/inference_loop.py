"""Batch-1 inference as users run it: ``inference_detector`` on images of mixed real sizes, timed per image.

Every row runs in a process of its own (``python inference_loop.py SPEC.json``; stock rows through
:mod:`deform_plugin.benchmarks.stock_process`), so that each pays the same process-level start (CUDA context,
library handles) in its first images: stock rows build mmdet and mmcv as installed and never import deform_plugin;
ours import it. This file imports torch, numpy and mmdet at the top, and
deform_plugin only inside :func:`build_row_model` for our rows. All rows get the same images (:func:`image_sizes`,
:func:`make_images`), the same weights and the same loop (:func:`time_inference`).

Size distributions (original image sizes; the config's test pipeline resizes them as it resizes any photo):

- ``coco16``: the 16 commonest COCO val2017 sizes, cycling;
- ``distinct``: every image a size of its own, sides drawn from 300-1333 px;
- ``fixed``: 480 x 640 only (a speed-up that holds only when sizes repeat: labelled as such).
"""
from __future__ import annotations

import json
import os
import random
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from deform_plugin.benchmarks.detector.inference_phases import caption_prompt, time_phases

# The 16 commonest (height, width) of COCO val2017, most frequent first.
COCO_COMMON_SIZES = ((480, 640), (427, 640), (640, 480), (425, 640), (424, 640), (640, 427), (426, 640), (428, 640),
                     (612, 612), (375, 500), (640, 640), (500, 375), (512, 640), (333, 500), (360, 640), (640, 424))
DISTRIBUTIONS = ("coco16", "distinct", "fixed")
TOP_K = 5  # detections kept per image for the comparison between rows


def image_sizes(distribution: str, count: int, seed: int = 0) -> List[Tuple[int, int]]:
    """``count`` image sizes (height, width) of ``distribution`` (see the module)."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    if distribution == "coco16":
        return [COCO_COMMON_SIZES[i % len(COCO_COMMON_SIZES)] for i in range(count)]
    if distribution == "fixed":
        return [COCO_COMMON_SIZES[0]] * count
    if distribution == "distinct":
        rng = random.Random(seed)
        sizes: List[Tuple[int, int]] = []
        while len(sizes) < count:
            size = (rng.randint(300, 1333), rng.randint(300, 1333))
            if size not in sizes:
                sizes.append(size)
        return sizes
    raise ValueError(f"unknown size distribution {distribution!r}; choose from {', '.join(DISTRIBUTIONS)}")


def make_images(sizes: Sequence[Tuple[int, int]], seed: int = 0) -> List[np.ndarray]:
    """One BGR uint8 image per size: smooth colour fields with a few rectangles (cheap to make, JPEG-like
    statistics do not matter to the timing)."""
    rng = np.random.default_rng(seed)
    images = []
    for height, width in sizes:
        base = rng.integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
        image = np.kron(base, np.ones((-(-height // 8), -(-width // 8), 1), dtype=np.uint8))[:height, :width]
        for _ in range(4):
            y, x = int(rng.integers(0, height // 2)), int(rng.integers(0, width // 2))
            image[y:y + height // 4, x:x + width // 4] = rng.integers(0, 256, size=3, dtype=np.uint8)
        images.append(np.ascontiguousarray(image))
    return images


def _top_detections(result, top_k: int = TOP_K) -> Dict[str, list]:
    instances = result.pred_instances
    # A NaN score sorts first (descending): the top detections show it.
    order = torch.argsort(instances.scores, descending=True)[:top_k]
    nonfinite = int((~torch.isfinite(instances.scores)).sum()) + int((~torch.isfinite(instances.bboxes)).sum())
    return dict(finite=nonfinite == 0, nonfinite=nonfinite, scores=instances.scores[order].float().cpu().tolist(),
                bboxes=instances.bboxes[order].float().cpu().tolist(),
                labels=instances.labels[order].cpu().tolist())


def poison_uninitialized_memory() -> None:
    """From now on every uninitialised tensor PyTorch allocates (``torch.empty``, kernels' outputs and scratch,
    in C++ too) is filled with NaN (integers with their largest value): PyTorch's ``fill_uninitialized_memory``,
    which works under deterministic algorithms, here with ``warn_only`` (operations without a deterministic
    implementation warn instead of failing; MSDA's backward, unused in inference, would take its sorted path).
    A value read before it is written then turns into NaN on every run instead of on some. Call it before the first
    CUDA call (cuBLAS reads its workspace setting when it starts)."""
    import os
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True


def _autocast(model, amp_dtype: Optional[str]):
    cuda = next(model.parameters()).device.type == "cuda"
    return torch.autocast("cuda", dtype=getattr(torch, amp_dtype or "float16"), enabled=bool(amp_dtype) and cuda)


def time_inference(model, images: Sequence[np.ndarray], amp_dtype: Optional[str] = None,
                   top_k: int = TOP_K, graph_inference=None, profile: Optional[Tuple[int, int]] = None) -> dict:
    """Each image through ``mmdet.apis.inference_detector`` (the device synchronised after each): the seconds per
    image, each image's ``top_k`` detections (and its count of non-finite scores and box coordinates) and the peak
    memory. With ``graph_inference`` (a ``GraphInference``), each image's call kind (:func:`call_kind`); with
    ``profile`` ``(first, last)``, torch.profiler's operator tables over those images (0-based, inclusive)."""
    from mmdet.apis import inference_detector
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    autocast = _autocast(model, amp_dtype)
    prompt = caption_prompt(model)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    seconds, detections, kinds = [], [], []
    profiler, tables = None, None
    with autocast:
        for index, image in enumerate(images):
            if profile is not None and index == profile[0]:
                from deform_plugin.benchmarks.detector.step_profiler import start_profiler
                profiler = start_profiler(cuda)
            before = graph_inference.stats() if graph_inference is not None else None
            started = time.perf_counter()
            result = inference_detector(model, image, **prompt)
            if cuda:
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - started)
            if before is not None:
                kinds.append(call_kind(before, graph_inference.stats()))
            if profiler is not None and index == profile[1]:
                tables = _profile_tables(profiler, cuda, profile)
                profiler = None
            detections.append(_top_detections(result, top_k))  # after the clock: reading detections back is ours
    if profiler is not None:  # the run ended before the profile's last image
        tables = _profile_tables(profiler, cuda, (profile[0], len(images) - 1))
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 20 if cuda else None
    return dict(seconds=seconds, detections=detections, peak_memory_mb=peak, call_kinds=kinds or None,
                profile=tables)


def call_kind(before: dict, after: dict) -> str:
    """What one graph-inference call did, from its ``stats()`` before and after: ``capture`` (a graph was made, of
    any part), ``borrow`` (it replayed a larger shape's graph), ``replay`` (every part replayed), ``partial`` (with
    feature buckets: the transformer replayed after the backbone ran eagerly at a size without a graph) or
    ``eager``."""
    backbone_before, backbone_after = before.get("backbone"), after.get("backbone")
    if after["graphs"] > before["graphs"] or (backbone_after and backbone_after["graphs"] > backbone_before["graphs"]):
        return "capture"
    if after["replays"] > before["replays"]:
        if backbone_after and backbone_after["replays"] == backbone_before["replays"]:
            return "partial"
        return "borrow" if after["borrowed_calls"] > before["borrowed_calls"] else "replay"
    return "eager"


def _profile_tables(profiler, cuda: bool, images: Tuple[int, int]) -> str:
    from deform_plugin.benchmarks.detector.step_profiler import operator_tables
    profiler.__exit__(None, None, None)
    by_host, by_device = operator_tables(profiler, cuda)
    text = f"images {images[0]}-{images[1]}, by self CPU time:\n{by_host}"
    return text if by_device is None else f"{text}\nby self device time:\n{by_device}"


def build_row_model(spec: dict):
    """The row's detector (``palette='coco'``: mmdet's init_detector would otherwise build the config's dataset to
    read its palette): stock mmdet (``row == 'stock'``: the config's deform_plugin import dropped, mmcv's own op),
    or ours with the plugin alone (``'eager'``) or with ``enable_fast_inference`` (``'graph'``: its default
    buckets: feature buckets for Deformable-DETR and DINO; ``'graph-image'``: 32 px image buckets for every
    detector; ``'graph-canvas'``: ``throughput_buckets``; ``'graph-exact'``: without buckets), with the policy and
    bucket settings of ``spec``."""
    row, device = spec["row"], spec["device"]
    if row == "stock":
        from deform_plugin.benchmarks.detector.stock_train import prepare_mmcv
        served_by = prepare_mmcv()
        print(f"inference_loop: stock mmdet, mmcv ops {served_by}", flush=True)
        from mmdet.apis import init_detector
        from mmengine.config import Config
        cfg = Config.fromfile(spec["config"], import_custom_modules=False)
        cfg.pop("custom_imports", None)
        if "language_model" in cfg.model:  # a grounding detector: the random text encoder may stand in for BERT
            import deform_plugin.benchmarks.detector.random_text_encoder_model  # noqa: F401  (registers it)
        return init_detector(cfg, spec["weights"], device=device, palette="coco"), {}
    import deform_plugin  # noqa: F401  (before mmdet: the mmcv-lite stand-in)
    from mmdet.apis import init_detector
    model = init_detector(spec["config"], spec["weights"], device=device, palette="coco")
    if row == "eager":
        return model, {}
    if row not in ("graph", "graph-image", "graph-canvas", "graph-exact"):
        raise ValueError(f"unknown row {row!r}; choose from stock, eager, graph, graph-image, graph-canvas, "
                         "graph-exact")
    from deform_plugin.apis import CapturePolicy, InferenceBuckets, enable_fast_inference, throughput_buckets
    from deform_plugin.cuda_graphs import DEFAULT_FEATURE_BUCKET_SIZE
    policy = CapturePolicy(**spec.get("policy", {}))
    buckets = None
    if row != "graph-exact":
        buckets = throughput_buckets(model) if row == "graph-canvas" else InferenceBuckets()
        buckets = InferenceBuckets(**dict(vars(buckets), **spec.get("buckets", {})))
    # 'graph': enable_fast_inference's default, feature buckets for the DETRs (the image buckets for the others).
    changed = enable_fast_inference(model, policy=policy, buckets=buckets,
                                    feature_bucket_size=DEFAULT_FEATURE_BUCKET_SIZE if row == "graph" else None)
    return model, changed


def child_main(argv: Sequence[str]) -> int:
    """One row in this process: ``inference_loop.py SPEC.json``, SPEC naming the row, config, weights, images and
    where the JSON result goes (optional: ``top_k`` detections kept per image, ``poison`` for
    :func:`poison_uninitialized_memory`, ``profile`` ``[first, last]`` images to profile)."""
    with open(argv[0]) as handle:
        spec = json.load(handle)
    if spec.get("poison"):
        poison_uninitialized_memory()
    started = time.perf_counter()
    model, changed = build_row_model(spec)
    build_seconds = time.perf_counter() - started
    sizes = image_sizes(spec["distribution"], spec["count"], spec["seed"])
    images = make_images(sizes, spec["seed"])
    graph_inference = changed.get("graph_inference")
    profile = tuple(spec["profile"]) if spec.get("profile") else None
    result = time_inference(model, images, spec.get("amp_dtype"), spec.get("top_k", TOP_K), graph_inference,
                            profile)
    if spec.get("phase_images"):
        # After the timed loop, on images whose sizes it has seen: the steady state's phases.
        with _autocast(model, spec.get("amp_dtype")):
            result["phases_ms"] = time_phases(model, images[-spec["phase_images"]:])
    if spec["row"] == "stock":
        from deform_plugin.benchmarks.stock_process import plugin_imported
        if plugin_imported():
            raise RuntimeError("the stock row imported deform_plugin: its numbers would not be stock mmdet/mmcv")
    # Read by PyTorch at the row's first convolution; the report names the API it selects.
    result.update(cudnn_v8_api_disabled=os.environ.get("TORCH_CUDNN_V8_API_DISABLED"))
    result.update(build_seconds=build_seconds, image_sizes=sizes,
                  graphs=graph_inference.stats() if graph_inference is not None else None)
    with open(spec["out"], "w") as handle:
        json.dump(result, handle)
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
