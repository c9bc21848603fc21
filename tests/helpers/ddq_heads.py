"""A small DDQ-DETR head, the inputs of its ``loss`` and its losses and gradients, for the DDQ fast paths' tests."""
import contextlib
import types

import torch

NUM_CLASSES, EMBED_DIMS, NUM_HEADS = 5, 32, 2
# For a head of three decoder layers and ten distinct queries: the queries that the NMS before layers 1 and 2 kept,
# per image. Row 0 of stock's mask reads "every query" where query 0 was kept (image 1 at layer 1).
KEPT_BY_THE_NMS = [[[1, 2, 5, 7, 9], [0, 3, 4], [2, 3, 4, 5, 6, 8]], [[1, 5, 9], [1, 2], [1, 2, 3, 4, 5, 6, 7, 8, 9]]]


@contextlib.contextmanager
def ddq_in_float64():
    """Let mmdet's DDQ-DETR train in float64, stock and fast alike, inside the block: DINO's denoising targets take
    the default dtype, and ``DDQAuxLoss`` makes its label weights and alignment targets with ``dtype=torch.float``
    (float32), which an index-put of float64 metrics refuses: inside its module ``torch.float`` is float64 (every
    other name is torch's own)."""
    from mmdet.models.losses import ddq_detr_aux_loss

    class Float64Torch(types.ModuleType):
        float = torch.float64

        def __getattr__(self, name):
            return getattr(torch, name)

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    ddq_detr_aux_loss.torch = Float64Torch("torch")
    try:
        yield
    finally:
        ddq_detr_aux_loss.torch = torch
        torch.set_default_dtype(previous)


def ddq_head(num_layers=3, num_dense=12, aux_num_pos=4):
    """A ``DDQDETRHead`` as DDQ-DETR builds it for ``num_layers`` decoder layers (box refinement, two stages), with
    the config's losses and assigner, and the detector's shared ``cache_dict`` entries its loss reads."""
    from mmdet.registry import MODELS
    from mmdet.utils import register_all_modules
    register_all_modules(init_default_scope=True)
    assigner = dict(type="HungarianAssigner", match_costs=[
        dict(type="FocalLossCost", weight=2.0), dict(type="BBoxL1Cost", weight=5.0, box_format="xywh"),
        dict(type="IoUCost", iou_mode="giou", weight=2.0)])
    torch.manual_seed(0)
    head = MODELS.build(dict(
        type="DDQDETRHead", num_classes=NUM_CLASSES, embed_dims=EMBED_DIMS, sync_cls_avg_factor=True,
        num_pred_layer=num_layers + 1, share_pred_layer=False, as_two_stage=True, aux_num_pos=aux_num_pos,
        loss_cls=dict(type="FocalLoss", use_sigmoid=True, gamma=2.0, alpha=0.25, loss_weight=1.0),
        loss_bbox=dict(type="L1Loss", loss_weight=5.0), loss_iou=dict(type="GIoULoss", loss_weight=2.0),
        train_cfg=dict(assigner=assigner)))
    head.init_weights()
    head.cache_dict = dict(num_heads=NUM_HEADS, num_dense_queries=num_dense, distinct_query_mask=[])
    return head.double().train()


def stock_and_one_pass_heads():
    """A :func:`ddq_head` and its copy with the one-pass losses (``batched_losses``), sharing the detector's
    ``cache_dict``; and what ``apply_fast_paths`` changed."""
    import copy

    from torch import nn

    from deform_plugin.integration.mmdet_fast_paths import apply_fast_paths
    stock = ddq_head()
    fast = copy.deepcopy(stock)
    fast.cache_dict = stock.cache_dict  # one dict shared by every module of a detector
    holder = nn.Module()
    holder.bbox_head = fast
    return stock, fast, apply_fast_paths(holder, batched_losses=True)


