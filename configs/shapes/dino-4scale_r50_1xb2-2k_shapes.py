# A stock mmdet family config trained on the embedded shapes set instead of COCO: the recipe for any family.
# Keep the stock model, pipelines, optimizer and schedule; replace the datasets and evaluators whole
# (`_delete_=True`), because mmengine merges dicts key by key and would otherwise keep COCO's data_root/ann_file.
_base_ = 'mmdet::dino/dino-4scale_r50_8xb2-12e_coco.py'
custom_imports = dict(imports=['deform_plugin'], allow_failed_imports=False)

num_classes = 4  # circle, square, triangle, star
model = dict(bbox_head=dict(num_classes=num_classes),
             backbone=dict(init_cfg=None))  # no ImageNet download; give a checkpoint with load_from instead

train_dataloader = dict(
    batch_size=2,
    dataset=dict(_delete_=True, type='ShapesCocoDataset', split='train', filter_cfg=dict(filter_empty_gt=False),
                 pipeline={{_base_.train_pipeline}}))
val_dataloader = dict(
    dataset=dict(_delete_=True, type='ShapesCocoDataset', split='val', test_mode=True,
                 pipeline={{_base_.test_pipeline}}))
test_dataloader = val_dataloader
val_evaluator = dict(_delete_=True, type='ShapesCocoMetric', split='val', metric='bbox')
test_evaluator = val_evaluator

max_iters = 2000
train_cfg = dict(_delete_=True, type='IterBasedTrainLoop', max_iters=max_iters, val_interval=max_iters)
param_scheduler = [dict(type='MultiStepLR', by_epoch=False, begin=0, end=max_iters,
                        milestones=[int(max_iters * 0.8)], gamma=0.1)]
default_hooks = dict(checkpoint=dict(by_epoch=False, interval=max_iters))
log_processor = dict(by_epoch=False)
