"""The ``cuda_graphs`` fast path: the forward and backward of Deformable-DETR's, DINO's and Mask2Former's network
replayed from CUDA graphs during training, one pair per input shape (:class:`.graphed_region.GraphedRegion`).

The captured region is the part of mmdet 3.3.0's ``loss`` that depends only on the batch's pixels and image sizes:

- Deformable-DETR (plain, refine, two-stage): backbone, neck, encoder, ``pre_decoder`` (the two-stage top-k
  proposals), decoder and the head's class and box branches; matching and losses run eagerly on the replayed
  outputs;
- DINO: backbone, neck, encoder, ``pre_decoder``'s top-k proposals, decoder and the head's class and box
  branches. The denoising queries come from the ground truth (their number changes with the boxes of the batch):
  they are made eagerly by mmdet's own generator, then padded to a fixed count (twice ``num_dn_queries``) and
  enter the region as inputs, the label queries with their gradient. Padding queries attend only to themselves and
  no other query attends to them, so the real queries' outputs are those of the unpadded decoder; the padding is cut
  from the outputs before the eager matching and losses;
- DDQ-DETR: DINO's region with its own ``pre_decoder``, its distinct queries selected on the device with fixed
  shapes (:mod:`.ddq_distinct_queries`) and its decoder's distinct-query masks as outputs, for its one-pass losses
  (:mod:`.ddq_losses`). Other detectors that keep DINO's ``forward_transformer`` but change its pieces capture
  backbone, neck and encoder only;
- Mask2Former: backbone, pixel decoder and the masked-attention decoder with its class and mask predictions (its
  forward ignores the image sizes); the point-sampled matching and losses run eagerly;
- Grounding-DINO: BERT (its masks made on the host) and DINO's region with the text: :mod:`.graphed_grounding`.

Each image's size inside the padded batch reaches the region as a device tensor (its padding masks are made from
it), so one capture serves every batch of the same padded shape: with ``ShapeBucketsHook`` a random-resize
pipeline gives a few dozen. The level tables are the host-made ones of ``sync_free_forward``, which this fast path
turns on (a capture cannot read the device). Losses and gradients are those of the eager step up to float rounding
and dropout's random draws; under no-grad (validation losses) the stock ``loss`` runs, and on the CPU the
region runs eagerly.

Under DistributedDataParallel (``split_at_features``) the DETRs' backbone and neck are a region of their own ahead of
the rest: the rest's backward replay returns the transformer's and head's gradients first, and DDP all-reduces them
while the backbone's backward replays. Given gradient slots (one process, or
:class:`deform_plugin.engine.data_parallel.FlatGradientsDataParallel`), the regions write the gradients into them
and no autograd accumulation runs per parameter.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Tuple

import torch

from deform_plugin.cuda_graphs import CapturePolicy, check_feature_bucket_size

from .graphed_inputs import (GraphedLoss, cached_denoising_mask, denoising_queries, image_sizes_tensor,
                             padded_denoising_count)
from .graphed_region import GraphedRegion
from .padded_levels import (added_tokens, dino_forward_decoder, dino_topk_proposals, pad_levels,
                            pads_deformable_detr_decoder, pads_dino_decoder, two_stage_pre_decoder,
                            unpadded_token_outputs, unpadded_valid_ratios)
from .sync_free_forward import (deformable_detr_pre_transformer_from_image_sizes,
                                deformable_detr_pre_transformer_from_level_masks)


def detr_encoder(detector, batch_inputs, image_sizes, features=None, level_masks=None):
    # ``features``: the backbone's and neck's outputs where another region computed them (``batch_inputs`` then
    # only carries the padded batch's height and width in its shape); ``level_masks``: their padding masks where
    # the levels come padded to a feature bucket (:mod:`.padded_levels`).
    img_feats = detector.extract_feat(batch_inputs) if features is None else features
    if level_masks is not None:
        encoder_inputs, decoder_inputs = deformable_detr_pre_transformer_from_level_masks(
            detector, img_feats, level_masks)
    else:
        encoder_inputs, decoder_inputs = deformable_detr_pre_transformer_from_image_sizes(
            detector, img_feats, image_sizes, batch_inputs.shape[-2], batch_inputs.shape[-1])
    encoder_outputs = detector.forward_encoder(**encoder_inputs)
    return encoder_outputs, decoder_inputs


def detr_decoder(detector, encoder_outputs, decoder_inputs, batch_data_samples=None):
    # mmdet 3.3.0's forward_transformer after the encoder (DINO's pre_decoder also takes the data samples).
    extra = {} if batch_data_samples is None else dict(batch_data_samples=batch_data_samples)
    decoder_inputs_from_encoder, head_inputs = detector.pre_decoder(**encoder_outputs, **extra)
    decoder_inputs = dict(decoder_inputs, **decoder_inputs_from_encoder)
    head_inputs.update(detector.forward_decoder(**decoder_inputs))
    return head_inputs


def _pixels_only(batch_inputs, batch_data_samples):
    return (batch_inputs,), None


def _pixels_and_image_sizes(batch_inputs, batch_data_samples):
    return (batch_inputs, image_sizes_tensor(batch_data_samples, batch_inputs.device)), None


def _region_and_tail(detector) -> Optional[GraphedLoss]:
    """The captured function of ``detector``, how its inputs are made and the eager rest of its loss; or None if it
    has none of the known shapes."""
    from mmdet.models.detectors import GroundingDINO, MaskFormer
    if isinstance(detector, MaskFormer):
        return _mask2former_region_and_tail(detector)
    if isinstance(detector, GroundingDINO):
        from .graphed_grounding import grounding_graphed_loss
        return grounding_graphed_loss(detector)
    return _detr_region_and_tail(detector)


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

    def tail(outputs, _, batch_data_samples, __):
        # mmdet 3.3.0's MaskFormerHead.loss after its forward.
        batch_img_metas = [sample.metainfo for sample in batch_data_samples]
        batch_gt_instances = [sample.gt_instances for sample in batch_data_samples]
        batch_gt_semantic_segs = [sample.gt_sem_seg if "gt_sem_seg" in sample else None
                                  for sample in batch_data_samples]
        batch_gt_instances = head.preprocess_gt(batch_gt_instances, batch_gt_semantic_segs)
        return head.loss_by_feat(outputs["all_cls_scores"], outputs["all_mask_preds"], batch_gt_instances,
                                 batch_img_metas)

    def region_inputs(batch_inputs, batch_data_samples):
        # A head whose ground truth is made without syncs (batched_matching) queues its host copy of the panoptic
        # stuff classes here, ahead of the forward: the tail then waits for that copy, not for the forward.
        copy_targets_ahead = getattr(head, "copy_targets_ahead", None)
        if copy_targets_ahead is not None:
            copy_targets_ahead(batch_data_samples)
        return _pixels_only(batch_inputs, batch_data_samples)
    return GraphedLoss(network, region_inputs, tail)


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
            def whole_network(batch_inputs, image_sizes, features=None, levels=None):
                level_masks, unpadded_shapes = (None, None) if levels is None else levels
                encoder_outputs, decoder_inputs = detr_encoder(detector, batch_inputs, image_sizes, features,
                                                               level_masks)
                if levels is not None and detector.as_two_stage:
                    excluded = added_tokens(decoder_inputs["spatial_shapes"], unpadded_shapes)
                    decoder_inputs_from_encoder, head_inputs = two_stage_pre_decoder(
                        detector, encoder_outputs["memory"], encoder_outputs["memory_mask"],
                        encoder_outputs["spatial_shapes"], excluded)
                    head_inputs.update(detector.forward_decoder(**decoder_inputs, **decoder_inputs_from_encoder))
                else:
                    head_inputs = detr_decoder(detector, encoder_outputs, decoder_inputs)
                outputs = dict(head_outputs=head(head_inputs["hidden_states"], head_inputs["references"]),
                               enc_outputs_class=head_inputs.get("enc_outputs_class"),
                               enc_outputs_coord=head_inputs.get("enc_outputs_coord"))
                return outputs, None

            def tail(outputs, _, batch_data_samples, __):
                batch_gt_instances = [sample.gt_instances for sample in batch_data_samples]
                batch_img_metas = [sample.metainfo for sample in batch_data_samples]
                return head.loss_by_feat(*outputs["head_outputs"], outputs["enc_outputs_class"],
                                         outputs["enc_outputs_coord"], batch_gt_instances, batch_img_metas)
            return GraphedLoss(whole_network, _pixels_and_image_sizes, tail, splits_at_features=True,
                               pads_features=pads_deformable_detr_decoder(detector),
                               token_outputs=("enc_outputs_class", "enc_outputs_coord"))

        def transformer_only(batch_inputs, image_sizes, features=None):
            encoder_outputs, decoder_inputs = detr_encoder(detector, batch_inputs, image_sizes, features)
            return detr_decoder(detector, encoder_outputs, decoder_inputs), None

        def head_tail(head_inputs, _, batch_data_samples, __):
            return detector.bbox_head.loss(**head_inputs, batch_data_samples=batch_data_samples)
        return GraphedLoss(transformer_only, _pixels_and_image_sizes, head_tail, splits_at_features=True)
    if transformer is DINO.forward_transformer:
        whole = _dino_graphed_loss(detector)
        if whole is None:
            whole = _ddq_graphed_loss(detector)
        if whole is not None:
            return whole

        def backbone_and_encoder(batch_inputs, image_sizes, features=None):
            encoder_outputs, decoder_inputs = detr_encoder(detector, batch_inputs, image_sizes, features)
            outputs = dict(memory=encoder_outputs["memory"], memory_mask=encoder_outputs["memory_mask"],
                           valid_ratios=decoder_inputs["valid_ratios"])
            tables = dict(spatial_shapes=decoder_inputs["spatial_shapes"],
                          level_start_index=decoder_inputs["level_start_index"])
            return outputs, tables

        def tail(outputs, tables, batch_data_samples, _):
            encoder_outputs = dict(memory=outputs["memory"], memory_mask=outputs["memory_mask"],
                                   spatial_shapes=tables["spatial_shapes"])
            decoder_inputs = dict(memory_mask=outputs["memory_mask"], valid_ratios=outputs["valid_ratios"], **tables)
            head_inputs = detr_decoder(detector, encoder_outputs, decoder_inputs, batch_data_samples)
            return detector.bbox_head.loss(**head_inputs, batch_data_samples=batch_data_samples)
        return GraphedLoss(backbone_and_encoder, _pixels_and_image_sizes, tail, splits_at_features=True)
    return None


def _padded_denoising_inputs(detector, generator) -> Callable:
    """The ``region_inputs`` of DINO's and DDQ-DETR's regions: the pixels, each image's size, and mmdet's denoising
    queries padded to a fixed count with their attention mask; the tail's context is ``(num_denoising, padded,
    dn_meta)``."""
    def region_inputs(batch_inputs, batch_data_samples):
        label_query, bbox_query, group_size, dn_meta = denoising_queries(generator, batch_data_samples)
        num_denoising = dn_meta["num_denoising_queries"]
        padded = padded_denoising_count(generator, num_denoising)
        mask = cached_denoising_mask(num_denoising, group_size, padded, detector.num_queries, batch_inputs.device)
        pad = (0, 0, 0, padded - num_denoising)
        inputs = (batch_inputs, image_sizes_tensor(batch_data_samples, batch_inputs.device),
                  torch.nn.functional.pad(label_query, pad), torch.nn.functional.pad(bbox_query, pad), mask)
        return inputs, (num_denoising, padded, dn_meta)
    return region_inputs


def _without_denoising_padding(per_layer: torch.Tensor, num_denoising: int, padded: int) -> torch.Tensor:
    """``(layers, batch, queries, ...)`` outputs without the denoising padding queries."""
    return torch.cat([per_layer[:, :, :num_denoising], per_layer[:, :, padded:]], dim=2)


def _dino_graphed_loss(detector) -> Optional[GraphedLoss]:
    """DINO's whole network in the region, the denoising queries padded to a fixed count (see the module's doc);
    None where a piece differs from mmdet 3.3.0's."""
    from mmdet.models.dense_heads import DINOHead
    from mmdet.models.detectors import DINO
    from mmdet.models.layers import CdnQueryGenerator
    head, generator = detector.bbox_head, getattr(detector, "dn_query_generator", None)
    if not (type(detector).pre_decoder is DINO.pre_decoder and type(detector).forward_decoder is DINO.forward_decoder
            and type(head).loss is DINOHead.loss and type(generator).__call__ is CdnQueryGenerator.__call__
            and type(generator).collate_dn_queries is CdnQueryGenerator.collate_dn_queries):
        return None

    def network(batch_inputs, image_sizes, dn_label_query, dn_bbox_query, dn_mask, features=None, levels=None):
        level_masks, unpadded_shapes = (None, None) if levels is None else levels
        encoder_outputs, decoder_inputs = detr_encoder(detector, batch_inputs, image_sizes, features, level_masks)
        # mmdet 3.3.0's DINO.pre_decoder in training, with the denoising queries given; the tokens added by the
        # padding stay out of the top-k.
        memory = encoder_outputs["memory"]
        excluded = None if levels is None else added_tokens(encoder_outputs["spatial_shapes"], unpadded_shapes)
        topk_score, topk_coords_unact = dino_topk_proposals(detector, memory, encoder_outputs["memory_mask"],
                                                            encoder_outputs["spatial_shapes"], excluded)
        topk_coords = topk_coords_unact.sigmoid()
        query = detector.query_embedding.weight[:, None, :].repeat(1, memory.shape[0], 1).transpose(0, 1)
        query = torch.cat([dn_label_query, query], dim=1)
        reference_points = torch.cat([dn_bbox_query, topk_coords_unact.detach()], dim=1).sigmoid()
        if levels is None:
            decoder_outputs = detector.forward_decoder(query=query, memory=memory, reference_points=reference_points,
                                                       dn_mask=dn_mask, **decoder_inputs)
        else:
            decoder_outputs = dino_forward_decoder(
                detector, query, memory, reference_points=reference_points, dn_mask=dn_mask,
                query_position_ratios=unpadded_valid_ratios(level_masks, unpadded_shapes), **decoder_inputs)
        all_cls_scores, all_bbox_preds = head(decoder_outputs["hidden_states"], decoder_outputs["references"])
        return dict(all_cls_scores=all_cls_scores, all_bbox_preds=all_bbox_preds, enc_outputs_class=topk_score,
                    enc_outputs_coord=topk_coords), None

    def tail(outputs, _, batch_data_samples, context):
        num_denoising, padded, dn_meta = context
        batch_gt_instances = [sample.gt_instances for sample in batch_data_samples]
        batch_img_metas = [sample.metainfo for sample in batch_data_samples]
        return head.loss_by_feat(_without_denoising_padding(outputs["all_cls_scores"], num_denoising, padded),
                                 _without_denoising_padding(outputs["all_bbox_preds"], num_denoising, padded),
                                 outputs["enc_outputs_class"], outputs["enc_outputs_coord"], batch_gt_instances,
                                 batch_img_metas, dn_meta)
    return GraphedLoss(network, _padded_denoising_inputs(detector, generator), tail, splits_at_features=True,
                       pads_features=pads_dino_decoder(detector))


