# A tiny multi-view classifier whose views exchange information through deformable SDPA layers:
# 4 views of 32x32 images -> 8x8 tokens per view, 2 fusion layers, 4 heads of 16 dims, 8 samples per view.
# Build it with:
#   from mmengine import Config; from mmengine.registry import MODELS
#   model = MODELS.build(Config.fromfile('configs/deform_sdpa/deform-sdpa_tiny-fusion_4views_toy.py').model)
custom_imports = dict(imports=['deform_plugin.models.deform_sdpa'], allow_failed_imports=False)

num_views = 4
model = dict(
    type='MultiViewDeformSDPAFusion',
    num_views=num_views,
    in_channels=3,
    embed_dims=64,
    patch_size=4,
    num_layers=2,
    num_classes=10,
    ffn_ratio=2,
    attn_cfg=dict(
        type='DeformableSDPAttention',
        num_heads=4,
        num_samples=8,
        init_radius=2.0,
        backend=None,  # None: the process default ('auto': Triton on CUDA, the PyTorch reference on CPU)
    ),
)
