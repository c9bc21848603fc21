"""Inference helpers for detectors that run deform_plugin's attention (on top of mmdet's ``init_detector``).

Example::

    import deform_plugin  # before mmdet where mmcv-lite is installed
    from mmdet.apis import inference_detector, init_detector
    from deform_plugin.apis import enable_fast_inference

    model = init_detector('configs/dino/dino-4scale_r50_8xb2-12e_coco_deform-plugin.py', 'dino.pth', device='cuda')
    enable_fast_inference(model)
    result = inference_detector(model, 'demo.jpg')   # the first call of an image size warms up and captures

The same works on ``DetInferencer(...).model``.
"""
from __future__ import annotations

from typing import Dict

from .integration.mmdet_fast_paths import apply_fast_paths
from .integration.mmdet_graph_inference import GraphInference, enable_graph_inference

__all__ = ["GraphInference", "enable_fast_inference"]


def enable_fast_inference(model, max_graphs: int = 4, warmup_runs: int = 2) -> Dict[str, object]:
    """Make ``model`` (an mmdet DETR-family or MaskFormer detector, in eval mode) infer at graph speed on CUDA.

    Turns on the fast paths that keep a forward free of host syncs (``sync_free_forward``) and the SDPA attention
    bricks, then captures each input signature's forward in a CUDA graph (:class:`GraphInference`): up to
    ``max_graphs`` signatures, the others run eagerly. On a CPU the model runs as before. Returns what changed.
    """
    model.eval()
    changed: Dict[str, object] = dict(apply_fast_paths(model, sdpa_attention=True, sync_free_forward=True))
    changed["graph_inference"] = enable_graph_inference(model, max_graphs=max_graphs, warmup_runs=warmup_runs)
    return changed
