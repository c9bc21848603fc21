"""The DETR-family detectors of the repository's configs, shrunk to train a step on a CPU in seconds."""
from pathlib import Path

import stock_worker
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
DETECTOR_CONFIGS = {
    "deformable-detr": "configs/deformable_detr/deformable-detr_r50_16xb2-50e_coco_deform-plugin.py",
    "deformable-detr-refine": "configs/deformable_detr/deformable-detr-refine_r50_16xb2-50e_coco_deform-plugin.py",
    "deformable-detr-two-stage":
        "configs/deformable_detr/deformable-detr-refine-twostage_r50_16xb2-50e_coco_deform-plugin.py",
    "dino": "configs/dino/dino-4scale_r50_8xb2-12e_coco_deform-plugin.py",
    "mask2former": "configs/mask2former/mask2former_r50_8xb2-lsj-50e_coco_deform-plugin.py",
    "mask2former-panoptic": "configs/mask2former/mask2former_r50_8xb2-lsj-50e_coco-panoptic_deform-plugin.py"}
# The panoptic detector's label space, shrunk: a handful of thing and stuff classes (80 and 53 in the config).
PANOPTIC_THINGS, PANOPTIC_STUFF = 5, 3
# Shrunk the same way, but not among the families above that tests run alike: DDQ-DETR trains in float64 only with
# tests/helpers/ddq_heads.py's help, and its losses include per-image lists.
DDQ_CONFIG = "configs/ddq/ddq-detr-4scale_r50_8xb2-12e_coco_deform-plugin.py"


def small_detector(name, dtype=torch.float64, layers=None, feedforward_channels=None, config=None, queries=None):
    """The ``name`` family's detector (a key of :data:`DETECTOR_CONFIGS`, or ``"ddq"``), shrunk for CPU steps,
    initialised, in training mode; ``config``: another config file of that family (a path from the repository's
    root), e.g. its fast config.

    Where given, ``layers`` is the number of encoder and decoder layers (six each in the configs; Mask2Former's pixel
    decoder gets ``layers`` and its transformer decoder, which attends to its three feature levels in turn, one round
    of three per layer) and ``feedforward_channels`` the hidden width of every FFN (1024 or 2048 in the configs);
    ``queries`` the DETRs' number of queries (100 otherwise) and at most as many denoising queries.
    """
    from mmengine.config import Config
    torch.manual_seed(0)
    cfg = Config.fromfile(str(REPO_ROOT / (config or {**DETECTOR_CONFIGS, "ddq": DDQ_CONFIG}[name])))
    # A ResNet-18, fewer queries (and sampled points) keep the float64 CPU steps short; the captured pieces are the
    # same.
    cfg.model.backbone.depth = 18
    if name.startswith("mask2former"):
        head = cfg.model.panoptic_head
        head.in_channels = [64, 128, 256, 512]
        head.num_queries = 20
        cfg.model.train_cfg.num_points = 256
        encoder, decoder = head.pixel_decoder.encoder, head.transformer_decoder
        decoder_layers = None if layers is None else 3 * layers
        if name == "mask2former-panoptic":
            for part in (head, cfg.model.panoptic_fusion_head):
                part.num_things_classes, part.num_stuff_classes = PANOPTIC_THINGS, PANOPTIC_STUFF
            head.loss_cls.class_weight = [1.0] * (PANOPTIC_THINGS + PANOPTIC_STUFF) + [0.1]
    else:
        cfg.model.neck.in_channels = [128, 256, 512]
        cfg.model.num_queries = queries or 100
        if queries is not None and "dn_cfg" in cfg.model:
            cfg.model.dn_cfg.group_cfg.num_dn_queries = queries
        encoder, decoder = cfg.model.encoder, cfg.model.decoder
        decoder_layers = layers
    if layers is not None:
        encoder.num_layers, decoder.num_layers = layers, decoder_layers
    if feedforward_channels is not None:
        for stack in (encoder, decoder):
            stack.layer_cfg.ffn_cfg.feedforward_channels = feedforward_channels
    model = stock_worker.build_msda_owner(cfg)
    model.init_weights()
    return model.to(dtype=dtype).train()


def with_fractional_offsets(model, seed=5):
    """``model`` with a fraction of a pixel (0.25-0.75) added to every MSDA's sampling-offset biases. Their initial
    values are whole pixels, which put the encoder's samples on pixel centres, where bilinear sampling has no
    derivative and float rounding picks the corners: comparisons of two paths that round their reference points
    differently then stay well-conditioned."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__ == "MultiScaleDeformableAttention":
                bias = module.sampling_offsets.bias
                bias.add_(torch.rand(bias.shape, generator=generator, dtype=torch.float64).to(bias) * 0.5 + 0.25)
    return model


def float64_nms_refusal():
    """Why this environment's NMS cannot take the float64 boxes of a shrunk DDQ-DETR, or None where it can.

    DDQ-DETR runs NMS inside its forward. mmcv's compiled CPU NMS reads its boxes as float32 and refuses float64;
    mmcv-lite's stand-in takes any float dtype. The float64 comparisons of a whole DDQ-DETR need the latter.
    """
    from mmcv.ops import nms
    boxes = torch.tensor([[0.0, 0.0, 4.0, 4.0], [1.0, 1.0, 5.0, 5.0]], dtype=torch.float64)
    try:
        nms(boxes, torch.tensor([0.9, 0.8], dtype=torch.float64), 0.5)
    except RuntimeError as error:
        return f"this mmcv's NMS refuses float64 boxes ({str(error).splitlines()[0]})"
    return None
