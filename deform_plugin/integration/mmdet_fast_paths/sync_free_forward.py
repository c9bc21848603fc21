"""The ``sync_free_forward`` fast path: a Deformable-DETR / DINO / Mask2Former forward that never waits for the GPU.

mmdet 3.3.0 builds the level tables on the device from each feature map's shape (a blocking host-to-device copy per
level: the host waits for the GPU), as a new tensor every forward, and then walks that device tensor on the host to
build the encoder's reference points and the two-stage proposals, or (Mask2Former's pixel decoder) to split and
reshape the encoder's output (a device-to-host read per level). Each of these
waits drains the GPU's queue; none is needed, because every size is a Python number on the host already. The fast
path makes the tables with :func:`deform_plugin.ops.msda.make_level_tables` (copied without blocking, the same
tensors for the same sizes, never read by the MSDA op) and walks the host sizes instead. Same arithmetic on the same
values: the outputs are bitwise the stock ones. Without a sync a forward of fixed-size inputs is also capturable in
a CUDA graph.

Before the model, mmengine's ``ImgDataPreprocessor`` (mmdet's ``DetDataPreprocessor`` is one) swaps BGR to RGB by
indexing each image with the Python list ``[2, 1, 0]``: the index becomes a tensor copied from pageable host memory,
and such a copy first waits for the GPU's queue to drain (one wait per image, at the start of every iteration). The
fast path flips the channel dimension on the device instead (``flip``; the same values) and lets the preprocessor
do the rest as it would.

Mask2Former's instance post-processing waits for the GPU about 700 times per image: mmdet's ``mask2bbox`` finds
each of the 100 masks' box with ``torch.where`` and builds it from four device scalars, and the thing-class filter
indexes with a boolean mask. The fast path gives ``MaskFormerFusionHead`` the same post-processing with every box
found at once (:func:`mask_boxes`: the first and last rows and columns holding a mask pixel, as ``mask2bbox``
finds them) and without the filter where every class is a thing (it keeps every query then); same values.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from deform_plugin.ops.msda import host_spatial_shapes, make_level_tables


def deformable_detr_pre_transformer_sync_free(self, mlvl_feats, batch_data_samples=None):
    """mmdet 3.3.0's ``DeformableDETR.pre_transformer`` with the level tables made on the host."""
    batch_size = mlvl_feats[0].size(0)
    assert batch_data_samples is not None
    batch_input_shape = batch_data_samples[0].batch_input_shape
    input_img_h, input_img_w = batch_input_shape
    img_shape_list = [sample.img_shape for sample in batch_data_samples]
    same_shape_flag = all(s[0] == input_img_h and s[1] == input_img_w for s in img_shape_list)
    if torch.onnx.is_in_onnx_export() or same_shape_flag:
        mlvl_masks = [None for _ in mlvl_feats]
        mlvl_pos_embeds = [self.positional_encoding(None, input=feat) for feat in mlvl_feats]
    else:
        masks = mlvl_feats[0].new_ones((batch_size, input_img_h, input_img_w))
        for img_id in range(batch_size):
            img_h, img_w = img_shape_list[img_id]
            masks[img_id, :img_h, :img_w] = 0
        mlvl_masks, mlvl_pos_embeds = _level_masks_and_positions(self, mlvl_feats, masks)

    return _flatten_levels(self, mlvl_feats, mlvl_masks, mlvl_pos_embeds)


def deformable_detr_pre_transformer_from_image_sizes(self, mlvl_feats, image_sizes: torch.Tensor, input_img_h: int,
                                                    input_img_w: int):
    """``pre_transformer`` with the padding masks made on the device from ``image_sizes`` (``(batch, 2)`` int:
    each image's height and width inside the ``input_img_h`` x ``input_img_w`` batch): nothing is read from the
    host metadata, so the function can be captured once and replayed for batches of other image sizes. The masks
    hold the stock values (1 on the padding); where the stock path skips them (no image padded), the all-valid
    masks give the same outputs."""
    mlvl_masks = level_masks_from_image_sizes([feat.shape[-2:] for feat in mlvl_feats], image_sizes, input_img_h,
                                              input_img_w, mlvl_feats[0].dtype)
    return deformable_detr_pre_transformer_from_level_masks(self, mlvl_feats, mlvl_masks)