def ddq_loss_inputs(head, num_gts_per_image, kept_per_layer, num_queries=10, seed=0):
    """``head.loss``'s arguments for a batch of one image per gt count, and the distinct-query masks the decoder
    would have left in ``head.cache_dict``: ``kept_per_layer[l][image]`` are the queries the NMS before decoder layer
    ``l + 1`` kept (row 0 of a mask takes every query where query 0 is kept, else the kept ones: stock's reading)."""
    from mmdet.structures import DetDataSample
    from mmengine.structures import InstanceData
    generator = torch.Generator().manual_seed(seed)
    num_layers, num_dense = head.num_pred_layer - 1, head.cache_dict["num_dense_queries"]
    batch, height, width = len(num_gts_per_image), 48, 80
    num_denoising = 2 * max(num_gts_per_image)  # one group of a positive and a negative query per gt
    total = num_denoising + num_queries + num_dense
    samples = []
    for num_gts in num_gts_per_image:
        xy = torch.rand(num_gts, 2, generator=generator, dtype=torch.float64) * torch.tensor([width, height]) * 0.6
        sample = DetDataSample(metainfo=dict(img_shape=(height, width)))
        sample.gt_instances = InstanceData(
            bboxes=torch.cat([xy, xy + 4 + torch.rand(num_gts, 2, generator=generator, dtype=torch.float64) * 15], 1),
            labels=torch.randint(0, NUM_CLASSES, (num_gts,), generator=generator))
        samples.append(sample)
    head.cache_dict["distinct_query_mask"] = [_distinct_mask(kept, num_queries) for kept in kept_per_layer]
    assert len(kept_per_layer) == num_layers - 1

    def boxes(*shape):  # normalized cx-cy-w-h, inside the image
        centre = torch.rand(*shape, 2, generator=generator, dtype=torch.float64) * 0.6 + 0.2
        return torch.cat([centre, torch.rand(*shape, 2, generator=generator, dtype=torch.float64) * 0.3 + 0.05], -1)

    return dict(
        hidden_states=torch.randn(num_layers, batch, total, EMBED_DIMS, generator=generator, dtype=torch.float64),
        references=boxes(num_layers + 1, batch, total),
        enc_outputs_class=torch.randn(batch, num_queries, NUM_CLASSES, generator=generator, dtype=torch.float64),
        enc_outputs_coord=boxes(batch, num_queries),
        batch_data_samples=samples,
        dn_meta=dict(num_denoising_queries=num_denoising, num_denoising_groups=1, num_dense_queries=num_dense),
        aux_enc_outputs_class=torch.randn(batch, num_dense, NUM_CLASSES, generator=generator, dtype=torch.float64),
        aux_enc_outputs_coord=boxes(batch, num_dense))


def _distinct_mask(kept_per_image, num_queries):
    # DDQTransformerDecoder.select_distinct_queries' mask: a kept query's row and column are open, every head alike;
    # the decoder stores its negation.
    masks = []
    for kept in kept_per_image:
        closed = torch.ones(num_queries, num_queries, dtype=torch.bool)
        closed[kept] = False
        closed[:, kept] = False
        masks.append(closed[None].repeat(NUM_HEADS, 1, 1))
    return ~torch.cat(masks)


DIFFERENTIABLE = ("hidden_states", "references", "enc_outputs_class", "enc_outputs_coord", "aux_enc_outputs_class",
                  "aux_enc_outputs_coord")


def ddq_losses_and_gradients(head, inputs):
    """``head.loss(**inputs)`` (each entry a tensor; the dense losses' per-image lists spread over ``name[i]``) and
    the gradients of their sum with respect to the inputs and the head's parameters."""
    import copy
    inputs = dict(inputs, batch_data_samples=copy.deepcopy(inputs["batch_data_samples"]))
    leaves = {}
    for name in DIFFERENTIABLE:
        leaves[name] = inputs[name] = inputs[name].detach().clone().requires_grad_()
    losses = flat_losses(head.loss(**inputs))
    params = [p for p in head.parameters() if p.requires_grad]
    grads = torch.autograd.grad(sum(value.sum() for value in losses.values()), list(leaves.values()) + params,
                                allow_unused=True)
    return losses, grads


def flat_losses(losses):
    """A loss dict with each list of per-image losses spread over ``name[i]`` keys, in order."""
    flat = {}
    for name, value in losses.items():
        if isinstance(value, (list, tuple)):
            flat.update({f"{name}[{i}]": item for i, item in enumerate(value)})
        else:
            flat[name] = value
    return flat


def ddq_training_batch():
    """Two images of 96 x 128 (the second smaller inside the padded batch) with 3 and 5 ground-truth boxes: float32
    inputs and their samples."""
    import stock_worker
    from mmengine.structures import InstanceData
    inputs, samples = stock_worker.detection_inputs(batch=2, height=96, width=128)
    generator = torch.Generator().manual_seed(1)
    for sample, num_gts in zip(samples, (3, 5)):
        height, width = sample.metainfo["img_shape"]
        centre = torch.rand(num_gts, 2, generator=generator) * 0.6 + 0.2
        half = torch.rand(num_gts, 2, generator=generator) * 0.15 + 0.05
        sample.gt_instances = InstanceData(bboxes=torch.cat([centre - half, centre + half], 1) * torch.tensor(
            [width, height, width, height]), labels=torch.randint(0, 80, (num_gts,), generator=generator))
    return inputs.float(), samples
