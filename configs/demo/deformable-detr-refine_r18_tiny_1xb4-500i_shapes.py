# A tiny Deformable-DETR (iterative box refinement) trained from scratch on the embedded shapes set.
# Sized for the README's main job: a 2-core CPU trains it and evaluates COCO bbox AP in about 5 minutes.
# Not two-stage: mmdet 3.3.0's two-stage proposal embedding assumes embed_dims=256 (get_proposal_pos_embed
# hard-codes 128 features per coordinate), and 256 dims would double the cost of the transformer here.
# Self-contained rather than inheriting the stock R-50 config: nearly every value differs, and mmengine's
# merge would keep stock keys (pretrained init, multi-scale pipeline) that a demo must not carry.
custom_imports = dict(imports=['deform_plugin'], allow_failed_imports=False)
default_scope = 'mmdet'

image_size = 128
embed_dims = 128
num_levels = 4
max_iters = 500
batch_size = 4
# `None` generates the set under $DEFORM_PLUGIN_DATA or ~/.cache/deform_plugin/shapes on first use.
shapes_cache_root = None

model = dict(
    type='DeformableDETR',
    num_queries=30,  # at most 4 objects per image
    num_feature_levels=num_levels,
    with_box_refine=True,
    data_preprocessor=dict(
        type='DetDataPreprocessor',
        mean=[123.675, 116.28, 103.53],
        std=[58.395, 57.12, 57.375],
        bgr_to_rgb=True,
        pad_size_divisor=1),
    backbone=dict(
        type='ResNet',
        depth=18,
        num_stages=4,
        out_indices=(1, 2, 3),
        # Trained from scratch, so nothing is frozen and BatchNorm keeps learning its statistics.
        frozen_stages=-1,
        norm_cfg=dict(type='BN', requires_grad=True),
        norm_eval=False,
        style='pytorch',
        init_cfg=None),
    neck=dict(
        type='ChannelMapper',
        in_channels=[128, 256, 512],
        kernel_size=1,
        out_channels=embed_dims,
        act_cfg=None,
        norm_cfg=dict(type='GN', num_groups=32),
        num_outs=num_levels),
    encoder=dict(
        num_layers=2,
        layer_cfg=dict(
            self_attn_cfg=dict(embed_dims=embed_dims, num_levels=num_levels, batch_first=True),
            ffn_cfg=dict(embed_dims=embed_dims, feedforward_channels=4 * embed_dims, ffn_drop=0.0))),
    decoder=dict(
        num_layers=2,
        return_intermediate=True,
        layer_cfg=dict(
            self_attn_cfg=dict(embed_dims=embed_dims, num_heads=8, dropout=0.0, batch_first=True),
            cross_attn_cfg=dict(embed_dims=embed_dims, num_levels=num_levels, batch_first=True),
            ffn_cfg=dict(embed_dims=embed_dims, feedforward_channels=4 * embed_dims, ffn_drop=0.0)),
        post_norm_cfg=None),
    positional_encoding=dict(num_feats=embed_dims // 2, normalize=True, offset=-0.5),
    bbox_head=dict(
        type='DeformableDETRHead',
        num_classes=4,
        embed_dims=embed_dims,
        sync_cls_avg_factor=True,
        loss_cls=dict(type='FocalLoss', use_sigmoid=True, gamma=2.0, alpha=0.25, loss_weight=2.0),
        loss_bbox=dict(type='L1Loss', loss_weight=5.0),
        loss_iou=dict(type='GIoULoss', loss_weight=2.0)),
    train_cfg=dict(
        assigner=dict(
            type='HungarianAssigner',
            match_costs=[
                dict(type='FocalLossCost', weight=2.0),
                dict(type='BBoxL1Cost', weight=5.0, box_format='xywh'),
                dict(type='IoUCost', iou_mode='giou', weight=2.0)
            ])),
    test_cfg=dict(max_per_img=30))

train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', with_bbox=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackDetInputs')
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    # Images are already this size; the resize records the scale factor that rescaling predictions reads.
    dict(type='Resize', scale=(image_size, image_size), keep_ratio=True),
    dict(type='LoadAnnotations', with_bbox=True),
    dict(type='PackDetInputs', meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor'))
]
# Workers would compete with the two compute threads of a small CPU for images that take microseconds to load.
train_dataloader = dict(
    batch_size=batch_size,
    num_workers=0,
    persistent_workers=False,
    sampler=dict(type='InfiniteSampler', shuffle=True),
    dataset=dict(
        type='ShapesCocoDataset',
        split='train',
        cache_root=shapes_cache_root,
        filter_cfg=dict(filter_empty_gt=False),
        pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=8,
    num_workers=0,
    persistent_workers=False,
    drop_last=False,
    sampler=dict(type='DefaultSampler', shuffle=False),
    dataset=dict(
        type='ShapesCocoDataset',
        split='val',
        cache_root=shapes_cache_root,
        test_mode=True,
        pipeline=test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(type='ShapesCocoMetric', split='val', cache_root=shapes_cache_root, metric='bbox')
test_evaluator = val_evaluator

optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=4e-4, weight_decay=1e-4),
    clip_grad=dict(max_norm=0.1, norm_type=2),
    paramwise_cfg=dict(custom_keys={
        'sampling_offsets': dict(lr_mult=0.1),
        'reference_points': dict(lr_mult=0.1)
    }))
param_scheduler = [
    dict(type='LinearLR', start_factor=0.01, by_epoch=False, begin=0, end=50),
    dict(type='MultiStepLR', by_epoch=False, begin=0, end=max_iters, milestones=[int(max_iters * 0.8)],
         gamma=0.1)
]
train_cfg = dict(type='IterBasedTrainLoop', max_iters=max_iters, val_interval=max_iters)
val_cfg = dict(type='ValLoop')
test_cfg = dict(type='TestLoop')

default_hooks = dict(
    timer=dict(type='IterTimerHook'),
    logger=dict(type='LoggerHook', interval=10),
    param_scheduler=dict(type='ParamSchedulerHook'),
    checkpoint=dict(type='CheckpointHook', by_epoch=False, interval=max_iters, max_keep_ckpts=2),
    sampler_seed=dict(type='DistSamplerSeedHook'),
    visualization=dict(type='DetVisualizationHook'))
env_cfg = dict(
    cudnn_benchmark=False,
    mp_cfg=dict(mp_start_method='fork', opencv_num_threads=0),
    dist_cfg=dict(backend='nccl'))
vis_backends = [dict(type='LocalVisBackend')]
visualizer = dict(type='DetLocalVisualizer', vis_backends=vis_backends, name='visualizer')
log_processor = dict(type='LogProcessor', window_size=10, by_epoch=False)
log_level = 'INFO'
randomness = dict(seed=0)
load_from = None
resume = False
