"""The ``cuda_graphs`` fast path: the forward and backward of Deformable-DETR's, DINO's and Mask2Former's network
replayed from CUDA graphs during training, one pair per input shape (:class:`.graphed_region.GraphedRegion`).

The captured region is the part of mmdet 3.3.0's ``loss`` that depends only on the batch's pixels and image sizes:

- Deformable-DETR (plain, refine, two-stage): backbone, neck, encoder, ``pre_decoder`` (the two-stage top-k
  proposals), decoder and the head's class and box branches; matching and losses run eagerly on the replayed
  outputs;
- DINO (and detectors with DINO's ``forward_transformer``): backbone, neck and encoder; ``pre_decoder`` builds the
  denoising queries from the ground truth (their number changes with the boxes of the batch), so it, the decoder,
  the head and the losses run eagerly;
- Mask2Former: backbone, pixel decoder and the masked-attention decoder with its class and mask predictions (its
  forward ignores the image sizes); the point-sampled matching and losses run eagerly.

Each image's size inside the padded batch reaches the region as a device tensor (its padding masks are made from
it), so one capture serves every batch of the same padded shape: with ``ShapeBucketsHook`` a random-resize
pipeline gives a few dozen. The level tables are the host-made ones of ``sync_free_forward``, which this fast path
turns on (a capture cannot read the device). Losses and gradients are those of the eager step up to float rounding
and dropout's random draws; under no-grad (validation losses) the stock ``loss`` runs, and on the CPU the
region runs eagerly.
"""
from __future__ import annotations

from typing import Optional

import torch

from .graphed_region import GraphedRegion
from .sync_free_forward import deformable_detr_pre_transformer_from_image_sizes


def _image_sizes(batch_data_samples, device) -> torch.Tensor:
    """Each image's (height, width) inside the batch, on ``device`` (copied without blocking)."""
    sizes = torch.tensor([list(sample.img_shape[:2]) for sample in batch_data_samples], dtype=torch.int64)
    if torch.device(device).type == "cuda":
        sizes = sizes.pin_memory()
    return sizes.to(device, non_blocking=True)


def _encoder(detector, batch_inputs, image_sizes):
    img_feats = detector.extract_feat(batch_inputs)
    encoder_inputs, decoder_inputs = deformable_detr_pre_transformer_from_image_sizes(
        detector, img_feats, image_sizes, batch_inputs.shape[-2], batch_inputs.shape[-1])
    encoder_outputs = detector.forward_encoder(**encoder_inputs)
    return encoder_outputs, decoder_inputs


def _decoder(detector, encoder_outputs, decoder_inputs, batch_data_samples=None):
    # mmdet 3.3.0's forward_transformer after the encoder (DINO's pre_decoder also takes the data samples).
    extra = {} if batch_data_samples is None else dict(batch_data_samples=batch_data_samples)
    decoder_inputs_from_encoder, head_inputs = detector.pre_decoder(**encoder_outputs, **extra)
    decoder_inputs = dict(decoder_inputs, **decoder_inputs_from_encoder)
    head_inputs.update(detector.forward_decoder(**decoder_inputs))
    return head_inputs


def _mask2former_region_and_tail(detector):
    """Mask2Former: its forward reads nothing but the pixels (no padding masks: mmdet 3.3.0 does not mask the padded
    region), so the region is backbone, neck, pixel decoder and the masked-attention decoder with its class and mask
    predictions; ground-truth preprocessing, matching and the point-sampled losses stay eager."""
    from mmdet.models.dense_heads import Mask2FormerHead, MaskFormerHead
    from mmdet.models.detectors import MaskFormer, SingleStageDetector
    head = getattr(detector, "panoptic_head", None)
    if (type(detector).loss is not MaskFormer.loss
            or type(detector).extract_feat is not SingleStageDetector.extract_feat
            or not isinstance(head, Mask2FormerHead) or type(head).loss is not MaskFormerHead.loss
            or type(head).forward is not Mask2FormerHead.forward):
        return None

    def network(batch_inputs):
        # Mask2FormerHead.forward takes the data samples but reads only the batch size, from the features.
        all_cls_scores, all_mask_preds = head(detector.extract_feat(batch_inputs), None)
        return dict(all_cls_scores=all_cls_scores, all_mask_preds=all_mask_preds), None

    def tail(outputs, _, batch_data_samples):
        # mmdet 3.3.0's MaskFormerHead.loss after its forward.
        batch_img_metas = [sample.metainfo for sample in batch_data_samples]
        batch_gt_instances = [sample.gt_instances for sample in batch_data_samples]
        batch_gt_semantic_segs = [sample.gt_sem_seg if "gt_sem_seg" in sample else None
                                  for sample in batch_data_samples]
        batch_gt_instances = head.preprocess_gt(batch_gt_instances, batch_gt_semantic_segs)
        return head.loss_by_feat(outputs["all_cls_scores"], outputs["all_mask_preds"], batch_gt_instances,
                                 batch_img_metas)
    return network, tail


