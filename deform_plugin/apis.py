"""Inference helpers for detectors that run deform_plugin's attention (on top of mmdet's ``init_detector``).

Example::

    import deform_plugin  # before mmdet where mmcv-lite is installed
    from mmdet.apis import inference_detector, init_detector
    from deform_plugin.apis import enable_fast_inference

    model = init_detector('configs/dino/dino-4scale_r50_8xb2-12e_coco_deform-plugin.py', 'dino.pth', device='cuda')
    enable_fast_inference(model)
    result = inference_detector(model, 'demo.jpg')   # images of any size: graphs reused through buckets

The same works on ``DetInferencer(...).model``.
"""
from __future__ import annotations

from typing import Dict, Optional

from .cpu_threads import GPU_INFERENCE_CPU_THREADS, cap_threads_for_gpu_inference, check_thread_limit
from .cuda_graphs import DEFAULT_FEATURE_BUCKET_SIZE, CapturePolicy, InferenceBuckets, check_feature_bucket_size
from .cuda_graphs.policy import feature_bucket_size_or_alias
from .integration.mmdet_fast_paths import apply_fast_paths
from .integration.mmdet_fast_paths.ddq_distinct_queries import enable_sync_free_distinct_queries
from .integration.mmdet_fast_paths.ddq_nms import has_ddq_nms
from .integration.mmdet_feature_bucket_inference import enable_feature_bucket_inference, supports_feature_buckets
from .integration.mmdet_graph_inference import GraphInference, enable_graph_inference, throughput_buckets

__all__ = ["CapturePolicy", "GraphInference", "InferenceBuckets", "enable_fast_inference", "throughput_buckets"]


def enable_fast_inference(model, policy: Optional[CapturePolicy] = None, buckets: Optional[InferenceBuckets] = ...,
                          cpu_threads: Optional[int] = GPU_INFERENCE_CPU_THREADS,
                          cudnn_v7_api: Optional[bool] = None, feature_bucket_size: Optional[int] = ...,
                          feature_buckets: Optional[int] = ...) -> Dict[str, object]:
    """Make ``model`` (an mmdet DETR-family detector, Grounding-DINO included, or a MaskFormer, in eval mode) infer at
    graph speed on CUDA.

    Turns on the fast paths that keep a forward free of host syncs (``sync_free_forward``), the SDPA attention
    bricks and, for DDQ-DETR, its NMS in float32 (``float32_nms``: it runs under autocast; a no-op in float32) and
    its distinct queries selected on the device with fixed shapes (``'sync_free_distinct_queries'``, so that its
    decoder is replayed with the rest), then replays each input shape's forward from a CUDA graph
    (:class:`GraphInference`): inputs are padded to ``buckets`` (default: 32 px steps, borrowing a captured shape of
    at most 15% more pixels; None: no padding; :func:`throughput_buckets` for sizes that rarely repeat, with more
    padding), a shape is captured once it recurs, and shapes beyond the ``policy``'s caps run eagerly (default:
    captured at the second call, at most 16 graphs). On a CPU the model runs as before. Deformable-DETR and DINO pad
    their feature maps instead of the image by default (``feature_bucket_size``).

    For a model on the GPU, torch's CPU threads are lowered to ``cpu_threads`` (default 4; None keeps them;
    ``OMP_NUM_THREADS``, where set, wins): with one thread per core, torch's idle OpenMP workers spin on the cores
    that the test pipeline and the host side of each call need (:mod:`deform_plugin.cpu_threads` has the figures).
    This is a setting of the whole process, and it is logged.

    ``cudnn_v7_api`` (None, the default: on for a model on the GPU) selects cuDNN's v7 convolution API for the
    process (:mod:`deform_plugin.conv_planning`): each new input size's eager call and capture plan the
    convolutions far more cheaply, for replays about 1 ms slower on an H200 (docs/results.md has both). PyTorch
    reads the setting at the process's first convolution, so it takes effect where none has run yet, as after
    ``init_detector``; a ``TORCH_CUDNN_V8_API_DISABLED`` the user set wins. False keeps PyTorch's choice (for a
    stream of one input size).

    ``feature_bucket_size`` (pixels; Deformable-DETR and DINO): instead of padding the image, run the backbone and neck
    at the input's own size (from a graph once the size recurs) and pad the feature maps to buckets of this many
    pixels before the transformer's graphs (:mod:`deform_plugin.integration.mmdet_feature_bucket_inference`): the
    detections are the unpadded input's, and sizes that never repeat still replay the transformer. Other detectors
    keep ``buckets``. Default: 128 where ``buckets`` is left at its default, else None (``buckets`` for every
    detector); None: image buckets for every detector. ``feature_buckets`` is the same setting's deprecated name
    (a ``DeprecationWarning``; passing both is a ValueError).

    Returns what changed; its ``'graph_inference'`` entry's ``stats()`` reports graphs, replays, eager calls and
    the graphs' memory, ``'cpu_threads'`` the thread count set (absent where none was) and ``'cudnn_v7_api'``
    whether the v7 API is selected (absent where this call left it alone).
    """
    check_thread_limit(cpu_threads)
    feature_bucket_size = feature_bucket_size_or_alias("enable_fast_inference", feature_bucket_size, feature_buckets)
    if feature_bucket_size is ...:
        feature_bucket_size = DEFAULT_FEATURE_BUCKET_SIZE if buckets is ... else None
    check_feature_bucket_size("enable_fast_inference", "feature_bucket_size", feature_bucket_size)
    if cudnn_v7_api not in (None, True, False):
        raise ValueError(f"enable_fast_inference: cudnn_v7_api must be None, True or False, got {cudnn_v7_api!r}")
    model.eval()
    # float32_nms only where there is a DDQ-DETR NMS to change: elsewhere it would log that it changes nothing.
    ddq = has_ddq_nms(model)
    changed: Dict[str, object] = dict(apply_fast_paths(model, sdpa_attention=True, sync_free_forward=True,
                                                       float32_nms=ddq))
    if ddq:
        # DDQ-DETR's distinct queries selected on the device: its whole forward becomes one graph region.
        changed["sync_free_distinct_queries"] = enable_sync_free_distinct_queries(model)
    if feature_bucket_size is not None and supports_feature_buckets(model):
        changed["graph_inference"] = enable_feature_bucket_inference(model, policy=policy,
                                                                     feature_bucket_size=feature_bucket_size)
    else:
        changed["graph_inference"] = enable_graph_inference(model, policy=policy, buckets=buckets)
    on_gpu = any(parameter.is_cuda for parameter in model.parameters())
    from mmengine.logging import print_log
    if cudnn_v7_api or (cudnn_v7_api is None and on_gpu):
        from .conv_planning import prefer_cudnn_v7_api, selected_api_line
        changed["cudnn_v7_api"] = prefer_cudnn_v7_api()
        print_log(f"deform_plugin: {selected_api_line()} (enable_fast_inference(cudnn_v7_api=False) keeps "
                  "PyTorch's choice)", logger="current")
    if on_gpu:
        import torch
        before = torch.get_num_threads()
        if cap_threads_for_gpu_inference(cpu_threads) is not None:
            changed["cpu_threads"] = cpu_threads
            print_log(f"deform_plugin: torch CPU threads {before} -> {cpu_threads} for GPU inference (idle OpenMP "
                      "workers spin on the cores the test pipeline needs; enable_fast_inference(cpu_threads=None) "
                      "keeps them)", logger="current")
    return changed
