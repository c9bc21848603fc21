"""FastInferenceHook: validation and testing through graph inference, with the test pipeline's canvases."""
import copy
import types
from pathlib import Path

import pytest
import torch

import deform_plugin  # noqa: F401  (mmcv stand-in where mmcv-lite is installed)
from deform_plugin.engine import FastInferenceHook

ROOT = Path(__file__).resolve().parents[2]


def _runner(model, pipeline):
    from mmengine.config import Config
    cfg = Config(dict(test_dataloader=dict(dataset=dict(pipeline=pipeline))))
    return types.SimpleNamespace(model=model, cfg=cfg)


@pytest.fixture(scope="module")
def demo_model():
    from mmdet.registry import MODELS
    from mmdet.utils import register_all_modules
    from mmengine.config import Config
    register_all_modules()
    cfg = Config.fromfile(str(ROOT / "configs/demo/deformable-detr-refine_r18_tiny_1xb4-500i_shapes.py"))
    torch.manual_seed(0)
    return MODELS.build(cfg.model)


def test_the_hook_gives_the_model_graph_inference_with_the_pipelines_canvases(demo_model):
    pipeline = [dict(type="LoadImageFromFile"), dict(type="Resize", scale=(1333, 800), keep_ratio=True)]
    hook = FastInferenceHook(size_divisor=64, max_graphs=3, canvases="auto", feature_bucket_size=None)
    demo_model.train()
    hook.before_test(_runner(demo_model, pipeline))
    graph_inference = hook.graph_inference
    assert demo_model.predict == graph_inference.predict and demo_model.training  # training mode left as it was
    assert graph_inference.buckets.canvases == ((832, 1344), (1344, 832))  # (800, 1333) in 64 px steps
    assert graph_inference.policy.max_graphs == 3 and graph_inference.buckets.size_divisor == 64
    hook.before_val(_runner(demo_model, pipeline))
    assert hook.graph_inference is graph_inference  # enabled once


def test_by_default_the_detrs_pad_feature_maps_the_others_images_to_32_px_buckets(demo_model):
    from deform_plugin.integration.mmdet_feature_bucket_inference import FeatureBucketInference
    hook = FastInferenceHook()
    hook.before_val(_runner(copy.deepcopy(demo_model), [dict(type="Resize", scale=(1333, 800), keep_ratio=True)]))
    assert isinstance(hook.graph_inference, FeatureBucketInference)
    assert hook.graph_inference.feature_bucket_size == 128
    hook = FastInferenceHook(feature_bucket_size=None)
    hook.before_val(_runner(demo_model, [dict(type="Resize", scale=(1333, 800), keep_ratio=True)]))
    buckets = hook.graph_inference.buckets
    assert (buckets.size_divisor, buckets.canvases, buckets.borrow_max_pixels) == (32, (), 1.15)
    with pytest.raises(ValueError, match="feature_bucket_size must be an int >= 1 .* got 0"):
        FastInferenceHook(feature_bucket_size=0)


def test_feature_buckets_is_a_deprecated_name_for_feature_bucket_size(demo_model):
    from deform_plugin.integration.mmdet_feature_bucket_inference import FeatureBucketInference
    pipeline = [dict(type="Resize", scale=(1333, 800), keep_ratio=True)]
    with pytest.warns(DeprecationWarning, match="feature_buckets is deprecated, pass feature_bucket_size=64") as got:
        hook = FastInferenceHook(feature_buckets=64)
    ours = [each for each in got if "feature_buckets is deprecated" in str(each.message)]
    assert len(ours) == 1 and ours[0].filename == __file__  # the warning points at the caller's line
    assert hook.feature_bucket_size == 64
    hook.before_val(_runner(copy.deepcopy(demo_model), pipeline))
    assert isinstance(hook.graph_inference, FeatureBucketInference) and hook.graph_inference.feature_bucket_size == 64
    with pytest.warns(DeprecationWarning, match="pass feature_bucket_size=None"):
        hook = FastInferenceHook(feature_buckets=None)
    hook.before_val(_runner(copy.deepcopy(demo_model), pipeline))
    assert not isinstance(hook.graph_inference, FeatureBucketInference)
    assert hook.graph_inference.buckets.size_divisor == 32
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="feature_buckets must be an int >= 1 .* "
                                                         "got 0"):
        FastInferenceHook(feature_buckets=0)


def test_feature_bucket_size_and_its_deprecated_name_together_are_refused():
    for new, old in ((128, 64), (None, None), (128, 128)):
        with pytest.raises(ValueError, match=f"FastInferenceHook: pass feature_bucket_size or feature_buckets .*not "
                           f"both; got feature_bucket_size={new} and feature_buckets={old}"):
            FastInferenceHook(feature_bucket_size=new, feature_buckets=old)


def test_without_buckets_the_inputs_keep_their_shapes(demo_model):
    hook = FastInferenceHook(buckets=False, feature_bucket_size=None)
    hook.before_val(_runner(demo_model, []))
    assert hook.graph_inference.buckets is None


def test_a_model_without_graph_inference_is_evaluated_as_it_is():
    hook = FastInferenceHook()
    model = torch.nn.Linear(2, 2)
    hook.before_test(_runner(model, []))
    assert hook.graph_inference is False and "predict" not in vars(model)


def test_bad_settings_fail_when_the_hook_is_built():
    with pytest.raises(ValueError, match="size_divisor must be an int >= 1, got 0"):
        FastInferenceHook(size_divisor=0)
    with pytest.raises(ValueError, match="capture_after must be an int >= 1, got 0"):
        FastInferenceHook(capture_after=0)
    with pytest.raises(ValueError, match="canvases must be None, 'auto' or"):
        FastInferenceHook(canvases="largest")