def _region_and_tail(detector):
    """The captured function of ``detector``, whether it takes the image sizes, and the eager rest of its loss; or
    None if it has none of the known shapes."""
    from mmdet.models.detectors import MaskFormer
    if isinstance(detector, MaskFormer):
        pieces = _mask2former_region_and_tail(detector)
        return None if pieces is None else (pieces[0], False, pieces[1])
    pieces = _detr_region_and_tail(detector)
    return None if pieces is None else (pieces[0], True, pieces[1])


def _detr_region_and_tail(detector):
    from mmdet.models.detectors import DINO, DeformableDETR, DetectionTransformer
    if not isinstance(detector, DeformableDETR) or type(detector).loss is not DetectionTransformer.loss:
        return None
    stock_pieces = all(getattr(type(detector), name) is getattr(DeformableDETR, name)
                       for name in ("pre_transformer", "forward_encoder", "extract_feat"))
    if not stock_pieces:
        return None
    transformer = type(detector).forward_transformer
    if (transformer is DeformableDETR.forward_transformer and type(detector).pre_decoder is DeformableDETR.pre_decoder
            and type(detector).forward_decoder is DeformableDETR.forward_decoder):
        from mmdet.models.dense_heads import DeformableDETRHead
        head = detector.bbox_head
        if type(head).loss is DeformableDETRHead.loss:
            # mmdet 3.3.0's DeformableDETRHead.loss, its forward (the class and box branches) inside the region.
            def whole_network(batch_inputs, image_sizes):
                encoder_outputs, decoder_inputs = _encoder(detector, batch_inputs, image_sizes)
                head_inputs = _decoder(detector, encoder_outputs, decoder_inputs)
                outputs = dict(head_outputs=head(head_inputs["hidden_states"], head_inputs["references"]),
                               enc_outputs_class=head_inputs.get("enc_outputs_class"),
                               enc_outputs_coord=head_inputs.get("enc_outputs_coord"))
                return outputs, None

            def tail(outputs, _, batch_data_samples):
                batch_gt_instances = [sample.gt_instances for sample in batch_data_samples]
                batch_img_metas = [sample.metainfo for sample in batch_data_samples]
                return head.loss_by_feat(*outputs["head_outputs"], outputs["enc_outputs_class"],
                                         outputs["enc_outputs_coord"], batch_gt_instances, batch_img_metas)
            return whole_network, tail

        def transformer_only(batch_inputs, image_sizes):
            encoder_outputs, decoder_inputs = _encoder(detector, batch_inputs, image_sizes)
            return _decoder(detector, encoder_outputs, decoder_inputs), None

        def head_tail(head_inputs, _, batch_data_samples):
            return detector.bbox_head.loss(**head_inputs, batch_data_samples=batch_data_samples)
        return transformer_only, head_tail
    if transformer is DINO.forward_transformer:
        def backbone_and_encoder(batch_inputs, image_sizes):
            encoder_outputs, decoder_inputs = _encoder(detector, batch_inputs, image_sizes)
            outputs = dict(memory=encoder_outputs["memory"], memory_mask=encoder_outputs["memory_mask"],
                           valid_ratios=decoder_inputs["valid_ratios"])
            tables = dict(spatial_shapes=decoder_inputs["spatial_shapes"],
                          level_start_index=decoder_inputs["level_start_index"])
            return outputs, tables

        def tail(outputs, tables, batch_data_samples):
            encoder_outputs = dict(memory=outputs["memory"], memory_mask=outputs["memory_mask"],
                                   spatial_shapes=tables["spatial_shapes"])
            decoder_inputs = dict(memory_mask=outputs["memory_mask"], valid_ratios=outputs["valid_ratios"], **tables)
            head_inputs = _decoder(detector, encoder_outputs, decoder_inputs, batch_data_samples)
            return detector.bbox_head.loss(**head_inputs, batch_data_samples=batch_data_samples)
        return backbone_and_encoder, tail
    return None


def enable_cuda_graph_training(detector, max_graphs: int = 64) -> Optional[GraphedRegion]:
    """Give one Deformable-DETR-family or Mask2Former detector (an instance with mmdet 3.3.0's pieces) the
    graph-replayed training loss; returns its :class:`GraphedRegion`, or None when the detector is not one this path
    knows."""
    if "loss" in vars(detector):
        return None
    pieces = _region_and_tail(detector)
    if pieces is None:
        return None
    fn, takes_image_sizes, tail = pieces
    region = GraphedRegion(fn, detector, name=f"{type(detector).__name__} training forward", max_graphs=max_graphs)
    stock_loss = type(detector).loss.__get__(detector)

    def loss(batch_inputs, batch_data_samples):
        if not torch.is_grad_enabled():
            return stock_loss(batch_inputs, batch_data_samples)
        if takes_image_sizes:
            outputs, constants = region(batch_inputs, _image_sizes(batch_data_samples, batch_inputs.device))
        else:
            outputs, constants = region(batch_inputs)
        return tail(outputs, constants, batch_data_samples)

    detector.loss = loss
    detector.graphed_training_region = region
    return region


def enable_cuda_graphs(model) -> int:
    """Turn the graph-replayed training loss on for every Deformable-DETR-family and Mask2Former detector in
    ``model``; returns how many detectors changed."""
    return sum(enable_cuda_graph_training(module) is not None for module in model.modules())
