"""Feature-bucket graph inference gives the unpadded input's detections: on the CPU with emulated graphs (float64),
on a GPU with real ones."""
import copy

import pytest
import stock_worker
import torch
from emulated_graphs import ReRunInferenceGraph
from small_detectors import small_detector, with_fractional_offsets

import deform_plugin  # noqa: F401  (mmcv-lite stand-in; registers our module)
from deform_plugin.apis import enable_fast_inference
from deform_plugin.cuda_graphs import CapturePolicy
from deform_plugin.integration.mmdet_fast_paths import apply_fast_paths
from deform_plugin.integration.mmdet_fast_paths.graphed_inputs import image_sizes_tensor
from deform_plugin.integration.mmdet_fast_paths.padded_levels import pad_levels
from deform_plugin.integration.mmdet_feature_bucket_inference import (FeatureBucketInference,
                                                                      supports_feature_buckets,
                                                                      transformer_and_head)

# Five input sizes, the first four in one 64 px feature bucket of the small detectors' levels, the last in another.
SIZES = [(224, 256), (208, 240), (224, 256), (200, 250), (288, 256)]


class EmulatedFeatureBucketInference(FeatureBucketInference):
    device_type = "cpu"

    def capture_graph(self, work, cache=None):
        outputs = work()
        return ReRunInferenceGraph(work, outputs), outputs


def _predictions(samples):
    instances = samples[0].pred_instances
    return {key: instances[key] for key in ("bboxes", "scores", "labels")}


@pytest.mark.parametrize("name", ["deformable-detr", "deformable-detr-two-stage", "dino"])
def test_feature_buckets_give_the_unpadded_detections(name):
    stock = with_fractional_offsets(small_detector(name, dtype=torch.float64, layers=2).eval())
    fast = copy.deepcopy(stock)
    apply_fast_paths(fast, sdpa_attention=True, sync_free_forward=True)
    assert supports_feature_buckets(fast)
    inference = EmulatedFeatureBucketInference(fast, policy=CapturePolicy(capture_after=2), feature_bucket_size=64)
    fast.predict = inference.predict
    with torch.no_grad():
        for height, width in SIZES:
            inputs, samples = stock_worker.detection_inputs(batch=1, height=height, width=width, seed=height + width)
            # The head's outputs on the padded levels are the unpadded forward's (mmdet makes reference points in
            # float32: the padding changes their rounding, relative 1e-7).
            expected_outs = stock._forward(inputs, copy.deepcopy(samples))
            features = fast.extract_feat(inputs)
            levels = pad_levels(features, image_sizes_tensor(samples, inputs.device), (height, width), 64)
            assert [tuple(f.shape) for f in levels.features] != [tuple(f.shape) for f in features] or height == 224
            got_outs = transformer_and_head(fast, levels.features, levels.masks, levels.unpadded_shapes)
            for ours, theirs in zip(got_outs, expected_outs):
                torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
            # The whole predict, replayed where its graphs are: the same scores (their order among near-ties of an
            # untrained head may differ by rounding, so the sorted values).
            expected = _predictions(stock.predict(inputs, copy.deepcopy(samples)))
            got = _predictions(fast.predict(inputs, copy.deepcopy(samples)))
            torch.testing.assert_close(got["scores"].sort().values, expected["scores"].sort().values, rtol=1e-6,
                                       atol=1e-9)
    # The backbone: its first call warms up, 224 x 256 is captured at its second call. The transformer: the first
    # bucket warmed up by the first call, captured at the second and replayed after; the second bucket captured at
    # its first call.
    backbone, transformer = inference.feature_graphs, inference.graphs
    assert (len(backbone.entries), backbone.replays, backbone.eager_calls) == (1, 1, 4)
    assert (len(transformer.entries), transformer.replays, transformer.eager_calls) == (2, 4, 1)
    stats = inference.stats()
    assert stats["graphs"] == 2 and stats["backbone"]["graphs"] == 1 and stats["padded_pixels"] > 0


