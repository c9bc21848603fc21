"""The DETR-family detectors of the repository's configs, shrunk to train a step on a CPU in seconds."""
from pathlib import Path

import stock_worker
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
DETECTOR_CONFIGS = {
    "deformable-detr-two-stage":
        "configs/deformable_detr/deformable-detr-refine-twostage_r50_16xb2-50e_coco_deform-plugin.py",
    "dino": "configs/dino/dino-4scale_r50_8xb2-12e_coco_deform-plugin.py",
    "mask2former": "configs/mask2former/mask2former_r50_8xb2-lsj-50e_coco_deform-plugin.py"}


def small_detector(name, dtype=torch.float64):
    """The ``name`` family's detector (a key of :data:`DETECTOR_CONFIGS`), shrunk for CPU steps, initialised, in
    training mode."""
    from mmengine.config import Config
    torch.manual_seed(0)
    cfg = Config.fromfile(str(REPO_ROOT / DETECTOR_CONFIGS[name]))
    # A ResNet-18, fewer queries (and sampled points) keep the float64 CPU steps short; the captured pieces are the
    # same.
    cfg.model.backbone.depth = 18
    if name == "mask2former":
        cfg.model.panoptic_head.in_channels = [64, 128, 256, 512]
        cfg.model.panoptic_head.num_queries = 20
        cfg.model.train_cfg.num_points = 256
    else:
        cfg.model.neck.in_channels = [128, 256, 512]
        cfg.model.num_queries = 100
    model = stock_worker.build_msda_owner(cfg)
    model.init_weights()
    return model.to(dtype=dtype).train()
