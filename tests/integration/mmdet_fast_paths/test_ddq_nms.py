"""float32_nms: DDQ-DETR's NMS takes its boxes and scores in float32, so that it runs under bf16 autocast (stock's
fails in mmcv's batched_nms) and keeps what float32 NMS keeps of the step's values; in float32 nothing changes."""
import copy

import pytest
import stock_worker
import torch
from ddq_heads import ddq_training_batch, flat_losses
from small_detectors import small_detector

import deform_plugin  # noqa: F401  (mmcv stand-in where mmcv-lite is installed)
from deform_plugin.integration.mmdet_fast_paths import apply_fast_paths
from deform_plugin.integration.mmdet_fast_paths.ddq_nms import float32_batched_nms

# mmcv's batched_nms runs NMS group by group from split_thr boxes on (10000 by default, which the encoder's proposals
# exceed at COCO sizes): the path where bf16 scores fail. The small detectors' encoders have a few hundred tokens
# and 30 queries, so the tests lower it to take that path.
GROUPED_FROM = 16
# What stock's batched_nms raises there: its float32 NMS scores put into a tensor of the bf16 scores' dtype.
INDEX_PUT_REFUSAL = "Index put requires the source and destination dtypes match"
GROUPED = dict(type="nms", iou_threshold=0.8, split_thr=GROUPED_FROM)


