# The repository's DINO config shrunk for tests that start many processes: a ResNet-18 (no pretrained weights),
# two encoder and two decoder layers, 50 queries, and a test pipeline that resizes images to at most 330 x 200
# (480 x 640 becomes 200 x 267: graph inference pads it to its 224 x 288 bucket, as it pads 800 x 1067 to
# 800 x 1088 at full size).
# The attention itself (8 heads of 32 channels, 4 levels, 4 points) is DINO's, so the same kernels run.
_base_ = '../../../../configs/dino/dino-4scale_r50_8xb2-12e_coco_deform-plugin.py'

model = dict(
    num_queries=50,
    backbone=dict(depth=18, init_cfg=None),
    neck=dict(in_channels=[128, 256, 512]),
    encoder=dict(num_layers=2),
    decoder=dict(num_layers=2))
test_pipeline = [
    dict(type='LoadImageFromFile', backend_args=None),
    dict(type='Resize', scale=(330, 200), keep_ratio=True),
    dict(type='LoadAnnotations', with_bbox=True),
    dict(type='PackDetInputs', meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor'))
]
val_dataloader = dict(dataset=dict(pipeline=test_pipeline))
test_dataloader = val_dataloader
