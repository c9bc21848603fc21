"""Feature buckets: the DETRs' transformer and head captured per padded feature-map shape, exactly.

Without ``ShapeBucketsHook`` nearly every training batch of a random-resize pipeline has a shape of its own, and a
graph captured per batch shape is rarely replayed. Padding the *images* further (the hook) makes shapes recur but
changes the backbone's features near the border. Padding the *feature maps* does not change them: the backbone and
neck run at the batch's own shape (:mod:`.graphed_training`'s features region), and each level's map and padding
mask are then padded with masked cells up to a bucket (both sides rounded up to ``size_divisor / stride`` cells). The
transformer and head, captured per bucket, replay for every batch shape that falls into it.

Why the outputs are the unpadded ones (mmdet 3.3.0's Deformable-DETR and DINO, up to float rounding):

- attention reads values through the padding mask (masked values are zero), and an added cell lies past the
  unpadded map, where the MSDA kernel reads zeros anyway; a masked query's output is never read by a valid one;
- sampling points land on the same pixels: the encoder's reference points divide by the valid size (valid ratio
  times the padded size) and the kernel multiplies by the padded size again, and the offsets are normalised by the
  padded size and multiplied back by it; the positional encodings and the two-stage proposals are made from the
  valid cells' counts, which padding leaves alone;
- what would see the padding is handled here: the two-stage top-k of proposals excludes the added tokens (they
  would compete with the real ones, scored like stock's own padding tokens), the losses over every encoder token
  (Deformable-DETR two-stage's) see the unpadded tokens in stock's order (:func:`unpadded_token_outputs`), and DINO's
  decoder makes its query positions from the reference points scaled by the unpadded level-0 valid ratios, as stock
  does (:func:`dino_forward_decoder`; the sampling uses the padded ones).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Sequence, Tuple

import torch
import torch.nn.functional as F

from deform_plugin.ops.msda import host_spatial_shapes

from .sync_free_forward import level_masks_from_image_sizes


class PaddedLevels(NamedTuple):
    """A batch's feature levels padded to their bucket: the maps (zeros added), the padding masks (True added), each
    level's unpadded (height, width) on the device, and each unpadded token's index among the padded tokens."""
    features: Tuple[torch.Tensor, ...]
    masks: Tuple[torch.Tensor, ...]
    unpadded_shapes: torch.Tensor
    token_index: torch.Tensor


def level_stride(batch_side: int, level_side: int) -> int:
    """A level's stride in input pixels: the power of two nearest ``batch_side / level_side``."""
    return 2 ** max(0, round(math.log2(max(batch_side, 1) / max(level_side, 1))))


