"""DDQ-DETR's distinct queries selected on the device, with fixed shapes: its whole inference forward can be one
CUDA graph.

mmdet 3.3.0's DDQ-DETR keeps its queries distinct with NMS, image by image: ``DDQDETR.pre_decoder`` takes the first
``num_queries`` boxes that NMS keeps of the encoder's proposals, and ``DDQTransformerDecoder.select_distinct_queries``
masks, between decoder layers, every query that NMS drops. Each call goes through mmcv's ``batched_nms`` with one
class id for every box, which returns a data-dependent number of indices (a host synchronisation, and a shape a
graph cannot hold). Here both use :func:`deform_plugin.ops.greedy_nms_first_kept`, which keeps the same boxes in
a fixed-size index tensor:

- the boxes NMS compares are ``batched_nms``'s: shifted by their largest coordinate plus one (its offset for class
  id 1), computed in the boxes' dtype, then compared in float32 (mmcv's kernels take float32) by mmcv's CUDA
  kernel's test, ``inter > iou_threshold * union``; the scores in float32 (what ``float32_nms`` gives under
  autocast), visited in descending order: before the decoder in the order of the kernels' own sort of each image's
  scores (:func:`kernel_visit_ranks`), so that exact ties fall as mmcv orders them;
- ``pre_decoder`` (inference): the first ``num_queries`` kept proposals' class scores, coordinates and mapped memory
  are gathered at once for the batch, zeros after the last kept one (``align_tensor``'s padding);
- ``select_distinct_queries`` (training and inference): the active queries are those of the first row of each
  image's mask, as mmdet reads them; the kept ones open their rows and columns, every other cell is masked;
- :func:`training_pre_decoder_sync_free`: ``pre_decoder`` in training, as a captured training region calls it
  (the dense queries besides the distinct ones, the denoising queries given).

The selection is mmdet's up to three things: between decoder layers exactly tied scores are visited in index
order, where mmcv's unstable sort of the active queries may put another of them first (of tied boxes that overlap
beyond the threshold, the other one is then kept); before the decoder, from ``split_thr`` proposals on (mmcv then
sorts the kept boxes' scores once more), tied kept proposals may fall in another order across the ``num_queries``-th
place; and an IoU within float32 rounding of the threshold may fall the other way than mmcv's CPU kernel's
``inter / union > iou_threshold`` decides. mmdet's methods stay the fallback for configurations this does not mirror
(another NMS type, class-agnostic NMS, a ``max_num``).
"""
from __future__ import annotations

import functools
import types
from typing import Optional

import torch
from torch import nn

from deform_plugin.ops import greedy_nms_first_kept

from .ddq_nms import method_with_float32_nms

__all__ = ["distinct_query_rows", "enable_sync_free_distinct_queries", "kernel_visit_ranks",
           "nms_boxes_like_batched_nms", "selects_distinct_queries_sync_free", "training_pre_decoder_sync_free"]

_MIRRORED_DQS_KEYS = {"type", "iou_threshold", "split_thr", "class_agnostic"}


def nms_boxes_like_batched_nms(boxes: torch.Tensor, valid: Optional[torch.Tensor]) -> torch.Tensor:
    """``boxes`` ``(B, N, 4)`` as mmcv's ``batched_nms`` hands them to NMS for one class id (1) per box: shifted by
    the largest coordinate of the image's boxes (the ``valid`` ones) plus one, in their own dtype (at least
    float32), then float32."""
    boxes = boxes.to(torch.promote_types(boxes.dtype, torch.float32))
    if valid is None:
        largest = boxes.amax(dim=(1, 2), keepdim=True)
    else:
        largest = torch.where(valid[..., None], boxes, float("-inf")).amax(dim=(1, 2), keepdim=True)
        largest = torch.where(torch.isfinite(largest), largest, torch.zeros_like(largest))  # no valid box at all
    return (boxes + (largest + 1)).float()


