# Stock mmdet 3.3.0 config with every MultiScaleDeformableAttention running on deform_plugin's kernels.
# The only change to the stock config is the custom_imports line; stock checkpoints load unchanged.
_base_ = 'mmdet::dino/dino-4scale_r50_8xb2-12e_coco.py'

custom_imports = dict(imports=['deform_plugin'], allow_failed_imports=False)
