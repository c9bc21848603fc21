"""DDQ-DETR's distinct queries selected on the device (sync_free_distinct_queries): the same masks, proposals and
detections as mmdet's NMS, from fixed-size tensors, so that graph inference replays the whole forward."""
import copy

import pytest
import stock_worker
import torch
from ddq_heads import ddq_training_batch, flat_losses
from small_detectors import small_detector

import deform_plugin  # noqa: F401  (mmcv stand-in where mmcv-lite is installed)
from deform_plugin.integration.mmdet_fast_paths.ddq_distinct_queries import (
    enable_sync_free_distinct_queries, kernel_visit_ranks, nms_boxes_like_batched_nms,
    selects_distinct_queries_sync_free)

# mmcv's batched_nms takes its group-by-group path from split_thr boxes on; the small detectors have a few hundred
# tokens and 30 queries, so "grouped" lowers it to reach that path too.
SPLIT_THR = {"at-once": None, "grouped": 16}


def _small_ddq(iou_threshold=0.8, split_thr=None, dtype=torch.float32):
    detector = small_detector("ddq", dtype=dtype, layers=2, feedforward_channels=256, queries=30)
    config = dict(type="nms", iou_threshold=iou_threshold)
    if split_thr is not None:
        config["split_thr"] = split_thr
    detector.cache_dict["dqs_cfg"] = config
    return detector