def bucketed_level_shape(shape: Sequence[int], batch_shape: Sequence[int], size_divisor: int) -> Tuple[int, int]:
    """A level's padded (height, width): each side rounded up to ``size_divisor`` input pixels' worth of cells."""
    padded = []
    for side, batch_side in zip(shape, batch_shape):
        cells = max(1, size_divisor // level_stride(batch_side, side))
        padded.append(-(-int(side) // cells) * cells)
    return padded[0], padded[1]


@functools.lru_cache(maxsize=512)
def _host_tables(unpadded: Tuple[Tuple[int, int], ...], padded: Tuple[Tuple[int, int], ...]):
    index, start = [], 0
    for (h, w), (hp, wp) in zip(unpadded, padded):
        rows = torch.arange(h).view(-1, 1) * wp
        index.append((start + rows + torch.arange(w).view(1, -1)).flatten())
        start += hp * wp
    return torch.tensor(unpadded, dtype=torch.int64), torch.cat(index)


@functools.lru_cache(maxsize=512)
def _device_tables(unpadded, padded, device):
    shapes, index = _host_tables(unpadded, padded)
    return shapes.to(device), index.to(device)


def pad_levels(features: Sequence[torch.Tensor], image_sizes: torch.Tensor, batch_shape: Sequence[int],
               size_divisor: int) -> PaddedLevels:
    """``features`` (the neck's levels of a ``batch_shape`` batch whose images have ``image_sizes``) and their
    padding masks (stock's: made at the levels' own shapes) padded to their bucket."""
    masks = level_masks_from_image_sizes([feat.shape[-2:] for feat in features], image_sizes, int(batch_shape[0]),
                                         int(batch_shape[1]), features[0].dtype)
    unpadded = tuple((int(feat.shape[-2]), int(feat.shape[-1])) for feat in features)
    padded = tuple(bucketed_level_shape(shape, batch_shape, size_divisor) for shape in unpadded)
    padded_features, padded_masks = [], []
    for feat, mask, (h, w), (hp, wp) in zip(features, masks, unpadded, padded):
        padding = (0, wp - w, 0, hp - h)
        padded_features.append(F.pad(feat, padding))
        padded_masks.append(F.pad(mask, padding, value=True))
    shapes, index = _device_tables(unpadded, padded, features[0].device)
    return PaddedLevels(tuple(padded_features), tuple(padded_masks), shapes, index)


def added_tokens(spatial_shapes: torch.Tensor, unpadded_shapes: torch.Tensor) -> torch.Tensor:
    """``(tokens,)`` bool: which of the padded levels' flattened tokens lie past the unpadded maps (made on the
    device from ``unpadded_shapes``, so that a captured graph serves every unpadded shape of its bucket)."""
    added = []
    device = unpadded_shapes.device
    for level, (h, w) in enumerate(host_spatial_shapes(spatial_shapes)):
        rows = torch.arange(h, device=device).view(-1, 1) >= unpadded_shapes[level, 0]
        cols = torch.arange(w, device=device).view(1, -1) >= unpadded_shapes[level, 1]
        added.append((rows | cols).flatten())
    return torch.cat(added)


def unpadded_valid_ratios(level_masks: Sequence[torch.Tensor], unpadded_shapes: torch.Tensor) -> torch.Tensor:
    """``(batch, levels, 2)``: mmdet's ``get_valid_ratio`` of each level as the unpadded map gives it (the valid
    cells over the unpadded sides)."""
    ratios = []
    for level, mask in enumerate(level_masks):
        valid_h = torch.sum(~mask[:, :, 0], 1)
        valid_w = torch.sum(~mask[:, 0, :], 1)
        height, width = unpadded_shapes[level, 0].float(), unpadded_shapes[level, 1].float()
        ratios.append(torch.stack([valid_w.float() / width, valid_h.float() / height], -1))
    return torch.stack(ratios, 1)


def unpadded_token_outputs(outputs: dict, names: Sequence[str], token_index: torch.Tensor) -> dict:
    """``outputs`` with those of ``names`` (``(batch, padded tokens, ...)``) cut back to the unpadded tokens, in
    stock's order."""
    return {name: value.index_select(1, token_index) if name in names and value is not None else value
            for name, value in outputs.items()}


def two_stage_pre_decoder(detector, memory, memory_mask, spatial_shapes, excluded_tokens):
    """mmdet 3.3.0's ``DeformableDETR.pre_decoder`` (two-stage, training) with ``excluded_tokens`` left out of the
    top-k of proposals."""
    c = memory.shape[-1]
    output_memory, output_proposals = detector.gen_encoder_output_proposals(memory, memory_mask, spatial_shapes)
    num_layers = detector.decoder.num_layers
    enc_outputs_class = detector.bbox_head.cls_branches[num_layers](output_memory)
    enc_outputs_coord_unact = detector.bbox_head.reg_branches[num_layers](output_memory) + output_proposals
    enc_outputs_coord = enc_outputs_coord_unact.sigmoid()
    scores = enc_outputs_class[..., 0].masked_fill(excluded_tokens, float("-inf"))
    topk_proposals = torch.topk(scores, detector.num_queries, dim=1)[1]
    topk_coords_unact = torch.gather(enc_outputs_coord_unact, 1, topk_proposals.unsqueeze(-1).repeat(1, 1, 4))
    topk_coords_unact = topk_coords_unact.detach()
    reference_points = topk_coords_unact.sigmoid()
    pos_trans_out = detector.pos_trans_norm(detector.pos_trans_fc(detector.get_proposal_pos_embed(topk_coords_unact)))
    query_pos, query = torch.split(pos_trans_out, c, dim=2)
    decoder_inputs = dict(query=query, query_pos=query_pos, memory=memory, reference_points=reference_points)
    return decoder_inputs, dict(enc_outputs_class=enc_outputs_class, enc_outputs_coord=enc_outputs_coord)


def dino_topk_proposals(detector, memory, memory_mask, spatial_shapes, excluded_tokens=None):
    """mmdet 3.3.0's ``DINO.pre_decoder`` up to its top-k: the selected proposals' class scores and unactivated
    boxes, with ``excluded_tokens`` (where given) left out of the top-k."""
    head = detector.bbox_head
    num_layers = detector.decoder.num_layers
    output_memory, output_proposals = detector.gen_encoder_output_proposals(memory, memory_mask, spatial_shapes)
    enc_outputs_class = head.cls_branches[num_layers](output_memory)
    enc_outputs_coord_unact = head.reg_branches[num_layers](output_memory) + output_proposals
    scores = enc_outputs_class.max(-1)[0]
    if excluded_tokens is not None:
        scores = scores.masked_fill(excluded_tokens, float("-inf"))
    topk_indices = torch.topk(scores, k=detector.num_queries, dim=1)[1]
    topk_score = torch.gather(enc_outputs_class, 1,
                              topk_indices.unsqueeze(-1).repeat(1, 1, enc_outputs_class.shape[-1]))
    topk_coords_unact = torch.gather(enc_outputs_coord_unact, 1, topk_indices.unsqueeze(-1).repeat(1, 1, 4))
    return topk_score, topk_coords_unact


def dino_forward_decoder(detector, query, memory, memory_mask, reference_points, spatial_shapes, level_start_index,
                         valid_ratios, dn_mask, query_position_ratios):
    """mmdet 3.3.0's ``DINO.forward_decoder`` and ``DinoTransformerDecoder.forward`` with each layer's query
    positions made from the reference points scaled by ``query_position_ratios`` (the unpadded maps' valid ratios),
    the sampling points by ``valid_ratios`` (the padded maps')."""
    from mmdet.models.layers.transformer.utils import coordinate_to_encoding, inverse_sigmoid
    decoder = detector.decoder
    reg_branches = detector.bbox_head.reg_branches
    sampling_ratios = torch.cat([valid_ratios, valid_ratios], -1)[:, None]
    position_ratios = torch.cat([query_position_ratios, query_position_ratios], -1)[:, None]
    intermediate, intermediate_reference_points = [], [reference_points]
    for lid, layer in enumerate(decoder.layers):
        reference_points_input = reference_points[:, :, None] * sampling_ratios
        query_sine_embed = coordinate_to_encoding((reference_points[:, :, None] * position_ratios)[:, :, 0, :])
        query_pos = decoder.ref_point_head(query_sine_embed)
        query = layer(query, query_pos=query_pos, value=memory, key_padding_mask=memory_mask,
                      self_attn_mask=dn_mask, spatial_shapes=spatial_shapes, level_start_index=level_start_index,
                      valid_ratios=valid_ratios, reference_points=reference_points_input)
        new_reference_points = (reg_branches[lid](query) + inverse_sigmoid(reference_points, eps=1e-3)).sigmoid()
        reference_points = new_reference_points.detach()
        if decoder.return_intermediate:
            intermediate.append(decoder.norm(query))
            intermediate_reference_points.append(new_reference_points)
    if decoder.return_intermediate:
        inter_states, references = torch.stack(intermediate), torch.stack(intermediate_reference_points)
    else:
        inter_states, references = query, reference_points
    if len(query) == detector.num_queries:  # mmdet's test, kept as it is
        inter_states[0] += detector.dn_query_generator.label_embedding.weight[0, 0] * 0.0
    return dict(hidden_states=inter_states, references=list(references))


def pads_deformable_detr_decoder(detector) -> bool:
    """Whether ``detector``'s decoder is mmdet 3.3.0's ``DeformableDetrTransformerDecoder`` (its query positions do
    not depend on the padding)."""
    from mmdet.models.layers import DeformableDetrTransformerDecoder
    return type(detector.decoder).forward is DeformableDetrTransformerDecoder.forward


def pads_dino_decoder(detector) -> bool:
    """Whether ``detector``'s decoder is mmdet 3.3.0's ``DinoTransformerDecoder`` (what :func:`dino_forward_decoder`
    mirrors)."""
    from mmdet.models.layers import DinoTransformerDecoder
    return type(detector.decoder).forward is DinoTransformerDecoder.forward