def test_feature_buckets_are_for_the_detrs_others_keep_image_buckets():
    from deform_plugin.integration.mmdet_graph_inference import GraphInference
    for name, expected in (("dino", FeatureBucketInference), ("mask2former", GraphInference)):
        changed = enable_fast_inference(small_detector(name, dtype=torch.float64, layers=2).eval(),
                                        feature_bucket_size=128, cpu_threads=None)
        assert type(changed["graph_inference"]) is expected
    with pytest.raises(ValueError, match="feature_bucket_size must be an int >= 1 .*got 0"):
        enable_fast_inference(small_detector("dino", dtype=torch.float64, layers=2).eval(), feature_bucket_size=0)
    with pytest.raises(TypeError, match="Linear has no feature-bucket inference"):
        FeatureBucketInference(torch.nn.Linear(2, 2))


def test_feature_buckets_is_a_deprecated_name_for_feature_bucket_size():
    from deform_plugin.integration.mmdet_graph_inference import GraphInference
    # The models are built outside pytest.warns: building one warns of mmengine's own deprecations.
    model = small_detector("dino", dtype=torch.float64, layers=2).eval()
    with pytest.warns(DeprecationWarning, match="enable_fast_inference: feature_buckets is deprecated, pass "
                      "feature_bucket_size=64 instead") as got:
        changed = enable_fast_inference(model, feature_buckets=64, cpu_threads=None)
    ours = [each for each in got if "feature_buckets is deprecated" in str(each.message)]
    assert len(ours) == 1 and ours[0].filename == __file__  # the warning points at the caller's line
    inference = changed["graph_inference"]
    assert type(inference) is FeatureBucketInference and inference.feature_bucket_size == 64
    model = small_detector("dino", dtype=torch.float64, layers=2).eval()
    with pytest.warns(DeprecationWarning, match="pass feature_bucket_size=None"):
        changed = enable_fast_inference(model, feature_buckets=None, cpu_threads=None)
    assert type(changed["graph_inference"]) is GraphInference
    model = small_detector("dino", dtype=torch.float64, layers=2).eval()
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="enable_fast_inference: feature_buckets "
                                                         "must be an int >= 1 .*got 0"):
        enable_fast_inference(model, feature_buckets=0)


def test_feature_bucket_size_and_its_deprecated_name_together_are_refused():
    model = small_detector("dino", dtype=torch.float64, layers=2).eval()
    with pytest.raises(ValueError, match="enable_fast_inference: pass feature_bucket_size or feature_buckets .*not "
                       "both; got feature_bucket_size=128 and feature_buckets=None"):
        enable_fast_inference(model, feature_bucket_size=128, feature_buckets=None, cpu_threads=None)
    assert "predict" not in vars(model)  # refused before the model is changed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("name", ["deformable-detr-two-stage", "dino"])
def test_feature_bucket_graphs_give_the_eager_detections_on_a_gpu(name):
    stock = with_fractional_offsets(small_detector(name, dtype=torch.float32, layers=2)).cuda().eval()
    fast = copy.deepcopy(stock)
    changed = enable_fast_inference(fast, feature_bucket_size=64, cpu_threads=None, cudnn_v7_api=False)
    inference = changed["graph_inference"]
    assert isinstance(inference, FeatureBucketInference)
    with torch.no_grad():
        for height, width in SIZES:
            inputs, samples = stock_worker.detection_inputs(batch=1, height=height, width=width, seed=height + width)
            inputs = inputs.float().cuda()
            expected = _predictions(stock.predict(inputs, copy.deepcopy(samples)))
            got = _predictions(fast.predict(inputs, copy.deepcopy(samples)))
            torch.testing.assert_close(got["scores"].sort().values, expected["scores"].sort().values, rtol=1e-3,
                                       atol=1e-4)
    assert len(inference.graphs.entries) == 2 and inference.graphs.replays == 4
