"""DETR heads, their loss inputs and random boxes, for the fast paths' tests."""
import torch


def hungarian_assigner():
    """The DETR configs' assigner: focal, box-L1 (cx-cy-w-h) and GIoU costs."""
    from mmdet.models.task_modules.assigners import HungarianAssigner
    return HungarianAssigner(match_costs=[dict(type="FocalLossCost", weight=2.0),
                                          dict(type="BBoxL1Cost", weight=5.0, box_format="xywh"),
                                          dict(type="IoUCost", iou_mode="giou", weight=2.0)])


def random_boxes(count, generator, width=96, height=64, degenerate=0):
    """``count`` x1-y1-x2-y2 boxes inside a ``width`` x ``height`` image, the first ``degenerate`` of zero area."""
    xy = torch.rand(count, 2, generator=generator) * torch.tensor([width, height]) * 0.7
    boxes = torch.cat([xy, xy + 5 + torch.rand(count, 2, generator=generator) * 20], 1)
    boxes[:degenerate, 2:] = boxes[:degenerate, :2]  # zero-area boxes: the eps floor decides their overlaps
    return boxes


# Deformable-DETR's variants: plain (one class and box branch shared by every decoder layer), refine (a branch per
# layer) and refine two-stage (a branch per layer and one more for the encoder's proposals).
DEFORMABLE_DETR_KINDS = ("deformable-detr", "deformable-detr-refine", "deformable-detr-two-stage")
TWO_STAGE_KINDS = ("deformable-detr-two-stage", "dino")


def detr_head(kind):
    """A small head of the ``kind`` family (``"dino"`` or one of :data:`DEFORMABLE_DETR_KINDS`) with the configs'
    losses."""
    from mmdet.registry import MODELS
    from mmdet.utils import register_all_modules
    register_all_modules(init_default_scope=True)
    assigner = dict(type="HungarianAssigner", match_costs=[
        dict(type="FocalLossCost", weight=2.0), dict(type="BBoxL1Cost", weight=5.0, box_format="xywh"),
        dict(type="IoUCost", iou_mode="giou", weight=2.0)])
    common = dict(num_classes=5, embed_dims=32, sync_cls_avg_factor=True,
                  loss_cls=dict(type="FocalLoss", use_sigmoid=True, gamma=2.0, alpha=0.25, loss_weight=2.0),
                  loss_bbox=dict(type="L1Loss", loss_weight=5.0), loss_iou=dict(type="GIoULoss", loss_weight=2.0),
                  train_cfg=dict(assigner=assigner))
    if kind == "dino":
        return MODELS.build(dict(type="DINOHead", **common))
    if kind not in DEFORMABLE_DETR_KINDS:
        raise ValueError(f"unknown DETR head kind {kind!r}")
    # The branches do not enter loss_by_feat; only their layout differs between the variants.
    return MODELS.build(dict(type="DeformableDETRHead", share_pred_layer=kind == "deformable-detr", num_pred_layer=3,
                             as_two_stage=kind in TWO_STAGE_KINDS, **common))


def detr_loss_inputs(kind, num_gts_per_image, seed=0):
    """``loss_by_feat``'s arguments for a :func:`detr_head` of three decoder layers, one image per gt count."""
    from mmengine.structures import InstanceData
    generator = torch.Generator().manual_seed(seed)
    layers, batch, queries, height, width = 3, len(num_gts_per_image), 12, 48, 80
    # DINO's denoising part: one group of a positive and a negative query per gt of the fullest image.
    num_denoising = 2 * max(num_gts_per_image) if kind == "dino" else 0
    total = queries + num_denoising
    gts, metas = [], []
    for num_gts in num_gts_per_image:
        xy = torch.rand(num_gts, 2, generator=generator) * torch.tensor([width, height]) * 0.6
        gts.append(InstanceData(bboxes=torch.cat([xy, xy + 4 + torch.rand(num_gts, 2, generator=generator) * 15], 1),
                                labels=torch.randint(0, 5, (num_gts,), generator=generator)))
        metas.append(dict(img_shape=(height, width)))
    cls_scores = torch.randn(layers, batch, total, 5, generator=generator)
    bbox_preds = torch.rand(layers, batch, total, 4, generator=generator) * 0.5 + 0.1
    enc_cls = torch.randn(batch, queries, 5, generator=generator)
    enc_bbox = torch.rand(batch, queries, 4, generator=generator) * 0.5 + 0.1
    if kind not in TWO_STAGE_KINDS:  # no encoder proposals: the head's loss_by_feat gets None for them
        enc_cls = enc_bbox = None
    args = dict(all_layers_cls_scores=cls_scores, all_layers_bbox_preds=bbox_preds, enc_cls_scores=enc_cls,
                enc_bbox_preds=enc_bbox, batch_gt_instances=gts, batch_img_metas=metas)
    if kind == "dino":
        args["dn_meta"] = dict(num_denoising_queries=num_denoising, num_denoising_groups=1)
    return args


def losses_and_gradients(head, inputs):
    """``head``'s losses on ``inputs`` and the gradients of their sum with respect to the predictions."""
    inputs = dict(inputs)
    leaves = {}
    for name in ("all_layers_cls_scores", "all_layers_bbox_preds", "enc_cls_scores", "enc_bbox_preds"):
        if inputs[name] is not None:
            leaves[name] = inputs[name] = inputs[name].detach().clone().requires_grad_()
    losses = head.loss_by_feat(**inputs)
    sum(value.sum() for value in losses.values()).backward()
    return losses, {name: leaf.grad for name, leaf in leaves.items()}
