"""DDQ-DETR's losses in one pass (batched_losses on a DDQDETRHead) give the stock head's losses and gradients, and
copy to the host once."""
import pytest
import torch
from ddq_heads import (KEPT_BY_THE_NMS, ddq_head, ddq_in_float64, ddq_loss_inputs, ddq_losses_and_gradients,
                       stock_and_one_pass_heads)
from torch import nn

import deform_plugin  # noqa: F401  (mmcv stand-in where mmcv-lite is installed)
from deform_plugin.integration.mmdet_fast_paths import apply_fast_paths


@pytest.fixture
def float64():
    with ddq_in_float64():
        yield


# Images with 3, 0 and 7 gts: the dense matching takes each gt 4 times (12 dense queries / 3 gts), none, and once
# (12 // 7); an image without gts has no matching, no dense targets, and the denoising part pads it.
@pytest.mark.parametrize("num_gts", [(3, 0, 7), (2, 5, 1), (0, 0, 0)], ids=["gts3-0-7", "gts2-5-1", "gts0-0-0"])
def test_one_pass_gives_the_stock_losses_and_gradients(num_gts, float64):
    stock_head, fast_head, changed = stock_and_one_pass_heads()
    assert changed == {"hungarian_host_syncs": 1, "batched_matching": 1, "batched_losses": 1}
    inputs = ddq_loss_inputs(stock_head, num_gts, KEPT_BY_THE_NMS)
    stock, stock_grads = ddq_losses_and_gradients(stock_head, inputs)
    fast, fast_grads = ddq_losses_and_gradients(fast_head, inputs)
    assert list(fast) == list(stock)  # the same keys, in stock's order
    for name in stock:
        assert fast[name].shape == stock[name].shape, name
        # float64: the same elements, summed over other layouts.
        torch.testing.assert_close(fast[name], stock[name], rtol=1e-12, atol=1e-14, msg=name)
    for ours, theirs in zip(fast_grads, stock_grads):
        assert (ours is None) == (theirs is None)
        if theirs is not None:
            torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-13)
    if sum(num_gts):  # the checks above compare real losses: positives in every kind
        assert all(stock[name] > 0 for name in ("loss_bbox", "enc_loss_iou", "dn_loss_bbox", "1_aux_aux_loss_bbox[0]"))


def test_every_matching_of_the_step_reaches_the_host_in_one_copy(float64):
    from host_transfers import HostTransferSpy
    stock_head, fast_head, _ = stock_and_one_pass_heads()
    inputs = ddq_loss_inputs(stock_head, (3, 0, 7), KEPT_BY_THE_NMS)
    calls = []
    for head in (stock_head, fast_head):
        with HostTransferSpy() as spy:
            ddq_losses_and_gradients(head, inputs)
        calls.append(spy.calls)
    # Stock: per layer and image a mask selection, the Hungarian cost copy, nonzero() calls; per dense set and
    # image the one-to-k cost copy, unique() and a selection per matched gt; the normalisers' item().
    assert len(calls[0]) > 100, len(calls[0])
    assert calls[1] == [("cpu", "costs_to_host")]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs are a CUDA matter")
def test_one_pass_waits_for_the_gpu_once_on_cuda():
    from host_transfers import cuda_syncs_of
    stock_head, fast_head, _ = stock_and_one_pass_heads()
    stock_head, fast_head = stock_head.float().cuda(), fast_head.float().cuda()
    inputs = ddq_loss_inputs(stock_head, (3, 0, 7), KEPT_BY_THE_NMS)
    inputs = {name: value.float().cuda() if isinstance(value, torch.Tensor) else value
              for name, value in inputs.items()}
    for sample in inputs["batch_data_samples"]:
        sample.gt_instances = sample.gt_instances.to("cuda")
        sample.gt_instances.bboxes = sample.gt_instances.bboxes.float()
    masks = stock_head.cache_dict["distinct_query_mask"]  # the dict both heads share
    stock_head.cache_dict["distinct_query_mask"] = [mask.cuda() for mask in masks]
    syncs = [cuda_syncs_of(lambda: ddq_losses_and_gradients(head, inputs)) for head in (stock_head, fast_head)]
    # Stock: per layer and image the selection, the cost copy and nonzero(); per dense set and image more; ours: the
    # one copy of every cost matrix and the distinct-query masks.
    assert syncs[0] >= 100 and syncs[1] == 1, syncs


@pytest.mark.parametrize("change", ["own-loss", "other-aux-loss", "iou-loss"])
def test_heads_this_pass_does_not_reproduce_are_left_alone(change):
    from mmdet.models.losses import IoULoss

    from deform_plugin.integration.mmdet_fast_paths.ddq_losses import enable_ddq_one_pass_losses
    head = ddq_head()
    if change == "own-loss":
        head.__class__ = type("DDQWithOwnLoss", (type(head),), {"loss": lambda self, *a, **k: {}})
    elif change == "other-aux-loss":
        head.aux_loss_for_dense.loss_cls.activated = False
    else:
        head.loss_iou = IoULoss(loss_weight=2.0)
    holder = nn.Module()
    holder.bbox_head = head
    assert enable_ddq_one_pass_losses(holder) == 0 and "loss" not in vars(head)


def test_matching_in_one_pass_alone_leaves_ddqs_head_alone_and_says_so(monkeypatch):
    # DDQ's one pass computes the losses from the matching it solves: batched_matching alone has nothing to hand it.
    from deform_plugin.integration import mmdet_fast_paths
    notes = []
    monkeypatch.setattr(mmdet_fast_paths, "print_log", lambda message, logger, level: notes.append(message))
    holder = nn.Module()
    holder.bbox_head = ddq_head()
    assert apply_fast_paths(holder, batched_matching=True) == {"hungarian_host_syncs": 1, "batched_matching": 0}
    assert "loss" not in vars(holder.bbox_head)
    assert len(notes) == 1 and notes[0].startswith("deform_plugin: fast path batched_matching changes nothing in ")
    assert "DDQ-DETR heads (only with batched_losses" in notes[0]