def level_masks_from_image_sizes(level_shapes, image_sizes: torch.Tensor, input_img_h: int, input_img_w: int,
                                 dtype: torch.dtype):
    """Each level's padding mask (bool, True on the padding), as mmdet 3.3.0's ``pre_transformer`` makes it: the
    ``input_img_h`` x ``input_img_w`` batch's mask made on the device from ``image_sizes`` and downsampled to each of
    ``level_shapes``."""
    rows = torch.arange(input_img_h, device=image_sizes.device).view(1, -1, 1)
    cols = torch.arange(input_img_w, device=image_sizes.device).view(1, 1, -1)
    masks = ((rows >= image_sizes[:, 0].view(-1, 1, 1)) | (cols >= image_sizes[:, 1].view(-1, 1, 1))).to(dtype)
    return [F.interpolate(masks[None], size=tuple(shape)).to(torch.bool).squeeze(0) for shape in level_shapes]


def deformable_detr_pre_transformer_from_level_masks(self, mlvl_feats, mlvl_masks):
    """``pre_transformer`` given each level's padding mask (bool)."""
    mlvl_pos_embeds = [self.positional_encoding(mask) for mask in mlvl_masks]
    return _flatten_levels(self, mlvl_feats, mlvl_masks, mlvl_pos_embeds)


def _level_masks_and_positions(self, mlvl_feats, masks):
    """Each level's padding mask (``masks`` downsampled, as bool) and positional encoding, as mmdet 3.3.0 makes them."""
    mlvl_masks, mlvl_pos_embeds = [], []
    for feat in mlvl_feats:
        mlvl_masks.append(F.interpolate(masks[None], size=feat.shape[-2:]).to(torch.bool).squeeze(0))
        mlvl_pos_embeds.append(self.positional_encoding(mlvl_masks[-1]))
    return mlvl_masks, mlvl_pos_embeds


def _flatten_levels(self, mlvl_feats, mlvl_masks, mlvl_pos_embeds):
    """The tail of mmdet 3.3.0's ``DeformableDETR.pre_transformer``, with the level tables made on the host."""
    feat_flatten, lvl_pos_embed_flatten, mask_flatten = [], [], []
    for lvl, (feat, mask, pos_embed) in enumerate(zip(mlvl_feats, mlvl_masks, mlvl_pos_embeds)):
        batch_size, c, h, w = feat.shape
        feat = feat.view(batch_size, c, -1).permute(0, 2, 1)
        pos_embed = pos_embed.view(batch_size, c, -1).permute(0, 2, 1)
        lvl_pos_embed = pos_embed + self.level_embed[lvl].view(1, 1, -1)
        if mask is not None:
            mask = mask.flatten(1)
        feat_flatten.append(feat)
        lvl_pos_embed_flatten.append(lvl_pos_embed)
        mask_flatten.append(mask)
    feat_flatten = torch.cat(feat_flatten, 1)
    lvl_pos_embed_flatten = torch.cat(lvl_pos_embed_flatten, 1)
    mask_flatten = torch.cat(mask_flatten, 1) if mask_flatten[0] is not None else None

    spatial_shapes, level_start_index = make_level_tables([feat.shape[-2:] for feat in mlvl_feats],
                                                          mlvl_feats[0].device)
    if mlvl_masks[0] is not None:
        valid_ratios = torch.stack([self.get_valid_ratio(m) for m in mlvl_masks], 1)
    else:
        valid_ratios = mlvl_feats[0].new_ones(mlvl_feats[0].size(0), len(mlvl_feats), 2)
    encoder_inputs_dict = dict(feat=feat_flatten, feat_mask=mask_flatten, feat_pos=lvl_pos_embed_flatten,
                               spatial_shapes=spatial_shapes, level_start_index=level_start_index,
                               valid_ratios=valid_ratios)
    decoder_inputs_dict = dict(memory_mask=mask_flatten, spatial_shapes=spatial_shapes,
                               level_start_index=level_start_index, valid_ratios=valid_ratios)
    return encoder_inputs_dict, decoder_inputs_dict


