"""Graph inference on real-photo sizes, with CUDA graphs emulated on the CPU: inputs padded to buckets, a shape
captured once it recurs, larger graphs borrowed, canvases for sizes that never repeat, no recapture past the caps;
a replay gives the detections of an eager call at the same padded shape."""
import copy
from pathlib import Path

import pytest
import stock_worker
import torch
from emulated_graphs import EmulatedGraphInference

import deform_plugin  # noqa: F401  (mmcv-lite stand-in; registers our module)
from deform_plugin.cuda_graphs import CapturePolicy, InferenceBuckets
from deform_plugin.integration.mmdet_fast_paths import apply_fast_paths
from deform_plugin.integration.mmdet_graph_inference import GraphInference

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dino():
    from mmengine.config import Config
    torch.manual_seed(0)
    cfg = Config.fromfile(str(ROOT / "configs/dino/dino-4scale_r50_8xb2-12e_coco_deform-plugin.py"))
    cfg.model.backbone.depth = 18
    cfg.model.neck.in_channels = [128, 256, 512]
    cfg.model.num_queries = 50
    # Two encoder and two decoder layers: what is checked is which calls run, capture or replay, and their detections.
    cfg.model.encoder.num_layers = cfg.model.decoder.num_layers = 2
    model = stock_worker.build_msda_owner(cfg)
    model.init_weights()
    apply_fast_paths(model, sync_free_forward=True)
    return model.eval()


def _inputs(height, width, seed=0):
    from mmdet.structures import DetDataSample
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(1, 3, height, width, generator=generator)
    sample = DetDataSample(metainfo=dict(img_shape=(height, width), batch_input_shape=(height, width),
                                         pad_shape=(height, width), ori_shape=(height, width), scale_factor=(1., 1.)))
    return inputs, [sample]


def _detections(inference, height, width, seed=0):
    inputs, samples = _inputs(height, width, seed)
    with torch.no_grad():
        result = inference.predict(inputs, samples)[0]
    return result.pred_instances, tuple(result.metainfo["batch_input_shape"])


def _decisions(inference, sizes):
    """What each call ran: 'eager', 'capture' or 'replay', and at which shape."""
    out = []
    for height, width in sizes:
        graphs = inference.graphs
        before = (len(graphs.entries), graphs.replays, graphs.eager_calls)
        _, shape = _detections(inference, height, width)
        after = (len(graphs.entries), graphs.replays, graphs.eager_calls)
        what = "capture" if after[0] > before[0] else "replay" if after[1] > before[1] else "eager"
        out.append((what, shape))
    return out


def test_images_of_one_bucket_share_its_graph_and_replays_give_the_eager_detections(dino):
    buckets = InferenceBuckets(size_divisor=64)
    graphed = EmulatedGraphInference(dino, buckets=buckets)
    never = EmulatedGraphInference(dino, buckets=buckets, policy=CapturePolicy(capture_after=1000))
    sizes = [(100, 120), (90, 110), (128, 70), (100, 120)]  # every one in the 128 x 128 bucket
    decisions = []
    for index, (height, width) in enumerate(sizes):
        before = graphed.graphs.replays
        ours, shape = _detections(graphed, height, width, seed=index)
        theirs, eager_shape = _detections(never, height, width, seed=index)
        assert shape == eager_shape == (128, 128)
        decisions.append(graphed.graphs.replays > before)
        # The same region function on the same padded input: replayed or eager, the same detections.
        for key in ("bboxes", "scores", "labels"):
            assert torch.equal(ours[key], theirs[key]), (index, key)
        # Boxes stay inside the image, not the padded input.
        assert float(ours.bboxes[:, 2].max()) <= width + 1e-3 and float(ours.bboxes[:, 3].max()) <= height + 1e-3
    assert decisions == [False, True, True, True]  # eager, then captured at its second call and replayed
    assert len(graphed.graphs.entries) == 1 and never.graphs.eager_calls == 4 and not never.graphs.entries


