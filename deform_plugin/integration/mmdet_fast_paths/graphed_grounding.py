"""The ``cuda_graphs`` fast path for Grounding-DINO: BERT, the backbone, the fusion encoder, the decoder and the head's
branches replayed from CUDA graphs, matching and losses eager (the region mechanism: :mod:`.graphed_region`).

mmdet 3.3.0's ``GroundingDINO.loss`` reads the device where a capture cannot: its BERT (``BertModel.forward``)
tokenizes on the host and then builds the sub-sentence attention masks on the device with a ``nonzero`` and a Python
loop over its result. Those masks, the position ids and the token mask depend on the captions only, so here the same
function runs on the tokenizer's host tensors (the same integers and booleans) and its outputs enter the region as
inputs; BERT's forward is then fixed-shape per caption length. The captions, positive maps and denoising queries are
made eagerly as in mmdet (the denoising queries padded to a fixed count, as for DINO: :mod:`.graphed_training`), and
the padding is cut before the losses.

What differs from the eager step: the denoising queries' random noise is drawn before the region runs, where stock
draws it after the encoder, so random layers (Swin's drop path, the fusion layers' attention dropout, BERT's
dropout) draw other numbers than an eager step of the same seed (the same distributions; without them the replayed
losses and gradients are the eager ones to float rounding). Activation checkpointing (Swin's ``with_cp``, the
encoder's fairscale ``num_cp``, BERT's own) is reentrant, which the captured ``torch.autograd.grad`` backward
refuses: :func:`graph_blockers` names it, and ``FastPathsHook`` refuses ``cuda_graphs`` while it is on.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from .graphed_inputs import (GraphedLoss, cached_denoising_mask, denoising_queries, image_sizes_tensor,
                             padded_denoising_count)
from .matching import _to_device_without_blocking
from .sync_free_forward import deformable_detr_pre_transformer_from_image_sizes

__all__ = ["graph_blockers", "grounding_graphed_loss", "host_text_inputs"]

TEXT_INPUTS = ("input_ids", "attention_mask", "position_ids", "token_type_ids", "text_token_mask")


def _stock_pieces(detector) -> bool:
    from mmdet.models.dense_heads import DINOHead, GroundingDINOHead
    from mmdet.models.detectors import DINO, DeformableDETR, GroundingDINO
    from mmdet.models.language_models.bert import BertEncoder, BertModel
    from mmdet.models.layers import CdnQueryGenerator
    language, head = detector.language_model, detector.bbox_head
    generator = getattr(detector, "dn_query_generator", None)
    return (all(getattr(type(detector), name) is getattr(GroundingDINO, name)
                for name in ("loss", "forward_encoder", "pre_decoder", "get_tokens_and_prompts", "get_positive_map"))
            and type(detector).forward_decoder is DINO.forward_decoder
            and all(getattr(type(detector), name) is getattr(DeformableDETR, name)
                    for name in ("pre_transformer", "extract_feat"))
            and isinstance(language, BertModel) and type(language).forward is BertModel.forward
            and type(language.language_backbone.body).forward is BertEncoder.forward
            and language.use_sub_sentence_represent and detector.text_feat_map is not None
            and isinstance(head, GroundingDINOHead) and type(head).forward is GroundingDINOHead.forward
            and type(head).loss_by_feat is DINOHead.loss_by_feat
            and type(generator).__call__ is CdnQueryGenerator.__call__)


def graph_blockers(detector) -> List[str]:
    """What keeps a Grounding-DINO detector's training step out of CUDA graphs (nothing: an empty list)."""
    blockers = []
    if not _stock_pieces(detector):
        blockers.append("its detector, language model or head is not mmdet 3.3.0's GroundingDINO with BERT "
                        "sub-sentence masks")
    if any(getattr(module, "with_cp", False) for module in detector.modules()):
        blockers.append("the backbone's activation checkpointing (with_cp=True) is reentrant")
    if getattr(getattr(detector, "encoder", None), "num_cp", 0):
        blockers.append("the encoder's fairscale activation checkpointing (num_cp > 0) is reentrant")
    bert = getattr(getattr(getattr(detector.language_model, "language_backbone", None), "body", None), "model", None)
    if getattr(bert, "is_gradient_checkpointing", False):
        blockers.append("BERT's gradient checkpointing is on")
    return blockers


