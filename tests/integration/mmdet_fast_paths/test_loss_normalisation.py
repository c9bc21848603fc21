"""sync_free_losses: the DETR heads' loss normalisers without host syncs average over ranks as stock's do (alone and
under batched_losses), DDQ-DETR's one-pass losses too."""
import copy

import pytest
import torch
from detr_heads import DEFORMABLE_DETR_KINDS, detr_head, detr_loss_inputs, losses_and_gradients
from gloo_ranks import run_gloo_ranks
from torch import nn

import deform_plugin  # noqa: F401  (mmcv stand-in where mmcv-lite is installed)
from deform_plugin.integration.mmdet_fast_paths import apply_fast_paths

# One pytest-xdist worker runs this whole module, so that its module-scoped fixture (processes) runs once.
pytestmark = pytest.mark.xdist_group("loss_normalisation")


_DETR_DDP_SWITCHES = {"sync-free-losses": dict(sync_free_losses=True),
                      "batched-losses": dict(sync_free_losses=True, batched_losses=True)}


_DETR_KINDS = (*DEFORMABLE_DETR_KINDS, "dino")


def _detr_ddp_worker(rank, out_dir):
    from host_transfers import HostTransferSpy
    for kind in _DETR_KINDS:
        for switches in _DETR_DDP_SWITCHES:  # each case its own heads
            stock_head = detr_head(kind)
            fast_head = copy.deepcopy(stock_head)
            holder = nn.Module()
            holder.bbox_head = fast_head
            apply_fast_paths(holder, **_DETR_DDP_SWITCHES[switches])
            # Each rank its own gts: the normalisers are the means of the ranks' counts.
            inputs = detr_loss_inputs(kind, ((3, 5), (0, 4))[rank], seed=rank)
            stock = losses_and_gradients(stock_head, inputs)
            with HostTransferSpy() as spy:
                fast = losses_and_gradients(fast_head, inputs)
            torch.save(dict(stock=stock, fast=fast, transfers=spy.calls),
                       out_dir / f"{kind}-{switches}-rank{rank}.pt")
    _ddq_case(rank, out_dir)


def _ddq_case(rank, out_dir):
    from ddq_heads import (KEPT_BY_THE_NMS, ddq_in_float64, ddq_loss_inputs, ddq_losses_and_gradients,
                           stock_and_one_pass_heads)
    from host_transfers import HostTransferSpy
    with ddq_in_float64():
        stock_head, fast_head, _ = stock_and_one_pass_heads()
        # Each rank its own gts: every normaliser is the mean of the ranks' counts or alignment sums.
        inputs = ddq_loss_inputs(stock_head, ((3, 0, 7), (2, 5, 1))[rank], KEPT_BY_THE_NMS, seed=rank)
        stock = ddq_losses_and_gradients(stock_head, inputs)
        with HostTransferSpy() as spy:
            fast = ddq_losses_and_gradients(fast_head, inputs)
    torch.save(dict(stock=stock, fast=fast, transfers=spy.calls), out_dir / f"ddq-rank{rank}.pt")


@pytest.fixture(scope="module")
def detr_ddp_results(tmp_path_factory):
    """Every case's results on both ranks, from one pair of gloo ranks (spawning a pair costs seconds)."""
    out_dir = tmp_path_factory.mktemp("detr_ddp")
    run_gloo_ranks(_detr_ddp_worker, out_dir)
    return out_dir


@pytest.mark.parametrize("switches", list(_DETR_DDP_SWITCHES))
@pytest.mark.parametrize("kind", _DETR_KINDS)
def test_detr_fast_losses_average_the_normalisers_over_ranks_as_stock_without_blocking(kind, switches,
                                                                                      detr_ddp_results):
    for rank in range(2):
        result = torch.load(detr_ddp_results / f"{kind}-{switches}-rank{rank}.pt")
        (stock, stock_grads), (fast, fast_grads) = result["stock"], result["fast"]
        assert list(fast) == list(stock)
        for name in stock:
            assert fast[name].shape == stock[name].shape, (rank, name)
        if switches == "sync-free-losses":
            # Per layer, stock's arithmetic on the same normalisers: bitwise.
            for name in stock:
                assert torch.equal(fast[name], stock[name]), (rank, name)
            for name in stock_grads:
                assert torch.equal(fast_grads[name], stock_grads[name]), (rank, name)
            # The stock per-layer targets still block; the normalisers no longer do (new_tensor would).
            assert not [call for call in result["transfers"] if call[1] == "detr_loss_by_feat_single_sync_free"]
        else:
            # Every layer at once: sums over a (layers, ...) view, each loss weight applied before the division
            # (stock: after), a float32 rounding apart where the mean count (6 here) is not a power of two.
            for name in stock:
                torch.testing.assert_close(fast[name], stock[name], rtol=1e-5, atol=1e-7)
            for name in stock_grads:
                torch.testing.assert_close(fast_grads[name], stock_grads[name], rtol=1e-5, atol=1e-8)
            assert result["transfers"] == [("cpu", "costs_to_host")], (rank, result["transfers"])


def test_ddq_one_pass_losses_average_the_normalisers_over_ranks_as_stock(detr_ddp_results):
    for rank in range(2):
        result = torch.load(detr_ddp_results / f"ddq-rank{rank}.pt")
        (stock, stock_grads), (fast, fast_grads) = result["stock"], result["fast"]
        assert list(fast) == list(stock)
        for name in stock:  # float64, the normalisers averaged as stock averages them
            assert fast[name].shape == stock[name].shape, (rank, name)
            torch.testing.assert_close(fast[name], stock[name], rtol=1e-12, atol=1e-14, msg=f"rank {rank} {name}")
        for ours, theirs in zip(fast_grads, stock_grads):
            if theirs is not None:
                torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-13)
        assert result["transfers"] == [("cpu", "costs_to_host")], (rank, result["transfers"])
