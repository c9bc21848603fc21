# The demo's tiny Deformable-DETR reading a COCO-format CocoDataset (80 classes) at a small scale: the training
# benchmark's CPU test needs a config that both stock mmdet and deform_plugin train in seconds on the synthetic
# COCO-like source (the demo itself reads deform_plugin's ShapesCocoDataset, which stock mmdet does not know).
_base_ = '../../../../configs/demo/deformable-detr-refine_r18_tiny_1xb4-500i_shapes.py'

model = dict(bbox_head=dict(num_classes=80))
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', with_bbox=True),
    dict(type='Resize', scale=(128, 128), keep_ratio=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackDetInputs')
]
train_dataloader = dict(
    batch_size=2,
    dataset=dict(
        _delete_=True,
        type='CocoDataset',
        data_root='data/coco/',
        ann_file='annotations/instances_train2017.json',
        data_prefix=dict(img='train2017/'),
        filter_cfg=dict(filter_empty_gt=False, min_size=32),
        pipeline=train_pipeline))