def host_text_inputs(language_model, captions, device) -> dict:
    """mmdet 3.3.0's ``BertModel.forward`` up to BERT itself, on the host: the tokenizer's ids and token types, the
    sub-sentence attention masks and position ids, and the token mask, each copied to ``device`` without blocking."""
    from mmdet.models.language_models.bert import generate_masks_with_special_tokens_and_transfer_map
    tokenized = language_model.tokenizer.batch_encode_plus(
        captions, max_length=language_model.max_tokens,
        padding="max_length" if language_model.pad_to_max else "longest", return_special_tokens_mask=True,
        return_tensors="pt", truncation=True)
    attention_mask, position_ids = generate_masks_with_special_tokens_and_transfer_map(
        tokenized, language_model.special_tokens)
    host = dict(input_ids=tokenized.input_ids, attention_mask=attention_mask, position_ids=position_ids,
                token_type_ids=tokenized["token_type_ids"], text_token_mask=tokenized.attention_mask.bool())
    return {name: _to_device_without_blocking(host[name], device) for name in TEXT_INPUTS}


def _captions_and_positive_maps(detector, batch_data_samples):
    """mmdet 3.3.0's ``GroundingDINO.loss`` before its language model: each image's caption and its gts' positive
    maps (on the host)."""
    text_prompts = [sample.text for sample in batch_data_samples]
    gt_labels = [sample.gt_instances.labels for sample in batch_data_samples]
    pad = "max_length" if detector.language_model.pad_to_max else "longest"
    captions, positive_maps = [], []
    if "tokens_positive" in batch_data_samples[0]:
        for sample, text_prompt, labels in zip(batch_data_samples, text_prompts, gt_labels):
            tokenized = detector.language_model.tokenizer([text_prompt], padding=pad, return_tensors="pt")
            positive = [sample.tokens_positive[label.item()] for label in labels]
            positive_maps.append(detector.get_positive_map(tokenized, positive)[1])
        return text_prompts, positive_maps
    shared = len(set(text_prompts)) == 1  # one caption for all: tokenized once, as stock does
    if shared:
        tokenized, caption, tokens_positive, _ = detector.get_tokens_and_prompts(text_prompts[0], True)
    for text_prompt, labels in zip(text_prompts, gt_labels):
        if not shared:
            tokenized, caption, tokens_positive, _ = detector.get_tokens_and_prompts(text_prompt, True)
        positive_maps.append(detector.get_positive_map(tokenized, [tokens_positive[label] for label in labels])[1])
        captions.append(caption)
    return captions, positive_maps