def _iou_threshold(cache_dict) -> Optional[float]:
    """The IoU threshold of DDQ-DETR's ``dqs_cfg`` where it is a configuration this module mirrors, else None."""
    config = cache_dict.get("dqs_cfg")
    if not isinstance(config, dict) or set(config) - _MIRRORED_DQS_KEYS or config.get("type", "nms") != "nms" \
            or config.get("class_agnostic", False) or "iou_threshold" not in config:
        return None
    return float(config["iou_threshold"])


def _mmcv_score_order(scores: torch.Tensor) -> torch.Tensor:
    """``(B, N)`` indices: each image's scores sorted as mmcv sorts them (its NMS kernels' ``scores.sort(0,
    descending=True)``, and ``batched_nms`` without an NMS config), in at least float32 as ``float32_nms`` passes
    them: the same call, so exactly tied scores (a padded image's padding tokens) fall as they do in stock."""
    key = scores.to(torch.promote_types(scores.dtype, torch.float32))
    return torch.stack([image_scores.sort(descending=True).indices for image_scores in key])


def kernel_visit_ranks(scores: torch.Tensor) -> torch.Tensor:
    """``(B, N)`` float32 scores that :func:`greedy_nms_first_kept` visits in the order mmcv's NMS kernels visit
    each image's boxes (:func:`_mmcv_score_order`), made strictly decreasing ranks, so that exactly tied scores fall
    as the kernels order them, not in index order."""
    order = _mmcv_score_order(scores)
    count = order.shape[1]
    ranks = torch.arange(count, 0, -1, dtype=torch.float32, device=scores.device).expand_as(order)
    return torch.empty_like(ranks).scatter_(1, order, ranks)


def _kept_mask(kept: torch.Tensor, count: int) -> torch.Tensor:
    """``(B, count)`` bools from :func:`greedy_nms_first_kept`'s indices (-1: none), without a host read."""
    slots = torch.where(kept >= 0, kept, torch.full_like(kept, count))
    mask = torch.zeros(kept.shape[0], count + 1, dtype=torch.bool, device=kept.device)
    return mask.scatter_(1, slots, True)[:, :count]


def select_distinct_queries_sync_free(self, reference_points: torch.Tensor, query: torch.Tensor,
                                      self_attn_mask: torch.Tensor, layer_index: int) -> torch.Tensor:
    """mmdet 3.3.0's ``DDQTransformerDecoder.select_distinct_queries`` for the whole batch at once (see the
    module)."""
    from mmdet.structures.bbox import bbox_cxcywh_to_xyxy
    heads = self.cache_dict["num_heads"]
    dis_start, num_dis = self.cache_dict["dis_query_info"]
    distinct = slice(dis_start, dis_start + num_dis)
    dis_mask = self_attn_mask[:, distinct, distinct]
    scores = self.cache_dict["cls_branches"][layer_index](query[:, distinct]).sigmoid().max(-1).values
    proposals = bbox_cxcywh_to_xyxy(reference_points[:, distinct])
    # mmdet reads each image's active queries from its first head's first row.
    active = ~dis_mask[::heads, 0]
    kept, _ = greedy_nms_first_kept(nms_boxes_like_batched_nms(proposals, active), scores.float(), active,
                                    _iou_threshold(self.cache_dict), max_kept=num_dis)
    keep = _kept_mask(kept, num_dis)
    # A kept query's row and column are open; every other cell is masked.
    attn_mask = ~(keep[:, :, None] | keep[:, None, :])
    attn_mask = attn_mask.repeat_interleave(heads, dim=0)
    self_attn_mask = self_attn_mask.clone()
    self_attn_mask[:, distinct, distinct] = attn_mask
    self.cache_dict["distinct_query_mask"].append(~attn_mask)
    return self_attn_mask