def _references(batch, queries, generator):
    """Normalised cx-cy-w-h boxes in clusters of four near-duplicates (some pairs above DDQ's 0.8 IoU, some below)."""
    corners = (torch.rand(batch * queries // 4 + 1, 2, generator=generator) * 50).repeat_interleave(4, 0)
    corners = corners[:batch * queries] + torch.rand(batch * queries, 2, generator=generator) * 0.6
    size = 10 + torch.rand(batch * queries, 2, generator=generator) * 2
    return torch.cat([corners + size / 2, size], 1).view(batch, queries, 4) / 64


@pytest.mark.parametrize("layout, path", [("inference", "grouped"), ("after-denoising-queries", "at-once")])
def test_the_decoders_selection_is_mmdets_for_each_image_and_its_open_queries(layout, path):
    stock = _small_ddq(split_thr=SPLIT_THR[path]).eval()
    ours = copy.deepcopy(stock)
    assert enable_sync_free_distinct_queries(ours) == 1 and selects_distinct_queries_sync_free(ours)
    batch, heads, distinct = 2, stock.cache_dict["num_heads"], 30
    dis_start = 0 if layout == "inference" else 6  # training puts the denoising queries first
    total = dis_start + distinct
    generator = torch.Generator().manual_seed(3)
    references = torch.cat([torch.rand(batch, dis_start, 4, generator=generator),
                            _references(batch, distinct, generator)], 1)
    query = torch.randn(batch, total, stock.decoder.embed_dims, generator=generator)
    # A previous layer's selection: image 0 kept every query; image 1 kept a subset without query 0, which mmdet
    # then reads as the queries still open.
    mask = torch.zeros(batch * heads, total, total, dtype=torch.bool)
    mask[:, :dis_start, dis_start:] = True  # the denoising queries do not see the distinct ones
    previous = torch.rand(distinct, generator=generator) < 0.6
    previous[0] = False
    closed = ~(previous[:, None] | previous[None, :])
    mask[heads:, dis_start:, dis_start:] = closed
    results = []
    for detector in (stock, ours):
        detector.cache_dict["dis_query_info"] = [dis_start, distinct]
        detector.cache_dict["distinct_query_mask"] = []
        with torch.no_grad():
            got = detector.decoder.select_distinct_queries(references, query, mask.clone(), 0)
        results.append((got, detector.cache_dict["distinct_query_mask"][-1]))
    (stock_mask, stock_distinct), (our_mask, our_distinct) = results
    assert torch.equal(our_mask, stock_mask) and torch.equal(our_distinct, stock_distinct)
    kept_open = stock_distinct[::heads, 0]
    assert 0 < int(kept_open[1].sum()) < int(previous.sum())  # NMS dropped some of image 1's open queries
    assert not bool(kept_open[1][~previous].any())  # and opened none of its closed ones


PRE_DECODER_CASES = {  # level shapes, IoU threshold, whether fewer than the 30 queries are kept
    "ddq": ([[12, 16], [6, 8], [3, 4]], 0.8, False),
    "every-overlap-suppresses": ([[12, 16], [6, 8], [3, 4]], 0.0, None),
    "fewer-tokens-than-queries": ([[4, 4], [2, 2], [1, 1]], 0.8, True),
}


@pytest.mark.parametrize("case, path", [("ddq", "grouped"), ("every-overlap-suppresses", "at-once"),
                                        ("fewer-tokens-than-queries", "at-once")])
def test_pre_decoder_takes_mmdets_proposals_and_pads_as_it_does(case, path):
    level_shapes, iou_threshold, padded = PRE_DECODER_CASES[case]
    stock = _small_ddq(iou_threshold, SPLIT_THR[path]).eval()
    ours = copy.deepcopy(stock)
    enable_sync_free_distinct_queries(ours)
    generator = torch.Generator().manual_seed(5)
    shapes = torch.tensor(level_shapes)
    tokens = int((shapes[:, 0] * shapes[:, 1]).sum())
    memory = torch.randn(2, tokens, stock.embed_dims, generator=generator)
    memory_mask = torch.zeros(2, tokens, dtype=torch.bool)
    memory_mask[1, :tokens // 6] = True  # image 1's padding
    outputs = []
    for detector in (stock, ours):
        with torch.no_grad():
            outputs.append(detector.pre_decoder(memory, memory_mask, shapes))
    (stock_inputs, stock_head), (our_inputs, our_head) = outputs
    assert our_head == stock_head == {} and our_inputs["dn_mask"] is stock_inputs["dn_mask"] is None
    assert torch.equal(our_inputs["reference_points"], stock_inputs["reference_points"])
    # Tokens without a valid proposal (padding, or a proposal too near the border) tie: mmdet zeroes their memory
    # for the heads and gives them an infinite proposal, so they share one score and one box (reference point
    # 1, 1, 1, 1), and NMS keeps one of them, which one being up to the sort (ours visits ties in index order).
    # Their queries differ (the query map reads the unmasked memory): any such token's query is right there.
    from_tied = (stock_inputs["reference_points"] == 1).all(-1)
    torch.testing.assert_close(our_inputs["query"][~from_tied], stock_inputs["query"][~from_tied],
                               rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        _, proposals = ours.gen_encoder_output_proposals(memory, memory_mask, shapes)
        query_maps = ours.query_map(memory)
    for image in range(2):
        tied_queries = query_maps[image][~torch.isfinite(proposals[image]).all(-1)]
        for query in our_inputs["query"][image][from_tied[image]]:
            assert bool(torch.isclose(query, tied_queries, rtol=1e-6, atol=1e-6).all(-1).any())
    assert ours.cache_dict["dis_query_info"] == stock.cache_dict["dis_query_info"] == [0, 30]
    if padded is not None:  # align_tensor's zero rows after the last kept proposal
        assert bool((stock_inputs["query"] == 0).all(-1).any()) == padded


def test_boxes_are_shifted_as_batched_nms_shifts_one_class():
    boxes = torch.tensor([[[0.0, 0.0, 2.0, 3.0], [1.0, 1.0, 4.0, 2.0]], [[0.0, 0.0, 9.0, 1.0], [5.0, 5.0, 6.0, 6.0]]])
    shifted = nms_boxes_like_batched_nms(boxes, torch.tensor([[True, True], [False, True]]))
    assert torch.equal(shifted[0], boxes[0] + 5.0) and torch.equal(shifted[1], boxes[1] + 7.0)  # valid boxes only
    assert torch.equal(nms_boxes_like_batched_nms(boxes, torch.zeros(2, 2, dtype=torch.bool)), boxes + 1.0)


def _crowd_after_the_first_decoder_layer(detector):
    # The first decoder layer moves every box far towards one corner, so that the selection after it has
    # overlapping boxes to drop (the encoder's NMS left the queries distinct, and a random layer moves them little).
    last = detector.bbox_head.reg_branches[0][-1]
    with torch.no_grad():
        last.weight.zero_()
        last.bias.fill_(3.0)
    return detector


def test_predict_gives_stocks_detections_from_one_region():
    from deform_plugin.apis import enable_fast_inference
    from deform_plugin.integration import mmdet_graph_inference
    stock = _crowd_after_the_first_decoder_layer(_small_ddq()).eval()
    ours = copy.deepcopy(stock)
    changed = enable_fast_inference(ours)
    assert changed["sync_free_distinct_queries"] == 1
    assert changed["graph_inference"].region is mmdet_graph_inference._ddq_region
    inputs, samples = stock_worker.detection_inputs(batch=1, height=224, width=256)  # its own 32 px bucket
    with torch.no_grad():
        (expected,) = stock.predict(inputs.float(), copy.deepcopy(samples))
        (got,) = ours.predict(inputs.float(), copy.deepcopy(samples))
    for name in ("labels", "scores", "bboxes"):
        torch.testing.assert_close(getattr(got.pred_instances, name), getattr(expected.pred_instances, name),
                                   rtol=1e-5, atol=1e-4)
    distinct = stock.cache_dict["distinct_query_mask"][-1][0, 0]
    assert 0 < int(distinct.sum()) < 30  # the detections come from the queries the selection kept


def test_the_whole_forward_region_reads_nothing_from_the_host_and_nothing_back():
    # A CUDA graph cannot capture a copy from pageable host memory (such as a tensor built from a Python number on
    # the device) nor a read back: the region must make neither.
    from host_transfers import HostTransferSpy

    from deform_plugin.apis import enable_fast_inference
    from deform_plugin.integration.mmdet_fast_paths.graphed_inputs import image_sizes_tensor
    detector = _crowd_after_the_first_decoder_layer(_small_ddq()).eval()
    inference = enable_fast_inference(detector)["graph_inference"]
    inputs, samples = stock_worker.detection_inputs(batch=1, height=224, width=256)
    inputs = inputs.float()
    with torch.no_grad(), HostTransferSpy() as spy:
        inference.region(detector, inputs, image_sizes_tensor(samples, inputs.device))
    # _corners: the CPU reference op's sampling tables; the PyTorch NMS path's own loop (a GPU runs Triton's).
    assert [call for call in spy.calls if call[1] not in ("_corners", "greedy_nms_first_kept_reference")] == []


def test_training_keeps_mmdets_pre_decoder_and_configurations_not_mirrored_keep_mmdets_methods():
    detector = _small_ddq()
    enable_sync_free_distinct_queries(detector)
    assert selects_distinct_queries_sync_free(detector)
    copied = copy.deepcopy(detector)  # the copy's methods run on the copy
    assert copied.pre_decoder.__self__ is copied and copied.decoder.select_distinct_queries.__self__ is copied.decoder
    agnostic = _small_ddq()
    agnostic.cache_dict["dqs_cfg"] = dict(type="nms", iou_threshold=0.8, class_agnostic=True)
    soft = _small_ddq()
    soft.cache_dict["dqs_cfg"] = dict(type="soft_nms", iou_threshold=0.8)
    assert enable_sync_free_distinct_queries(agnostic) == enable_sync_free_distinct_queries(soft) == 0
    assert "pre_decoder" not in vars(agnostic) and "select_distinct_queries" not in vars(soft.decoder)


def test_a_training_step_is_mmdets_bitwise():
    # Training: mmdet's pre_decoder (its NMS in float32: a no-op here) and the decoder's selection on the device.
    stock = _crowd_after_the_first_decoder_layer(_small_ddq())
    ours = copy.deepcopy(stock)
    enable_sync_free_distinct_queries(ours)
    inputs, samples = ddq_training_batch()
    losses = []
    for detector in (stock, ours):
        torch.manual_seed(3)  # the denoising queries are random
        losses.append(flat_losses(detector.loss(inputs, copy.deepcopy(samples))))
    assert list(losses[1]) == list(losses[0])
    for name in losses[0]:
        assert torch.equal(losses[1][name], losses[0][name]), name
    (stock_selection,), (our_selection,) = stock.cache_dict["distinct_query_mask"], ours.cache_dict[
        "distinct_query_mask"]  # two decoder layers: one selection between them
    assert torch.equal(our_selection, stock_selection) and not bool(stock_selection.all())  # some queries closed


def test_the_visit_ranks_order_ties_as_mmcvs_kernel_sort_does():
    # Many exact ties (a padded image's padding tokens share one score): greedy NMS over the ranks visits the boxes
    # in the order of the kernels' own sort, so that of tied identical boxes it keeps the one mmcv keeps.
    from deform_plugin.ops import greedy_nms_first_kept
    scores = torch.tensor([0.3, 1.0, 0.2, 1.0, 1.0, 0.5, 1.0] * 40, dtype=torch.float64)[None].repeat(2, 1)
    scores[1, 5] = 2.0
    ranks = kernel_visit_ranks(scores)
    assert ranks.dtype == torch.float32
    for image in range(2):
        kernel_order = scores[image].sort(0, descending=True)[1]
        assert torch.equal(ranks[image].sort(descending=True).indices, kernel_order)
        assert ranks[image].unique().numel() == scores.shape[1]  # strictly ordered
    boxes = torch.tensor([0.0, 0.0, 1.0, 1.0]).expand(2, scores.shape[1], 4)  # every box the same: one is kept
    kept, count = greedy_nms_first_kept(boxes, ranks, None, 0.8, max_kept=3)
    assert count.tolist() == [1, 1]
    assert kept[:, 0].tolist() == [int(scores[image].sort(0, descending=True)[1][0]) for image in range(2)]

