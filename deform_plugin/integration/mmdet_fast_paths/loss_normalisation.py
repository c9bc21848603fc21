"""The ``sync_free_losses`` fast path: a DETR head's per-layer loss without host syncs.

mmdet 3.3.0's ``DETRHead.loss_by_feat_single`` syncs the host with the GPU three times per decoder layer: it builds
the classification normaliser with ``new_tensor([...])`` (a blocking copy to the device) and takes ``max(·, 1)`` of it
in Python (a copy back), turns the positive count into ``.item()``, and builds each image's size factor with
``new_tensor``. Outside distributed training the normalisers are host numbers already (the positive and negative
counts are list lengths), so this copy computes them on the host; in distributed training they are copied to the
device without blocking and stay device tensors (``clamp`` instead of ``max``), averaged over ranks as before. Same
losses: the normalisers are integers, exact in float32 and float64 alike.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .matching import _to_device_without_blocking, image_size_factor


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _host_number_on_device(number, like: torch.Tensor) -> torch.Tensor:
    """``like.new_tensor([number])`` without waiting for the GPU (a pinned, non-blocking copy); the same value."""
    return _to_device_without_blocking(torch.tensor([number], dtype=like.dtype), like.device)


def detr_loss_by_feat_single_sync_free(self, cls_scores, bbox_preds, batch_gt_instances, batch_img_metas):
    """mmdet 3.3.0's ``DETRHead.loss_by_feat_single`` with host-side (or device-side) normalisers, no syncs."""
    from mmdet.structures.bbox import bbox_cxcywh_to_xyxy
    from mmdet.utils import reduce_mean

    num_imgs = cls_scores.size(0)
    cls_scores_list = [cls_scores[i] for i in range(num_imgs)]
    bbox_preds_list = [bbox_preds[i] for i in range(num_imgs)]
    (labels_list, label_weights_list, bbox_targets_list, bbox_weights_list, num_total_pos,
     num_total_neg) = self.get_targets(cls_scores_list, bbox_preds_list, batch_gt_instances, batch_img_metas)
    labels = torch.cat(labels_list, 0)
    label_weights = torch.cat(label_weights_list, 0)
    bbox_targets = torch.cat(bbox_targets_list, 0)
    bbox_weights = torch.cat(bbox_weights_list, 0)

    cls_scores = cls_scores.reshape(-1, self.cls_out_channels)
    cls_avg_factor = num_total_pos * 1.0 + num_total_neg * self.bg_cls_weight
    # The stock normaliser is a 1-element tensor under sync_cls_avg_factor, unless max(·, 1) picks the Python 1;
    # the loss takes its shape.
    keeps_dim = self.sync_cls_avg_factor and (_distributed() or cls_avg_factor >= 1)
    if self.sync_cls_avg_factor and _distributed():
        cls_avg_factor = reduce_mean(_host_number_on_device(cls_avg_factor, cls_scores)).clamp(min=1)
    else:
        cls_avg_factor = max(cls_avg_factor, 1)
    loss_cls = self.loss_cls(cls_scores, labels, label_weights, avg_factor=cls_avg_factor)
    if keeps_dim and loss_cls.dim() == 0:
        loss_cls = loss_cls.reshape(1)

    if _distributed():
        # 0-dim, as stock's Python number (its .item() of the mean, a host sync), so the box losses are 0-dim too.
        num_total_pos = torch.clamp(reduce_mean(_host_number_on_device(num_total_pos, loss_cls)), min=1)[0]
    else:
        num_total_pos = float(max(num_total_pos, 1))

    factors = torch.cat([image_size_factor(img_meta, bbox_pred).repeat(bbox_pred.size(0), 1)
                         for img_meta, bbox_pred in zip(batch_img_metas, bbox_preds)], 0)
    bbox_preds = bbox_preds.reshape(-1, 4)
    bboxes = bbox_cxcywh_to_xyxy(bbox_preds) * factors
    bboxes_gt = bbox_cxcywh_to_xyxy(bbox_targets) * factors
    loss_iou = self.loss_iou(bboxes, bboxes_gt, bbox_weights, avg_factor=num_total_pos)
    loss_bbox = self.loss_bbox(bbox_preds, bbox_targets, bbox_weights, avg_factor=num_total_pos)
    return loss_cls, loss_bbox, loss_iou


def enable_sync_free_losses(model) -> int:
    """Give every DETR-family head that uses mmdet's own ``loss_by_feat_single`` and a plain classification loss
    (not QualityFocalLoss, whose branch needs ``nonzero``) the sync-free copy. Returns the number of heads changed."""
    from mmdet.models.dense_heads import DETRHead
    from mmdet.models.losses import QualityFocalLoss
    changed = 0
    for module in model.modules():
        if (isinstance(module, DETRHead) and type(module).loss_by_feat_single is DETRHead.loss_by_feat_single
                and not isinstance(module.loss_cls, QualityFocalLoss)):
            module.loss_by_feat_single = detr_loss_by_feat_single_sync_free.__get__(module)
            changed += 1
    return changed
