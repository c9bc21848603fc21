# Stock mmdet 3.3.0 config with every MultiScaleDeformableAttention running on deform_plugin's kernels.
# The only change to the stock config is the custom_imports line; stock checkpoints load unchanged.
_base_ = 'mmdet::grounding_dino/grounding_dino_swin-t_finetune_16xb2_1x_coco.py'

custom_imports = dict(imports=['deform_plugin'], allow_failed_imports=False)