def _ddq_graphed_loss(detector) -> Optional[GraphedLoss]:
    """DDQ-DETR's whole network in the region: its distinct queries selected on the device with fixed shapes
    (before the decoder and between its layers, :mod:`.ddq_distinct_queries`), the denoising queries padded as
    DINO's; the one-pass matching and losses (:mod:`.ddq_losses`) run eagerly on the replayed outputs and the
    decoder's distinct-query masks. None where a piece differs from mmdet 3.3.0's, where the NMS configuration is one
    the device selection does not mirror, or where the head's losses are not the one-pass ones' (``batched_losses``
    off, or a head they do not reproduce): the backbone and encoder region then serves."""
    from mmdet.models.detectors import DDQDETR, DINO
    from mmdet.models.layers import CdnQueryGenerator, DDQTransformerDecoder

    from .ddq_distinct_queries import (enable_sync_free_distinct_queries, selects_distinct_queries_sync_free,
                                       training_pre_decoder_sync_free)
    from .ddq_losses import batchable_ddq_head, ddq_losses_in_one_pass
    head, generator = detector.bbox_head, getattr(detector, "dn_query_generator", None)
    if not (isinstance(detector, DDQDETR) and type(detector).pre_decoder is DDQDETR.pre_decoder
            and type(detector).forward_decoder is DINO.forward_decoder
            and type(detector.decoder).forward is DDQTransformerDecoder.forward
            and type(generator).__call__ is CdnQueryGenerator.__call__
            and type(generator).collate_dn_queries is CdnQueryGenerator.collate_dn_queries
            and batchable_ddq_head(head) and "loss" in vars(head)):
        return None
    # The decoder's selection between its layers on the device (its method, also in eager steps); None where the
    # NMS configuration is not mirrored.
    enable_sync_free_distinct_queries(detector)
    if not selects_distinct_queries_sync_free(detector):
        return None

    def network(batch_inputs, image_sizes, dn_label_query, dn_bbox_query, dn_mask, features=None):
        encoder_outputs, decoder_inputs = detr_encoder(detector, batch_inputs, image_sizes, features)
        decoder_inputs_from_encoder, head_inputs = training_pre_decoder_sync_free(
            detector, encoder_outputs["memory"], encoder_outputs["memory_mask"], encoder_outputs["spatial_shapes"],
            dn_label_query, dn_bbox_query, dn_mask)
        decoder_outputs = detector.forward_decoder(**decoder_inputs_from_encoder, **decoder_inputs)
        all_cls_scores, all_bbox_preds = head(decoder_outputs["hidden_states"], decoder_outputs["references"])
        masks = detector.cache_dict["distinct_query_mask"]
        outputs = dict(all_cls_scores=all_cls_scores, all_bbox_preds=all_bbox_preds,
                       distinct_query_masks=torch.stack(masks) if masks else None, **head_inputs)
        return outputs, dict(num_dense_queries=detector.cache_dict["num_dense_queries"])

    def tail(outputs, constants, batch_data_samples, context):
        num_denoising, padded, dn_meta = context
        dn_meta = dict(dn_meta, num_dense_queries=constants["num_dense_queries"])
        masks = outputs["distinct_query_masks"]
        # Where the head's losses read the decoder's selections, as the eager decoder leaves them.
        detector.cache_dict["distinct_query_mask"] = [] if masks is None else list(masks.unbind(0))
        return ddq_losses_in_one_pass(
            head, _without_denoising_padding(outputs["all_cls_scores"], num_denoising, padded),
            _without_denoising_padding(outputs["all_bbox_preds"], num_denoising, padded),
            outputs["enc_outputs_class"], outputs["enc_outputs_coord"], outputs["aux_enc_outputs_class"],
            outputs["aux_enc_outputs_coord"], [sample.gt_instances for sample in batch_data_samples],
            [sample.metainfo for sample in batch_data_samples], dn_meta)
    return GraphedLoss(network, _padded_denoising_inputs(detector, generator), tail, splits_at_features=True)