def _gather_rows(values: torch.Tensor, index: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    rows = values.gather(1, index[..., None].expand(-1, -1, values.shape[-1]))
    return torch.where(present[..., None], rows, torch.zeros_like(rows))


@functools.cache
def _stock_pre_decoder_with_float32_nms():
    # Training keeps mmdet's method, its NMS in float32 (float32_nms: a no-op in float32, and it runs under
    # autocast where mmdet's fails).
    from mmdet.models.detectors import DDQDETR
    return method_with_float32_nms(DDQDETR.pre_decoder)


def pre_decoder_sync_free(self, memory: torch.Tensor, memory_mask: torch.Tensor, spatial_shapes: torch.Tensor,
                          batch_data_samples=None):
    """mmdet 3.3.0's ``DDQDETR.pre_decoder`` in inference for the whole batch at once (see the module); in
    training mmdet's own, with its NMS in float32."""
    if self.training:
        return _stock_pre_decoder_with_float32_nms()(self, memory, memory_mask, spatial_shapes, batch_data_samples)
    output_memory, output_proposals = self.gen_encoder_output_proposals(memory, memory_mask, spatial_shapes)
    _, query, topk_coords_unact = _distinct_proposals(self, self.query_map(memory.detach()), output_memory,
                                                      output_proposals)
    self.cache_dict["dis_query_info"] = [0, self.num_queries]
    decoder_inputs_dict = dict(query=query, memory=memory, reference_points=topk_coords_unact.detach().sigmoid(),
                               dn_mask=None)
    return decoder_inputs_dict, dict()


def _distinct_proposals(detector, map_memory: torch.Tensor, output_memory: torch.Tensor,
                        output_proposals: torch.Tensor):
    """The first ``num_queries`` encoder proposals that NMS keeps, for the whole batch: their class scores, mapped
    memory (rows of ``map_memory``, the detector's ``query_map`` of its memory) and unactivated boxes, zeros after
    the last kept one (``align_tensor``'s padding)."""
    from mmdet.structures.bbox import bbox_cxcywh_to_xyxy
    head = detector.bbox_head
    num_layers = detector.decoder.num_layers
    enc_outputs_class = head.cls_branches[num_layers](output_memory)
    enc_outputs_coord_unact = head.reg_branches[num_layers](output_memory) + output_proposals
    proposals = bbox_cxcywh_to_xyxy(enc_outputs_coord_unact.sigmoid())
    scores = enc_outputs_class.max(-1)[0].sigmoid()
    kept, _ = greedy_nms_first_kept(nms_boxes_like_batched_nms(proposals, None), kernel_visit_ranks(scores), None,
                                    _iou_threshold(detector.cache_dict), max_kept=detector.num_queries)
    present, index = kept >= 0, kept.clamp(min=0)
    return (_gather_rows(enc_outputs_class, index, present),
            _gather_rows(map_memory, index, present),
            _gather_rows(enc_outputs_coord_unact, index, present))


def training_pre_decoder_sync_free(detector, memory: torch.Tensor, memory_mask: torch.Tensor,
                                   spatial_shapes: torch.Tensor, dn_label_query: torch.Tensor,
                                   dn_bbox_query: torch.Tensor, dn_mask: torch.Tensor):
    """mmdet 3.3.0's ``DDQDETR.pre_decoder`` in training for the whole batch at once, on fixed shapes, with the
    denoising queries and their attention mask given (made before a captured region, possibly padded; see
    :mod:`.graphed_training`): the distinct queries as in inference (the first ``num_queries`` proposals that NMS
    keeps, zeros after the last), the dense ones the first ``int(num_queries * dense_topk_ratio)`` tokens by the
    dense branch's score (what mmcv's ``batched_nms`` without an NMS config returns: each image's scores sorted by
    the same call), and the attention mask extended by the dense queries, which see only each other. Returns mmdet's
    decoder and head inputs; sets the shared ``cache_dict``'s query layout."""
    head, cache = detector.bbox_head, detector.cache_dict
    output_memory, output_proposals = detector.gen_encoder_output_proposals(memory, memory_mask, spatial_shapes)
    map_memory = detector.query_map(memory.detach())
    topk_score, query, coords_unact = _distinct_proposals(detector, map_memory, output_memory, output_proposals)
    dense_enc_outputs_class = head.cls_branches[-1](output_memory)
    dense_enc_outputs_coord_unact = head.reg_branches[-1](output_memory) + output_proposals
    topk = detector.num_queries
    num_dense = min(int(topk * detector.dense_topk_ratio), memory.shape[1])
    dense_index = _mmcv_score_order(dense_enc_outputs_class.max(-1)[0].sigmoid())[:, :num_dense]
    everywhere = torch.ones_like(dense_index, dtype=torch.bool)
    dense_topk_score = _gather_rows(dense_enc_outputs_class, dense_index, everywhere)
    query = torch.cat([query, _gather_rows(map_memory, dense_index, everywhere)], dim=1)
    coords_unact = torch.cat([coords_unact, _gather_rows(dense_enc_outputs_coord_unact, dense_index, everywhere)],
                             dim=1)
    coords = coords_unact.sigmoid()
    topk_coords, dense_topk_coords = coords[:, :-num_dense], coords[:, -num_dense:]
    query = torch.cat([dn_label_query, query], dim=1)
    reference_points = torch.cat([dn_bbox_query, coords_unact.detach()], dim=1).sigmoid()
    size = dn_mask.shape[-1]
    extended_mask = dn_mask.new_ones((size + num_dense, size + num_dense))
    extended_mask[size:, size:] = False
    extended_mask[:size, :size] = dn_mask
    cache["dis_query_info"] = [dn_label_query.shape[1], topk]
    cache["num_dense_queries"] = num_dense
    detector.decoder.aux_reg_branches = head.aux_reg_branches
    decoder_inputs = dict(query=query, memory=memory, reference_points=reference_points, dn_mask=extended_mask)
    head_inputs = dict(enc_outputs_class=topk_score, enc_outputs_coord=topk_coords,
                       aux_enc_outputs_class=dense_topk_score, aux_enc_outputs_coord=dense_topk_coords)
    return decoder_inputs, head_inputs


def distinct_query_rows(detector) -> torch.Tensor:
    """``(B, num_queries)``: the last decoder layer's distinct queries of each image, as mmdet's head reads them
    in ``predict_by_feat`` (a graph's output, for the post-processing after a replay)."""
    cache = detector.cache_dict
    return cache["distinct_query_mask"][-1][::cache["num_heads"], 0]


def restore_distinct_query_rows(detector, rows: torch.Tensor) -> None:
    """Put ``rows`` (:func:`distinct_query_rows` of a replay) where mmdet's ``predict_by_feat`` reads them."""
    heads = detector.cache_dict["num_heads"]
    detector.cache_dict["distinct_query_mask"] = [rows.repeat_interleave(heads, dim=0)[:, None, :]]


def selects_distinct_queries_sync_free(detector) -> bool:
    """Whether ``detector``'s ``pre_decoder`` and its decoder's ``select_distinct_queries`` are this module's."""
    decoder = getattr(detector, "decoder", None)
    return (getattr(vars(detector).get("pre_decoder"), "__func__", None) is pre_decoder_sync_free
            and decoder is not None
            and getattr(vars(decoder).get("select_distinct_queries"), "__func__", None)
            is select_distinct_queries_sync_free)


def enable_sync_free_distinct_queries(model: nn.Module) -> int:
    """Give every DDQ-DETR of ``model`` whose classes keep mmdet's ``pre_decoder`` and ``select_distinct_queries``
    (``float32_nms``' instance methods are replaced: this pair decides in float32 too), and whose ``dqs_cfg`` this
    module mirrors, the sync-free pair (see the module); returns how many detectors changed."""
    from mmdet.models.detectors import DDQDETR
    from mmdet.models.layers import DDQTransformerDecoder
    changed = 0
    for detector in model.modules():
        if not isinstance(detector, DDQDETR) or selects_distinct_queries_sync_free(detector):
            continue
        decoder = detector.decoder
        if (type(detector).pre_decoder is not DDQDETR.pre_decoder
                or type(decoder).select_distinct_queries is not DDQTransformerDecoder.select_distinct_queries
                or _iou_threshold(detector.cache_dict) is None):
            continue
        detector.pre_decoder = types.MethodType(pre_decoder_sync_free, detector)
        decoder.select_distinct_queries = types.MethodType(select_distinct_queries_sync_free, decoder)
        changed += 1
    return changed