def _encoder_reference_points_from_host_sizes(stock):
    def get_encoder_reference_points(spatial_shapes, valid_ratios, device):
        # The stock function only iterates over the sizes: give it the host's.
        return stock(host_spatial_shapes(spatial_shapes), valid_ratios, device)
    return get_encoder_reference_points


def gen_encoder_output_proposals_sync_free(self, memory, memory_mask, spatial_shapes):
    """mmdet 3.3.0's ``DeformableDETR.gen_encoder_output_proposals`` walking the host sizes."""
    bs = memory.size(0)
    proposals = []
    _cur = 0
    for lvl, (H, W) in enumerate(host_spatial_shapes(spatial_shapes)):
        if memory_mask is not None:
            mask_flatten_ = memory_mask[:, _cur:(_cur + H * W)].view(bs, H, W, 1)
            valid_H = torch.sum(~mask_flatten_[:, :, 0, 0], 1).unsqueeze(-1)
            valid_W = torch.sum(~mask_flatten_[:, 0, :, 0], 1).unsqueeze(-1)
            scale = torch.cat([valid_W, valid_H], 1).view(bs, 1, 1, 2)
        else:
            scale = spatial_shapes[lvl].unsqueeze(0).flip(dims=[0, 1]).view(1, 1, 1, 2)
        grid_y, grid_x = torch.meshgrid(
            torch.linspace(0, H - 1, H, dtype=torch.float32, device=memory.device),
            torch.linspace(0, W - 1, W, dtype=torch.float32, device=memory.device), indexing="ij")
        grid = torch.cat([grid_x.unsqueeze(-1), grid_y.unsqueeze(-1)], -1)
        grid = (grid.unsqueeze(0).expand(bs, -1, -1, -1) + 0.5) / scale
        wh = torch.ones_like(grid) * 0.05 * (2.0 ** lvl)
        proposals.append(torch.cat((grid, wh), -1).view(bs, -1, 4))
        _cur += (H * W)
    output_proposals = torch.cat(proposals, 1)
    output_proposals_valid = ((output_proposals > 0.01) & (output_proposals < 0.99)).sum(
        -1, keepdim=True) == output_proposals.shape[-1]
    output_proposals = torch.log(output_proposals / (1 - output_proposals))
    if memory_mask is not None:
        output_proposals = output_proposals.masked_fill(memory_mask.unsqueeze(-1), float("inf"))
    output_proposals = output_proposals.masked_fill(~output_proposals_valid, float("inf"))
    output_memory = memory
    if memory_mask is not None:
        output_memory = output_memory.masked_fill(memory_mask.unsqueeze(-1), float(0))
    output_memory = output_memory.masked_fill(~output_proposals_valid, float(0))
    output_memory = self.memory_trans_fc(output_memory)
    output_memory = self.memory_trans_norm(output_memory)
    return output_memory, output_proposals