def _feature_module_names(detector) -> Tuple[str, ...]:
    return ("backbone", "neck") if getattr(detector, "with_neck", False) else ("backbone",)


def _in_modules(names: Tuple[str, ...]) -> Callable[[str], bool]:
    prefixes = tuple(f"{name}." for name in names)
    return lambda parameter: parameter.startswith(prefixes)


def enable_cuda_graph_training(detector, policy: Optional[CapturePolicy] = None, split_at_features: bool = False,
                               gradient_slots=None, feature_bucket_size: Optional[int] = None
                               ) -> Optional[GraphedRegion]:
    """Give one Deformable-DETR-family or Mask2Former detector (an instance with mmdet 3.3.0's pieces) the
    graph-replayed training loss; returns its :class:`GraphedRegion`, or None when the detector is not one this path
    knows. ``policy``: when an input shape is captured (:class:`~deform_plugin.cuda_graphs.CapturePolicy`; its
    default captures a shape at its second call).

    ``split_at_features`` (the DETRs; Mask2Former keeps one region): the backbone and neck are a region of their own,
    ahead of the rest of the network's. Under DistributedDataParallel this lets the gradients of the transformer
    and head, which the second region's backward replay returns first, be all-reduced while the backbone's backward
    replays (with one region every gradient arrives at the end of the backward, and no reduction overlaps it). On
    one GPU it only adds a region boundary (a copy of the features and of their gradients).

    ``feature_bucket_size`` (pixels; Deformable-DETR and DINO with mmdet 3.3.0's decoders; implies
    ``split_at_features``): the features' levels reach the second region padded to a feature bucket, each side
    rounded up to this many input pixels (:mod:`.padded_levels`), so that its graphs serve every batch shape of the
    bucket; the backbone and neck run at the batch's own shape. The losses and gradients stay the unpadded ones. A
    bucket recurs by construction: the second region captures it at its first call (``capture_after=1``).

    ``gradient_slots``: the regions write the parameters' gradients into these slots and make them the ``.grad``
    (see :class:`.graphed_region.GraphedRegion`); not under DistributedDataParallel.
    """
    if "loss" in vars(detector):
        return None
    pieces = _region_and_tail(detector)
    if pieces is None:
        return None
    check_feature_bucket_size("enable_cuda_graph_training", "feature_bucket_size", feature_bucket_size)
    pads_features = feature_bucket_size is not None and pieces.pads_features
    split_at_features = split_at_features or pads_features
    name = type(detector).__name__
    features_region = None
    if split_at_features and pieces.splits_at_features:
        feature_modules = _feature_module_names(detector)
        in_feature_modules = _in_modules(feature_modules)

        def features(batch_inputs):
            return tuple(detector.extract_feat(batch_inputs)), None

        features_region = GraphedRegion(features, detector, name=f"{name} training {' and '.join(feature_modules)}",
                                        policy=policy, parameter_filter=in_feature_modules,
                                        reports_signatures=False, gradient_slots=gradient_slots)
        # Set at the first call, before the region first runs: how many of its inputs are features.
        feature_count = []

        def after_features(padded_shape, *inputs):
            count = feature_count[0]
            return pieces.region(padded_shape, *inputs[count:], features=inputs[:count])

        def after_padded_features(*inputs):
            # The levels' features, their padding masks, their unpadded shapes, then the region's other inputs.
            count = feature_count[0]
            levels = (inputs[count:2 * count], inputs[2 * count])
            return pieces.region(None, *inputs[2 * count + 1:], features=inputs[:count], levels=levels)

        region_policy = policy
        if pads_features:  # buckets recur by construction: captured at their first call once the kind warmed up
            region_policy = dataclasses.replace(policy or CapturePolicy(), capture_after=1)
        region = GraphedRegion(after_padded_features if pads_features else after_features, detector,
                               name=f"{name} training transformer and head", policy=region_policy,
                               gradient_slots=gradient_slots,
                               parameter_filter=lambda parameter: not in_feature_modules(parameter))
    else:
        region = GraphedRegion(pieces.region, detector, name=f"{name} training forward", policy=policy,
                               gradient_slots=gradient_slots)
    stock_loss = type(detector).loss.__get__(detector)

    def loss(batch_inputs, batch_data_samples):
        if not torch.is_grad_enabled():
            return stock_loss(batch_inputs, batch_data_samples)
        inputs, context = pieces.region_inputs(batch_inputs, batch_data_samples)
        levels = None
        if features_region is not None:
            pixels, *others = inputs
            features, _ = features_region(pixels)
            if not feature_count:
                feature_count.append(len(features))
            if pads_features:  # others[0]: the images' sizes
                levels = pad_levels(features, others[0], pixels.shape[-2:], feature_bucket_size)
                inputs = (*levels.features, *levels.masks, levels.unpadded_shapes, *others)
            else:
                # An empty tensor carries the padded height and width into the second region's signature.
                inputs = (pixels.new_empty((0,) + tuple(pixels.shape[-2:])), *features, *others)
        outputs, constants = region(*inputs)
        if levels is not None and pieces.token_outputs:
            outputs = unpadded_token_outputs(outputs, pieces.token_outputs, levels.token_index)
        return pieces.tail(outputs, constants, batch_data_samples, context)

    detector.loss = loss
    detector.graphed_training_region = region
    detector.graphed_training_regions = (region,) if features_region is None else (features_region, region)
    detector.graphed_feature_bucket_size = feature_bucket_size if pads_features else None
    return region


def enable_cuda_graphs(model, split_at_features: bool = False, gradient_slots=None,
                       policy: Optional[CapturePolicy] = None, feature_bucket_size: Optional[int] = None) -> int:
    """Turn the graph-replayed training loss on for every Deformable-DETR-family and Mask2Former detector in
    ``model``; returns how many detectors changed (``split_at_features``, ``gradient_slots``, ``policy``,
    ``feature_bucket_size``: see :func:`enable_cuda_graph_training`)."""
    return sum(enable_cuda_graph_training(module, policy=policy, split_at_features=split_at_features,
                                          gradient_slots=gradient_slots,
                                          feature_bucket_size=feature_bucket_size) is not None
               for module in model.modules())