def _clustered_boxes(count, generator):
    """x1-y1-x2-y2 boxes in clusters of four near-duplicates: some pairs overlap above DDQ's IoU threshold of 0.8,
    others below it."""
    corners = (torch.rand(count // 4, 2, generator=generator) * 50).repeat_interleave(4, 0)
    corners = corners + torch.rand(count, 2, generator=generator) * 0.6
    return torch.cat([corners, corners + 10 + torch.rand(count, 2, generator=generator) * 2], 1)


@pytest.mark.parametrize("boxes_dtype", [torch.float32, torch.bfloat16], ids=["float32-boxes", "bf16-boxes"])
@pytest.mark.parametrize("nms_cfg", [GROUPED, dict(type="nms", iou_threshold=0.8), None],
                         ids=["grouped", "at-once", "sort-only"])
def test_bf16_inputs_keep_what_float32_nms_keeps_of_their_values(boxes_dtype, nms_cfg):
    # DDQ-DETR's calls: one group; "sort-only" is the dense queries' order (nms_cfg None).
    from mmcv.ops import batched_nms
    generator = torch.Generator().manual_seed(0)
    boxes = _clustered_boxes(64, generator).to(boxes_dtype)
    scores = torch.rand(64, generator=generator).bfloat16()
    groups = torch.ones(64)
    _, kept = float32_batched_nms(batched_nms)(boxes, scores, groups, nms_cfg)
    _, expected = batched_nms(boxes.float(), scores.float(), groups, nms_cfg)
    assert torch.equal(kept, expected)
    if nms_cfg is not None:
        assert 0 < len(expected) < len(boxes)  # some boxes suppressed, some kept


def test_stock_batched_nms_fails_on_bf16_scores_of_float32_boxes_from_split_thr_on():
    # DDQ-DETR's encoder NMS under autocast: float32 boxes (the box branch's bf16 output added to float32
    # proposals), bf16 scores.
    from mmcv.ops import batched_nms
    generator = torch.Generator().manual_seed(0)
    boxes, scores = _clustered_boxes(64, generator), torch.rand(64, generator=generator).bfloat16()
    with pytest.raises(RuntimeError, match=INDEX_PUT_REFUSAL):
        batched_nms(boxes, scores, torch.ones(64), GROUPED)
    batched_nms(boxes, scores, torch.ones(64), dict(GROUPED, split_thr=65))  # below split_thr it runs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_float32_and_float64_inputs_reach_batched_nms_as_they_are(dtype):
    seen = []
    nms = float32_batched_nms(lambda *args: seen.append(args))
    boxes, scores, groups = torch.rand(5, 4, dtype=dtype), torch.rand(5, dtype=dtype), torch.ones(5)
    nms(boxes, scores, groups, GROUPED)
    assert seen[0][0] is boxes and seen[0][1] is scores and seen[0][2] is groups and seen[0][3] is GROUPED


def test_half_inputs_reach_batched_nms_in_float32():
    seen = []
    boxes, scores = torch.rand(5, 4), torch.rand(5)
    float32_batched_nms(lambda *args: seen.append(args))(boxes.half(), scores.half(), torch.ones(5), None)
    assert seen[0][0].dtype == seen[0][1].dtype == torch.float32
    assert torch.equal(seen[0][0], boxes.half().float()) and torch.equal(seen[0][1], scores.half().float())


def _small_ddq(grouped=True):
    """A small float32 DDQ-DETR (two encoder and decoder layers, 30 queries, 45 dense ones in training); ``grouped``:
    its NMS takes mmcv's group-by-group path, as the encoder's does at COCO sizes."""
    detector = small_detector("ddq", dtype=torch.float32, layers=2, feedforward_channels=256, queries=30)
    if grouped:
        detector.cache_dict["dqs_cfg"] = dict(detector.cache_dict["dqs_cfg"], split_thr=GROUPED_FROM)
    return detector


@pytest.fixture
def nms_dtypes(monkeypatch):
    """The (boxes, scores) dtypes of every batched_nms call of mmdet's DDQ-DETR modules, in order (recorded where
    the methods look the name up, so both stock's and float32_nms' calls are seen; set before a model is switched)."""
    from mmcv.ops import batched_nms
    from mmdet.models.detectors import ddq_detr
    from mmdet.models.layers.transformer import ddq_detr_layers
    calls = []

    def recorded(boxes, scores, idxs, nms_cfg, class_agnostic=False):
        calls.append((boxes.dtype, scores.dtype))
        return batched_nms(boxes, scores, idxs, nms_cfg, class_agnostic)

    for module in (ddq_detr, ddq_detr_layers):
        monkeypatch.setattr(module, "batched_nms", recorded)
    return calls


def test_the_switch_changes_ddqs_two_nms_methods_and_nothing_else():
    detector = _small_ddq(grouped=False)
    before = {name: dict(vars(module)) for name, module in detector.named_modules()}
    assert apply_fast_paths(detector, float32_nms=True) == {"float32_nms": 2}
    changed = {name: {key for key, value in vars(module).items() if before[name].get(key, None) is not value}
               for name, module in detector.named_modules()}
    assert {name: keys for name, keys in changed.items() if keys} == {"": {"pre_decoder"},
                                                                      "decoder": {"select_distinct_queries"}}
    assert apply_fast_paths(detector, float32_nms=True) == {"float32_nms": 0}  # already switched
    copied = copy.deepcopy(detector)  # the copy's methods run on the copy
    assert copied.pre_decoder.__self__ is copied and copied.decoder.select_distinct_queries.__self__ is copied.decoder


def test_under_bf16_autocast_the_decoders_selection_keeps_what_float32_nms_keeps():
    from mmcv.ops import batched_nms
    from mmdet.structures.bbox import bbox_cxcywh_to_xyxy
    detector = _small_ddq().eval()
    decoder, cache = detector.decoder, detector.cache_dict
    stock_selection = decoder.select_distinct_queries
    apply_fast_paths(detector, float32_nms=True)
    batch, queries, heads = 2, 30, cache["num_heads"]
    cache["dis_query_info"] = [0, queries]
    generator = torch.Generator().manual_seed(1)
    # Normalised cx-cy-w-h references in clusters of near-duplicates, as the decoder refines them (float32).
    corners = _clustered_boxes(batch * 32, generator)[:batch * queries] / 64
    references = torch.cat([(corners[:, :2] + corners[:, 2:]) / 2, corners[:, 2:] - corners[:, :2]], 1)
    references = references.view(batch, queries, 4)
    query = torch.randn(batch, queries, decoder.embed_dims, generator=generator)
    every_query_open = torch.zeros(batch * heads, queries, queries, dtype=torch.bool)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match=INDEX_PUT_REFUSAL):
            stock_selection(references, query, every_query_open, 0)
        got = decoder.select_distinct_queries(references, query, every_query_open, 0)
        scores = cache["cls_branches"][0](query).sigmoid().max(-1).values
    assert scores.dtype == torch.bfloat16  # the class branch's output under autocast
    boxes = bbox_cxcywh_to_xyxy(references)
    for image in range(batch):
        _, kept = batched_nms(boxes[image], scores[image].float(), torch.ones(queries), cache["dqs_cfg"])
        assert 0 < len(kept) < queries
        closed = torch.ones(queries, queries, dtype=torch.bool)  # a kept query's row and column open
        closed[kept] = False
        closed[:, kept] = False
        for head in range(heads):
            assert torch.equal(got[image * heads + head], closed), (image, head)


def _step(detector, inputs, samples):
    torch.manual_seed(3)  # the denoising queries are random
    losses = flat_losses(detector.loss(inputs, copy.deepcopy(samples)))
    params = [p for p in detector.parameters() if p.requires_grad]
    grads = torch.autograd.grad(sum(value.sum() for value in losses.values()), params, allow_unused=True)
    return {name: value.detach() for name, value in losses.items()}, grads


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "at-once"])
def test_in_float32_the_step_and_the_detections_are_stocks_bitwise(grouped, nms_dtypes):
    stock = _small_ddq(grouped)
    ours = copy.deepcopy(stock)
    assert apply_fast_paths(ours, float32_nms=True) == {"float32_nms": 2}
    inputs, samples = ddq_training_batch()
    (expected, expected_grads), (got, got_grads) = (_step(model, inputs, samples) for model in (stock, ours))
    assert list(got) == list(expected)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    for theirs, mine in zip(expected_grads, got_grads):
        assert (theirs is None) == (mine is None) and (theirs is None or torch.equal(theirs, mine))
    assert all(torch.equal(a, b) for a, b in zip(stock.cache_dict["distinct_query_mask"],
                                                  ours.cache_dict["distinct_query_mask"]))
    with torch.no_grad():
        expected, got = (model.eval().predict(inputs, copy.deepcopy(samples)) for model in (stock, ours))
    for theirs, mine in zip(expected, got):
        for key in ("bboxes", "scores", "labels"):
            assert torch.equal(theirs.pred_instances[key], mine.pred_instances[key]), key
    assert set(nms_dtypes) == {(torch.float32, torch.float32)}