def pixel_decoder_forward_sync_free(self, feats):
    """mmdet 3.3.0's ``MSDeformAttnPixelDecoder.forward`` with the level tables made on the host."""
    batch_size = feats[0].shape[0]
    encoder_input_list, padding_mask_list, level_positional_encoding_list, reference_points_list = [], [], [], []
    level_sizes = [tuple(feats[self.num_input_levels - i - 1].shape[-2:]) for i in range(self.num_encoder_levels)]
    spatial_shapes, level_start_index = make_level_tables(level_sizes, feats[0].device)
    for i in range(self.num_encoder_levels):
        level_idx = self.num_input_levels - i - 1
        feat = feats[level_idx]
        feat_projected = self.input_convs[i](feat)
        padding_mask_resized = feat.new_zeros((batch_size, ) + feat.shape[-2:], dtype=torch.bool)
        pos_embed = self.postional_encoding(padding_mask_resized)
        level_embed = self.level_encoding.weight[i]
        level_pos_embed = level_embed.view(1, -1, 1, 1) + pos_embed
        reference_points = self.point_generator.single_level_grid_priors(feat.shape[-2:], level_idx,
                                                                          device=feat.device)
        feat_wh = spatial_shapes[i].unsqueeze(0).flip(dims=[0, 1])
        factor = feat_wh * self.strides[level_idx]
        reference_points = reference_points / factor
        encoder_input_list.append(feat_projected.flatten(2).permute(0, 2, 1))
        padding_mask_list.append(padding_mask_resized.flatten(1))
        level_positional_encoding_list.append(level_pos_embed.flatten(2).permute(0, 2, 1))
        reference_points_list.append(reference_points)
    padding_masks = torch.cat(padding_mask_list, dim=1)
    encoder_inputs = torch.cat(encoder_input_list, dim=1)
    level_positional_encodings = torch.cat(level_positional_encoding_list, dim=1)
    num_queries_per_level = [h * w for h, w in level_sizes]
    reference_points = torch.cat(reference_points_list, dim=0)
    reference_points = reference_points[None, :, None].repeat(batch_size, 1, self.num_encoder_levels, 1)
    valid_radios = reference_points.new_ones((batch_size, self.num_encoder_levels, 2))
    memory = self.encoder(query=encoder_inputs, query_pos=level_positional_encodings, key_padding_mask=padding_masks,
                          spatial_shapes=spatial_shapes, reference_points=reference_points,
                          level_start_index=level_start_index, valid_ratios=valid_radios)
    memory = memory.permute(0, 2, 1)
    outs = torch.split(memory, num_queries_per_level, dim=-1)
    outs = [x.reshape(batch_size, -1, level_sizes[i][0], level_sizes[i][1]) for i, x in enumerate(outs)]
    for i in range(self.num_input_levels - self.num_encoder_levels - 1, -1, -1):
        x = feats[i]
        cur_feat = self.lateral_convs[i](x)
        y = cur_feat + F.interpolate(outs[-1], size=cur_feat.shape[-2:], mode="bilinear", align_corners=False)
        y = self.output_convs[i](y)
        outs.append(y)
    multi_scale_features = outs[:self.num_outs]
    mask_feature = self.mask_feature(outs[-1])
    return mask_feature, multi_scale_features


def mask_boxes(masks: torch.Tensor) -> torch.Tensor:
    """The tight boxes ``(x0, y0, x1, y1)`` (float32, one past the last pixel) of ``(n, h, w)`` boolean masks, and
    zeros for an empty mask: mmdet's ``mask2bbox`` without its per-mask host reads."""
    columns_hit = masks.any(dim=1).to(torch.uint8)  # (n, w)
    rows_hit = masks.any(dim=2).to(torch.uint8)  # (n, h)
    # argmax returns the first maximal index: the first hit, and from the flipped side, the last one.
    x0, y0 = columns_hit.argmax(1), rows_hit.argmax(1)
    x1 = masks.shape[2] - columns_hit.flip(1).argmax(1)
    y1 = masks.shape[1] - rows_hit.flip(1).argmax(1)
    boxes = torch.stack([x0, y0, x1, y1], dim=1).to(torch.float32)
    return torch.where(columns_hit.any(1, keepdim=True).bool(), boxes, torch.zeros_like(boxes))


def flip_channels_without_sync(preprocessor) -> bool:
    """Make an mmengine ``ImgDataPreprocessor`` that converts BGR to RGB do it with ``flip`` on the device (no host
    wait); the rest of its forward is its own. Returns whether ``preprocessor`` was changed (False for other
    preprocessors, for those without channel conversion and for those changed already)."""
    from mmengine.model import ImgDataPreprocessor
    if (not isinstance(preprocessor, ImgDataPreprocessor) or not getattr(preprocessor, "_channel_conversion", False)
            or getattr(preprocessor, "_deform_plugin_flips_channels", False)):
        return False
    own_forward = preprocessor.forward

    def forward(data: dict, training: bool = False):
        inputs = data.get("inputs") if isinstance(data, dict) else None
        if isinstance(inputs, torch.Tensor):
            flippable, channel_dim = inputs.dim() == 4 and inputs.shape[1] == 3, 1
        else:
            flippable, channel_dim = (isinstance(inputs, (list, tuple)) and len(inputs) > 0 and all(
                isinstance(x, torch.Tensor) and x.dim() == 3 and x.shape[0] == 3 for x in inputs)), 0
        if not flippable:  # other layouts: the preprocessor's own conversion (and its own errors)
            return own_forward(data, training)
        on_device = preprocessor.cast_data(inputs)
        flipped = (on_device.flip(channel_dim) if isinstance(on_device, torch.Tensor)
                   else type(on_device)(x.flip(channel_dim) for x in on_device))
        preprocessor._channel_conversion = False
        try:
            return own_forward({**data, "inputs": flipped}, training)
        finally:
            preprocessor._channel_conversion = True

    preprocessor.forward = forward
    preprocessor._deform_plugin_flips_channels = True
    return True


