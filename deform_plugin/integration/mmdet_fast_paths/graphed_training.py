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
  from the outputs before the eager matching and losses. Detectors that keep DINO's ``forward_transformer`` but
  change its pieces (DDQ-DETR's ``pre_decoder``) capture backbone, neck and encoder only;
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

import functools
from typing import Callable, NamedTuple, Optional, Tuple

import torch

from deform_plugin.cuda_graphs import CapturePolicy

from .graphed_region import GraphedRegion
from .matching import image_size_factor
from .sync_free_forward import deformable_detr_pre_transformer_from_image_sizes


def image_sizes_tensor(batch_data_samples, device) -> torch.Tensor:
    """Each image's (height, width) inside the batch, on ``device`` (copied without blocking)."""
    sizes = torch.tensor([list(sample.img_shape[:2]) for sample in batch_data_samples], dtype=torch.int64)
    if torch.device(device).type == "cuda":
        sizes = sizes.pin_memory()
    return sizes.to(device, non_blocking=True)


def detr_encoder(detector, batch_inputs, image_sizes, features=None):
    # ``features``: the backbone's and neck's outputs where another region computed them (``batch_inputs`` then
    # only carries the padded batch's height and width in its shape).
    img_feats = detector.extract_feat(batch_inputs) if features is None else features
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


class _GraphedLoss(NamedTuple):
    """A detector's training loss split around its captured region: ``region_inputs(batch_inputs, samples)`` gives
    the region's inputs and what the tail needs to know of them, ``region(*inputs)`` runs in the graph, and
    ``tail(outputs, constants, samples, context)`` computes the losses eagerly. ``region`` takes ``features=`` (the
    outputs of ``detector.extract_feat``) where ``splits_at_features``: its first input then only gives the batch's
    padded shape."""
    region: Callable
    region_inputs: Callable
    tail: Callable
    splits_at_features: bool = False


def _pixels_only(batch_inputs, batch_data_samples):
    return (batch_inputs,), None


def _pixels_and_image_sizes(batch_inputs, batch_data_samples):
    return (batch_inputs, image_sizes_tensor(batch_data_samples, batch_inputs.device)), None


def _region_and_tail(detector) -> Optional[_GraphedLoss]:
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
    return _GraphedLoss(network, region_inputs, tail)


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
            def whole_network(batch_inputs, image_sizes, features=None):
                encoder_outputs, decoder_inputs = detr_encoder(detector, batch_inputs, image_sizes, features)
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
            return _GraphedLoss(whole_network, _pixels_and_image_sizes, tail, splits_at_features=True)

        def transformer_only(batch_inputs, image_sizes, features=None):
            encoder_outputs, decoder_inputs = detr_encoder(detector, batch_inputs, image_sizes, features)
            return detr_decoder(detector, encoder_outputs, decoder_inputs), None

        def head_tail(head_inputs, _, batch_data_samples, __):
            return detector.bbox_head.loss(**head_inputs, batch_data_samples=batch_data_samples)
        return _GraphedLoss(transformer_only, _pixels_and_image_sizes, head_tail, splits_at_features=True)
    if transformer is DINO.forward_transformer:
        whole = _dino_graphed_loss(detector)
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
        return _GraphedLoss(backbone_and_encoder, _pixels_and_image_sizes, tail, splits_at_features=True)
    return None


def _denoising_queries(generator, batch_data_samples):
    """mmdet 3.3.0's ``CdnQueryGenerator.__call__`` without its attention mask (the padded one is made here):
    the label and box queries, each image's targets repeated in ``2 * num_groups`` groups, and the group size.
    The image-size factors are copied without blocking and the queries collated from the host's target counts
    (mmdet's ``new_tensor`` and its collation's reads of device counts each wait for the GPU); the same values."""
    gt_labels_list, gt_bboxes_list = [], []
    for sample in batch_data_samples:
        bboxes = sample.gt_instances.bboxes
        gt_bboxes_list.append(bboxes / image_size_factor(sample.metainfo, bboxes))
        gt_labels_list.append(sample.gt_instances.labels)
    gt_labels, gt_bboxes = torch.cat(gt_labels_list), torch.cat(gt_bboxes_list)
    max_num_target = max(len(bboxes) for bboxes in gt_bboxes_list)
    num_groups = generator.get_num_groups(max_num_target)
    label_query = generator.generate_dn_label_query(gt_labels, num_groups)
    bbox_query = generator.generate_dn_bbox_query(gt_bboxes, num_groups)
    batch_idx = torch.cat([torch.full_like(labels.long(), i) for i, labels in enumerate(gt_labels_list)])
    label_query, bbox_query = _collated_denoising_queries(generator, label_query, bbox_query, batch_idx,
                                                          [len(labels) for labels in gt_labels_list], num_groups)
    dn_meta = dict(num_denoising_queries=int(max_num_target * 2 * num_groups), num_denoising_groups=num_groups)
    return label_query, bbox_query, 2 * max_num_target, dn_meta


def _collated_denoising_queries(generator, label_query, bbox_query, batch_idx, num_targets, num_groups):
    """mmdet 3.3.0's ``CdnQueryGenerator.collate_dn_queries`` with each image's target count from the host (mmdet
    counts ``batch_idx == image`` on the device and reads the counts back)."""
    device = label_query.device
    max_num_target = max(num_targets)
    num_denoising_queries = int(max_num_target * 2 * num_groups)
    map_query_index = torch.cat([torch.arange(count, device=device) for count in num_targets])
    map_query_index = torch.cat([map_query_index + max_num_target * i for i in range(2 * num_groups)]).long()
    mapper = (batch_idx.repeat(2 * num_groups, 1).view(-1), map_query_index)
    batch_size = len(num_targets)
    batched_label_query = torch.zeros(batch_size, num_denoising_queries, generator.embed_dims, device=device)
    batched_bbox_query = torch.zeros(batch_size, num_denoising_queries, 4, device=device)
    batched_label_query[mapper] = label_query
    batched_bbox_query[mapper] = bbox_query
    return batched_label_query, batched_bbox_query


def padded_denoising_mask(num_denoising: int, group_size: int, padded: int, num_matching: int,
                          device) -> torch.Tensor:
    """DINO's self-attention mask (True: may not attend) for ``num_denoising`` denoising queries in groups of
    ``group_size``, padded with queries up to ``padded``, then ``num_matching`` matching queries. The real
    queries' mask is mmdet's ``generate_dn_mask`` (a denoising query sees its group and the matching queries, a
    matching query the matching queries); a padding query sees only itself, and no other query sees it."""
    index = torch.arange(padded + num_matching, device=device)
    denoising, matching = index < num_denoising, index >= padded
    group = index // max(group_size, 1)
    allowed = ((denoising[:, None] & ((denoising[None, :] & (group[:, None] == group[None, :])) | matching[None, :]))
               | (matching[:, None] & matching[None, :]) | (index[:, None] == index[None, :]))
    return ~allowed


# A batch's mask depends on its largest target count only: a few recent ones are kept (1.2 MB each for DINO's 1100
# queries), read by the graphs' input copies and never written.
_cached_denoising_mask = functools.lru_cache(maxsize=16)(padded_denoising_mask)


def _padded_denoising_count(generator, num_denoising: int) -> int:
    """A fixed count of denoising queries for most batches: dynamic groups give at most ``2 * num_dn_queries``
    (more only where an image has more targets than that); static ones grow in steps of 16 targets."""
    step = 64 if generator.dynamic_dn_groups else 2 * generator.num_groups * 16
    base = 2 * generator.num_dn_queries if generator.dynamic_dn_groups else step
    return base if num_denoising <= base else -(-num_denoising // step) * step


def _dino_graphed_loss(detector) -> Optional[_GraphedLoss]:
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

    def network(batch_inputs, image_sizes, dn_label_query, dn_bbox_query, dn_mask, features=None):
        encoder_outputs, decoder_inputs = detr_encoder(detector, batch_inputs, image_sizes, features)
        # mmdet 3.3.0's DINO.pre_decoder in training, with the denoising queries given.
        memory = encoder_outputs["memory"]
        num_layers = detector.decoder.num_layers
        output_memory, output_proposals = detector.gen_encoder_output_proposals(
            memory, encoder_outputs["memory_mask"], encoder_outputs["spatial_shapes"])
        enc_outputs_class = head.cls_branches[num_layers](output_memory)
        enc_outputs_coord_unact = head.reg_branches[num_layers](output_memory) + output_proposals
        topk_indices = torch.topk(enc_outputs_class.max(-1)[0], k=detector.num_queries, dim=1)[1]
        topk_score = torch.gather(enc_outputs_class, 1,
                                  topk_indices.unsqueeze(-1).repeat(1, 1, enc_outputs_class.shape[-1]))
        topk_coords_unact = torch.gather(enc_outputs_coord_unact, 1, topk_indices.unsqueeze(-1).repeat(1, 1, 4))
        topk_coords = topk_coords_unact.sigmoid()
        query = detector.query_embedding.weight[:, None, :].repeat(1, memory.shape[0], 1).transpose(0, 1)
        query = torch.cat([dn_label_query, query], dim=1)
        reference_points = torch.cat([dn_bbox_query, topk_coords_unact.detach()], dim=1).sigmoid()
        decoder_outputs = detector.forward_decoder(query=query, memory=memory, reference_points=reference_points,
                                                   dn_mask=dn_mask, **decoder_inputs)
        all_cls_scores, all_bbox_preds = head(decoder_outputs["hidden_states"], decoder_outputs["references"])
        return dict(all_cls_scores=all_cls_scores, all_bbox_preds=all_bbox_preds, enc_outputs_class=topk_score,
                    enc_outputs_coord=topk_coords), None

    def region_inputs(batch_inputs, batch_data_samples):
        label_query, bbox_query, group_size, dn_meta = _denoising_queries(generator, batch_data_samples)
        num_denoising = dn_meta["num_denoising_queries"]
        padded = _padded_denoising_count(generator, num_denoising)
        mask = _cached_denoising_mask(num_denoising, group_size, padded, detector.num_queries, batch_inputs.device)
        pad = (0, 0, 0, padded - num_denoising)
        inputs = (batch_inputs, image_sizes_tensor(batch_data_samples, batch_inputs.device),
                  torch.nn.functional.pad(label_query, pad), torch.nn.functional.pad(bbox_query, pad), mask)
        return inputs, (num_denoising, padded, dn_meta)

    def tail(outputs, _, batch_data_samples, context):
        num_denoising, padded, dn_meta = context

        def unpadded(per_layer):  # (layers, batch, queries, ...) without the padding queries
            return torch.cat([per_layer[:, :, :num_denoising], per_layer[:, :, padded:]], dim=2)
        batch_gt_instances = [sample.gt_instances for sample in batch_data_samples]
        batch_img_metas = [sample.metainfo for sample in batch_data_samples]
        return head.loss_by_feat(unpadded(outputs["all_cls_scores"]), unpadded(outputs["all_bbox_preds"]),
                                 outputs["enc_outputs_class"], outputs["enc_outputs_coord"], batch_gt_instances,
                                 batch_img_metas, dn_meta)
    return _GraphedLoss(network, region_inputs, tail, splits_at_features=True)


def _feature_module_names(detector) -> Tuple[str, ...]:
    return ("backbone", "neck") if getattr(detector, "with_neck", False) else ("backbone",)


def _in_modules(names: Tuple[str, ...]) -> Callable[[str], bool]:
    prefixes = tuple(f"{name}." for name in names)
    return lambda parameter: parameter.startswith(prefixes)


def enable_cuda_graph_training(detector, policy: Optional[CapturePolicy] = None, split_at_features: bool = False,
                               gradient_slots=None) -> Optional[GraphedRegion]:
    """Give one Deformable-DETR-family or Mask2Former detector (an instance with mmdet 3.3.0's pieces) the
    graph-replayed training loss; returns its :class:`GraphedRegion`, or None when the detector is not one this path
    knows. ``policy``: when an input shape is captured (:class:`~deform_plugin.cuda_graphs.CapturePolicy`; its
    default captures a shape at its second call).

    ``split_at_features`` (the DETRs; Mask2Former keeps one region): the backbone and neck are a region of their own,
    ahead of the rest of the network's. Under DistributedDataParallel this lets the gradients of the transformer
    and head, which the second region's backward replay returns first, be all-reduced while the backbone's backward
    replays (with one region every gradient arrives at the end of the backward, and no reduction overlaps it). On
    one GPU it only adds a region boundary (a copy of the features and of their gradients).

    ``gradient_slots``: the regions write the parameters' gradients into these slots and make them the ``.grad``
    (see :class:`.graphed_region.GraphedRegion`); not under DistributedDataParallel.
    """
    if "loss" in vars(detector):
        return None
    pieces = _region_and_tail(detector)
    if pieces is None:
        return None
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

        region = GraphedRegion(after_features, detector, name=f"{name} training transformer and head",
                               policy=policy, gradient_slots=gradient_slots,
                               parameter_filter=lambda parameter: not in_feature_modules(parameter))
    else:
        region = GraphedRegion(pieces.region, detector, name=f"{name} training forward", policy=policy,
                               gradient_slots=gradient_slots)
    stock_loss = type(detector).loss.__get__(detector)

    def loss(batch_inputs, batch_data_samples):
        if not torch.is_grad_enabled():
            return stock_loss(batch_inputs, batch_data_samples)
        inputs, context = pieces.region_inputs(batch_inputs, batch_data_samples)
        if features_region is not None:
            pixels, *others = inputs
            features, _ = features_region(pixels)
            if not feature_count:
                feature_count.append(len(features))
            # An empty tensor carries the padded height and width into the second region's signature.
            inputs = (pixels.new_empty((0,) + tuple(pixels.shape[-2:])), *features, *others)
        outputs, constants = region(*inputs)
        return pieces.tail(outputs, constants, batch_data_samples, context)

    detector.loss = loss
    detector.graphed_training_region = region
    detector.graphed_training_regions = (region,) if features_region is None else (features_region, region)
    return region


def enable_cuda_graphs(model, split_at_features: bool = False, gradient_slots=None,
                       policy: Optional[CapturePolicy] = None) -> int:
    """Turn the graph-replayed training loss on for every Deformable-DETR-family and Mask2Former detector in
    ``model``; returns how many detectors changed (``split_at_features``, ``gradient_slots``, ``policy``: see
    :func:`enable_cuda_graph_training`)."""
    return sum(enable_cuda_graph_training(module, policy=policy, split_at_features=split_at_features,
                                          gradient_slots=gradient_slots) is not None
               for module in model.modules())