def grounding_graphed_loss(detector) -> Optional[GraphedLoss]:
    """Grounding-DINO's training step split around its captured region (see the module's doc); None where a piece
    differs from mmdet 3.3.0's or checkpointing is on (:func:`graph_blockers`)."""
    if graph_blockers(detector):
        return None
    head, generator, language = detector.bbox_head, detector.dn_query_generator, detector.language_model

    def network(batch_inputs, image_sizes, input_ids, attention_mask, position_ids, token_type_ids, text_token_mask,
                dn_label_query, dn_bbox_query, dn_mask, features=None):
        # mmdet 3.3.0's BertModel.forward from BERT on, then GroundingDINO.loss's text feature map.
        text_dict = language.language_backbone(dict(input_ids=input_ids, attention_mask=attention_mask,
                                                    position_ids=position_ids, token_type_ids=token_type_ids))
        text_dict.update(position_ids=position_ids, text_token_mask=text_token_mask,
                         embedded=detector.text_feat_map(text_dict["embedded"]))
        img_feats = detector.extract_feat(batch_inputs) if features is None else features
        encoder_inputs, decoder_inputs = deformable_detr_pre_transformer_from_image_sizes(
            detector, img_feats, image_sizes, batch_inputs.shape[-2], batch_inputs.shape[-1])
        encoder_outputs = detector.forward_encoder(**encoder_inputs, text_dict=text_dict)
        # mmdet 3.3.0's GroundingDINO.pre_decoder in training, with the denoising queries given.
        memory, memory_text = encoder_outputs["memory"], encoder_outputs["memory_text"]
        num_layers = detector.decoder.num_layers
        output_memory, output_proposals = detector.gen_encoder_output_proposals(
            memory, encoder_outputs["memory_mask"], encoder_outputs["spatial_shapes"])
        cls_branch = head.cls_branches[num_layers]
        enc_outputs_class = cls_branch(output_memory, memory_text, text_token_mask)
        enc_outputs_coord_unact = head.reg_branches[num_layers](output_memory) + output_proposals
        topk_indices = torch.topk(enc_outputs_class.max(-1)[0], k=detector.num_queries, dim=1)[1]
        topk_score = torch.gather(enc_outputs_class, 1,
                                  topk_indices.unsqueeze(-1).repeat(1, 1, cls_branch.max_text_len))
        topk_coords_unact = torch.gather(enc_outputs_coord_unact, 1, topk_indices.unsqueeze(-1).repeat(1, 1, 4))
        query = detector.query_embedding.weight[:, None, :].repeat(1, memory.shape[0], 1).transpose(0, 1)
        query = torch.cat([dn_label_query, query], dim=1)
        reference_points = torch.cat([dn_bbox_query, topk_coords_unact.detach()], dim=1).sigmoid()
        decoder_outputs = detector.forward_decoder(query=query, memory=memory, reference_points=reference_points,
                                                   dn_mask=dn_mask, memory_text=memory_text,
                                                   text_attention_mask=~text_token_mask, **decoder_inputs)
        all_cls_scores, all_bbox_preds = head(decoder_outputs["hidden_states"], decoder_outputs["references"],
                                              memory_text, text_token_mask)
        return dict(all_cls_scores=all_cls_scores, all_bbox_preds=all_bbox_preds, enc_outputs_class=topk_score,
                    enc_outputs_coord=topk_coords_unact.sigmoid()), None

    def region_inputs(batch_inputs, batch_data_samples):
        device = batch_inputs.device
        captions, positive_maps = _captions_and_positive_maps(detector, batch_data_samples)
        text = host_text_inputs(language, captions, device)
        for index, sample in enumerate(batch_data_samples):
            positive_map = _to_device_without_blocking(positive_maps[index], device).bool().float()
            sample.gt_instances.positive_maps = positive_map
            sample.gt_instances.text_token_mask = text["text_token_mask"][index].unsqueeze(0).repeat(
                len(positive_map), 1)
        label_query, bbox_query, group_size, dn_meta = denoising_queries(generator, batch_data_samples)
        num_denoising = dn_meta["num_denoising_queries"]
        padded = padded_denoising_count(generator, num_denoising)
        mask = cached_denoising_mask(num_denoising, group_size, padded, detector.num_queries, device)
        pad = (0, 0, 0, padded - num_denoising)
        inputs = (batch_inputs, image_sizes_tensor(batch_data_samples, device), *(text[name] for name in TEXT_INPUTS),
                  torch.nn.functional.pad(label_query, pad), torch.nn.functional.pad(bbox_query, pad), mask)
        return inputs, (num_denoising, padded, dn_meta, text["text_token_mask"])

    def tail(outputs, _, batch_data_samples, context):
        num_denoising, padded, dn_meta, text_token_mask = context

        def unpadded(per_layer):  # (layers, batch, queries, ...) without the padding queries
            return torch.cat([per_layer[:, :, :num_denoising], per_layer[:, :, padded:]], dim=2)
        head.text_masks = text_token_mask  # what GroundingDINOHead.loss sets for its per-layer losses
        return head.loss_by_feat(unpadded(outputs["all_cls_scores"]), unpadded(outputs["all_bbox_preds"]),
                                 outputs["enc_outputs_class"], outputs["enc_outputs_coord"],
                                 [sample.gt_instances for sample in batch_data_samples],
                                 [sample.metainfo for sample in batch_data_samples], dn_meta)
    return GraphedLoss(network, region_inputs, tail, splits_at_features=True)