def test_under_bf16_autocast_a_training_step_runs_where_stocks_fails(nms_dtypes):
    # float32_nms with batched_losses, as the fast config has them: stock DDQAuxLoss's targets and quality focal
    # loss fail under autocast too, and the one-pass loss computes them in float32.
    stock = _small_ddq()
    ours = copy.deepcopy(stock)
    apply_fast_paths(ours, float32_nms=True, batched_losses=True)
    inputs, samples = ddq_training_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match=INDEX_PUT_REFUSAL):
            _step(stock, inputs, samples)
        assert set(nms_dtypes) == {(torch.float32, torch.bfloat16)}  # what stock's first NMS got
        nms_dtypes.clear()
        losses, grads = _step(ours, inputs, samples)
    # Per image: the encoder's NMS, the dense queries' sort, the NMS before the second decoder layer.
    assert nms_dtypes == [(torch.float32, torch.float32)] * 6
    assert all(torch.isfinite(value).all() for value in losses.values()) and losses["loss_cls"] > 0
    assert all(torch.isfinite(grad).all() for grad in grads if grad is not None)


def test_fast_inference_runs_ddq_under_bf16_autocast_where_stocks_predict_fails(nms_dtypes):
    from deform_plugin.apis import enable_fast_inference
    stock = _small_ddq().eval()
    ours = copy.deepcopy(stock)
    assert enable_fast_inference(ours)["float32_nms"] == 2
    inputs, samples = stock_worker.detection_inputs(batch=1, height=224, width=256)  # its own 32 px bucket
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match=INDEX_PUT_REFUSAL):
            stock.predict(inputs.float(), copy.deepcopy(samples))
        nms_dtypes.clear()
        (result,) = ours.predict(inputs.float(), copy.deepcopy(samples))
    # Its distinct queries are selected on the device (ddq_distinct_queries, in float32): mmcv's batched_nms is not
    # called at all.
    assert nms_dtypes == []
    instances = result.pred_instances
    assert len(instances.bboxes) > 0 and torch.isfinite(instances.bboxes).all() and torch.isfinite(
        instances.scores).all()


def test_fast_inference_selects_float32_nms_for_ddq_only():
    # Elsewhere it would change nothing and log so.
    from deform_plugin.apis import enable_fast_inference
    changed = enable_fast_inference(small_detector("dino", dtype=torch.float32, layers=1).eval())
    assert "float32_nms" not in changed and changed["sync_free_forward"] == 1