def test_without_buckets_each_exact_shape_is_its_own_signature(dino):
    inference = EmulatedGraphInference(dino, buckets=None)
    decisions = _decisions(inference, [(96, 128), (96, 130), (96, 128), (96, 130), (96, 128)])
    assert decisions == [("eager", (96, 128)), ("eager", (96, 130)), ("capture", (96, 128)),
                         ("capture", (96, 130)), ("replay", (96, 128))]


def test_sizes_that_never_repeat_run_on_their_canvas_once_it_earns_its_graph(dino):
    inference = EmulatedGraphInference(dino, buckets=InferenceBuckets(size_divisor=32, canvases=((256, 288),)))
    sizes = [(64 + 32 * i, 96 + 32 * i) for i in range(6)]  # six buckets, none twice, all within the canvas
    decisions = _decisions(inference, sizes)
    # The first call warms up; the second captures the canvas (it recurs by construction); all replay it after.
    assert decisions == [("eager", (64, 96)), ("capture", (256, 288))] + [("replay", (256, 288))] * 4
    assert inference.stats()["borrowed_calls"] == 5


def test_a_borrowing_bucket_earns_its_own_graph_at_own_graph_after(dino):
    buckets = InferenceBuckets(size_divisor=32, borrow_max_pixels=2.0, own_graph_after=3)
    inference = EmulatedGraphInference(dino, buckets=buckets)
    decisions = _decisions(inference, [(128, 128), (128, 128), (96, 128), (96, 128), (96, 128), (96, 128)])
    assert decisions == [("eager", (128, 128)), ("capture", (128, 128)), ("replay", (128, 128)),
                         ("replay", (128, 128)), ("capture", (96, 128)), ("replay", (96, 128))]


def test_past_max_graphs_shapes_are_never_recaptured(dino):
    inference = EmulatedGraphInference(dino, buckets=InferenceBuckets(size_divisor=32, borrow_max_pixels=1),
                                       policy=CapturePolicy(max_graphs=1))
    decisions = _decisions(inference, [(64, 64), (96, 96)] * 4)
    assert [what for what, _ in decisions].count("capture") == 1
    assert decisions[-2:] == [("replay", (64, 64)), ("eager", (96, 96))]
    assert "max_graphs" in inference.stats()["capped"]


def test_the_padding_keeps_the_unpadded_detections_close(dino):
    # The DETR masks the padding out of attention; only the convolutions' border features change. With random
    # weights the scores are flat, so the check is on what the padding may move: the top box stays put.
    padded = EmulatedGraphInference(dino, buckets=InferenceBuckets(size_divisor=64))
    exact = EmulatedGraphInference(dino, buckets=None)
    ours, shape = _detections(padded, 100, 120)
    theirs, exact_shape = _detections(exact, 100, 120)
    assert shape == (128, 128) and exact_shape == (100, 120)
    assert ours.bboxes.shape == theirs.bboxes.shape
    torch.testing.assert_close(ours.scores.max(), theirs.scores.max(), rtol=0.2, atol=0.02)


def test_where_graphs_cannot_run_inputs_are_padded_to_their_bucket_all_the_same(dino):
    inference = GraphInference(dino, buckets=InferenceBuckets(size_divisor=64))  # CUDA graphs: none on the CPU
    emulated = EmulatedGraphInference(dino, buckets=InferenceBuckets(size_divisor=64),
                                      policy=CapturePolicy(capture_after=1000))
    ours, shape = _detections(inference, 100, 120)
    theirs, _ = _detections(emulated, 100, 120)
    assert shape == (128, 128) and torch.equal(ours.bboxes, theirs.bboxes)
    assert not inference.graphs.entries


def test_without_buckets_where_graphs_cannot_run_the_predict_is_mmdets(dino):
    inference = GraphInference(dino, buckets=None)
    inputs, samples = _inputs(100, 120)
    with torch.no_grad():
        got = inference.predict(inputs, copy.deepcopy(samples))[0]
        expected = dino.predict(inputs, copy.deepcopy(samples))[0]
    assert tuple(got.metainfo["batch_input_shape"]) == (100, 120)
    assert torch.equal(got.pred_instances.bboxes, expected.pred_instances.bboxes)
    assert inference.graphs.eager_calls == 0 and not inference.graphs.entries
