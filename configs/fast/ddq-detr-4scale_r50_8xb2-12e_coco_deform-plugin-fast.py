# DDQ-DETR-4scale R50 on deform_plugin's MSDA, with the step-level speedups that fit it (_base_/fast_step.py lists
# them): exact but for ShapeBucketsHook's padding.
_base_ = ['../ddq/ddq-detr-4scale_r50_8xb2-12e_coco_deform-plugin.py', './_base_/fast_step.py']

custom_imports = {{_base_.fast_custom_imports}}
optim_wrapper = {{_base_.fast_optim_wrapper}}
default_hooks = {{_base_.fast_default_hooks}}
train_dataloader = {{_base_.fast_train_dataloader}}
model = {{_base_.fast_model}}
model_wrapper_cfg = {{_base_.fast_model_wrapper_cfg}}
# On: the decoder's self-attention through PyTorch SDPA; the head's whole loss in one pass (the distinct queries'
# DETR losses, the encoder's, the denoising ones and DDQAuxLoss's on the dense queries), all of a step's Hungarian
# matching (one-to-one and DDQAuxLoss's one-to-k) and the decoder's distinct-query masks in one copy to the host
# (batched_losses, which brings batched_matching); the level tables made on the host (sync_free_forward); on CUDA,
# the whole network replayed from CUDA graphs, one pair per input shape, the NMS that selects the distinct queries
# running on the device with fixed shapes (cuda_graphs; docs/whole_detector.md says where tied scores may fall
# otherwise than in mmcv's NMS); the FFNs, which have no dropout, recompute their hidden layer in the backward
# (ffn_recompute); the NMS that selects the distinct queries takes its boxes and scores in float32 (float32_nms:
# under --amp-dtype bfloat16 the class scores are bf16, on which mmcv's batched_nms of the encoder's 10000+
# proposals fails; a no-op in fp32). With batched_losses, which computes DDQAuxLoss's quality focal loss in float32
# (stock's fails under autocast), the config trains in bf16.
# Off: sync_free_losses (batched_losses computes every loss of DDQ's head, so the per-layer method it changes no
# longer runs) and relu_dropout_fusion (no FFN has a dropout to fuse).
custom_hooks = [
    dict(type='FastPathsHook', sdpa_attention=True, batched_matching=True, batched_losses=True,
         sync_free_forward=True, cuda_graphs=True, ffn_recompute=True, float32_nms=True),
    {{_base_.detr_shape_buckets}},
]
