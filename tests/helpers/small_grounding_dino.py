"""Grounding-DINO of the repository's config, shrunk to train a step on a CPU in about a second, on the random text
encoder (no download)."""
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
GROUNDING_DINO_CONFIG = "configs/grounding_dino/grounding_dino_swin-t_finetune_16xb2_1x_coco_deform-plugin.py"
FAST_CONFIG = "configs/fast/grounding_dino_swin-t_finetune_16xb2_1x_coco_deform-plugin-fast.py"
# BERT's structure at toy sizes: the text path's pieces (tokenizer, sub-sentence masks, fusion) are all exercised.
TINY_BERT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
CLASSES = ("person", "traffic light", "hot dog", "teddy bear", "hair drier")


def small_grounding_dino_config(bert=TINY_BERT):
    """The repository's Grounding-DINO config with a ResNet-18, two encoder and decoder layers, 30 queries and a tiny
    random BERT; the contrastive scores scaled by 1/sqrt(256) ('auto') keep random-init logits in a range where
    float32 sums compare."""
    from mmengine.config import Config

    from deform_plugin.benchmarks.detector.random_text_encoder import use_random_text_encoder
    cfg = Config.fromfile(str(REPO_ROOT / GROUNDING_DINO_CONFIG))
    cfg.train_dataloader.dataset.metainfo = dict(classes=CLASSES)
    assert use_random_text_encoder(cfg, "random", shape=bert)
    model = cfg.model
    model.backbone = dict(type="ResNet", depth=18, num_stages=4, out_indices=(1, 2, 3), frozen_stages=-1,
                          norm_cfg=dict(type="BN", requires_grad=True), norm_eval=False, style="pytorch")
    model.neck.in_channels = [128, 256, 512]
    model.num_queries = 30
    model.encoder.num_layers = model.decoder.num_layers = 2
    model.encoder.num_cp = 0  # fairscale's activation checkpointing: the same values, one package fewer
    model.dn_cfg.group_cfg.num_dn_queries = 10
    model.bbox_head.num_classes = len(CLASSES)
    model.bbox_head.contrastive_cfg.log_scale = "auto"
    return cfg


def small_grounding_dino(seed=0, bert=TINY_BERT):
    """:func:`small_grounding_dino_config`'s model (``bert``: the text encoder's ``BertConfig`` fields), initialised
    from ``seed``, in training mode (float32: DINO's denoising queries are made in float32)."""
    from mmdet.registry import MODELS
    from mmdet.utils import register_all_modules

    from deform_plugin.benchmarks.detector import random_text_encoder_model  # noqa: F401  (registers it)
    register_all_modules()
    cfg = small_grounding_dino_config(bert)
    torch.manual_seed(seed)
    model = MODELS.build(cfg.model)
    model.init_weights()
    return model.train()


def grounding_batch(model, num_gts_per_image, height=48, width=64, seed=0):
    """A training batch as the config's pipeline packs it: images, boxes of :data:`CLASSES` labels, and the class
    names as the caption (``text``, ``custom_entities``), as ``CocoDataset(return_classes=True)`` gives them (the
    synthetic batches' own caption numbers the classes: these names have words BERT's vocabulary splits)."""
    from deform_plugin.benchmarks.detector.synthetic import make_batch
    images = [make_batch(model, 1, height, width, count, seed + index)
              for index, count in enumerate(num_gts_per_image)]
    batch = {"inputs": [image["inputs"][0] for image in images],
             "data_samples": [image["data_samples"][0] for image in images]}
    for sample in batch["data_samples"]:
        sample.set_metainfo(dict(text=CLASSES, custom_entities=True))
    return batch