def maskformer_instance_postprocess_sync_free(self, mask_cls, mask_pred):
    """mmdet 3.3.0's ``MaskFormerFusionHead.instance_postprocess`` with :func:`mask_boxes`, and no thing-class
    filter where every class is a thing."""
    from mmengine.structures import InstanceData
    max_per_image = self.test_cfg.get("max_per_image", 100)
    num_queries = mask_cls.shape[0]
    scores = F.softmax(mask_cls, dim=-1)[:, :-1]
    labels = torch.arange(self.num_classes, device=mask_cls.device).unsqueeze(0).repeat(num_queries, 1).flatten(0, 1)
    scores_per_image, top_indices = scores.flatten(0, 1).topk(max_per_image, sorted=False)
    labels_per_image = labels[top_indices]
    query_indices = top_indices // self.num_classes
    mask_pred = mask_pred[query_indices]
    if self.num_stuff_classes:  # else every label is a thing's: the filter keeps all (and would wait for the GPU)
        is_thing = labels_per_image < self.num_things_classes
        scores_per_image = scores_per_image[is_thing]
        labels_per_image = labels_per_image[is_thing]
        mask_pred = mask_pred[is_thing]
    mask_pred_binary = (mask_pred > 0).float()
    mask_scores_per_image = (mask_pred.sigmoid() * mask_pred_binary).flatten(1).sum(1) / (
        mask_pred_binary.flatten(1).sum(1) + 1e-6)
    det_scores = scores_per_image * mask_scores_per_image
    mask_pred_binary = mask_pred_binary.bool()
    results = InstanceData()
    results.bboxes = mask_boxes(mask_pred_binary)
    results.labels = labels_per_image
    results.scores = det_scores
    results.masks = mask_pred_binary
    return results


def enable_sync_free_forward(model) -> int:
    """Switch every Deformable-DETR-family detector in ``model`` (DINO included) whose class uses mmdet's own
    ``pre_transformer``, and every Mask2Former pixel decoder with mmdet's own ``forward``, to the sync-free forward
    (MaskFormer fusion heads with mmdet's own ``instance_postprocess`` come with their pixel decoder), and their
    data preprocessors to :func:`flip_channels_without_sync`. Returns the number of detectors and pixel decoders
    changed."""
    from mmdet.models.detectors import DeformableDETR
    from mmdet.models.layers import MSDeformAttnPixelDecoder
    from mmdet.models.layers.transformer.deformable_detr_layers import DeformableDetrTransformerEncoder
    from mmdet.models.seg_heads.panoptic_fusion_heads import MaskFormerFusionHead
    changed = 0
    for module in model.modules():
        if (isinstance(module, MaskFormerFusionHead)
                and type(module).instance_postprocess is MaskFormerFusionHead.instance_postprocess):
            module.instance_postprocess = maskformer_instance_postprocess_sync_free.__get__(module)
    for module in model.modules():
        if (isinstance(module, MSDeformAttnPixelDecoder)
                and type(module).forward is MSDeformAttnPixelDecoder.forward):
            module.forward = pixel_decoder_forward_sync_free.__get__(module)
            changed += 1
            flip_channels_without_sync(getattr(model, "data_preprocessor", None))
    for module in model.modules():
        if isinstance(module, DeformableDETR) and type(module).pre_transformer is DeformableDETR.pre_transformer:
            module.pre_transformer = deformable_detr_pre_transformer_sync_free.__get__(module)
            if type(module).gen_encoder_output_proposals is DeformableDETR.gen_encoder_output_proposals:
                module.gen_encoder_output_proposals = gen_encoder_output_proposals_sync_free.__get__(module)
            changed += 1
            flip_channels_without_sync(getattr(module, "data_preprocessor", None))
    for module in model.modules():
        if isinstance(module, DeformableDetrTransformerEncoder):
            module.get_encoder_reference_points = _encoder_reference_points_from_host_sizes(
                type(module).get_encoder_reference_points)
    return changed
