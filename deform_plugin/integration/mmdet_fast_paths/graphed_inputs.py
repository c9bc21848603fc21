"""What a captured training region takes besides the pixels, made eagerly before each replay: each image's size as
a device tensor, and DINO's denoising queries padded to a fixed count with their attention mask (so that batches
with different target counts replay one graph). Shared by :mod:`.graphed_training` and :mod:`.graphed_grounding`.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch

from .matching import image_size_factor


def image_sizes_tensor(batch_data_samples, device) -> torch.Tensor:
    """Each image's (height, width) inside the batch, on ``device`` (copied without blocking)."""
    sizes = torch.tensor([list(sample.img_shape[:2]) for sample in batch_data_samples], dtype=torch.int64)
    if torch.device(device).type == "cuda":
        sizes = sizes.pin_memory()
    return sizes.to(device, non_blocking=True)


class GraphedLoss(NamedTuple):
    """A detector's training loss split around its captured region: ``region_inputs(batch_inputs, samples)`` gives
    the region's inputs and what the tail needs to know of them, ``region(*inputs)`` runs in the graph, and
    ``tail(outputs, constants, samples, context)`` computes the losses eagerly. ``region`` takes ``features=`` (the
    outputs of ``detector.extract_feat``) where ``splits_at_features``: its first input then only gives the batch's
    padded shape (None with ``levels=``)."""
    region: Callable
    region_inputs: Callable
    tail: Callable
    splits_at_features: bool = False
    # Whether ``region`` also takes ``levels=(level_masks, unpadded_shapes)`` with ``features=`` padded to a feature
    # bucket (:mod:`.padded_levels`), and which of its outputs then hold every padded token.
    pads_features: bool = False
    token_outputs: tuple = ()


def denoising_queries(generator, batch_data_samples):
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
cached_denoising_mask = functools.lru_cache(maxsize=16)(padded_denoising_mask)


def padded_denoising_count(generator, num_denoising: int) -> int:
    """A fixed count of denoising queries for most batches: dynamic groups give at most ``2 * num_dn_queries``
    (more only where an image has more targets than that); static ones grow in steps of 16 targets."""
    step = 64 if generator.dynamic_dn_groups else 2 * generator.num_groups * 16
    base = 2 * generator.num_dn_queries if generator.dynamic_dn_groups else step
    return base if num_denoising <= base else -(-num_denoising // step) * step
