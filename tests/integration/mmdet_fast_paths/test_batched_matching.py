"""batched_matching: every decoder layer's matching of a step in one cost pass gives bitwise the stock losses; the
batched cost matrices are each image's own."""
import copy

import pytest
import torch
from detr_heads import DEFORMABLE_DETR_KINDS, detr_head, detr_loss_inputs, random_boxes
from torch import nn

import deform_plugin  # noqa: F401  (mmcv stand-in where mmcv-lite is installed)
from deform_plugin.integration.mmdet_fast_paths import apply_fast_paths


@pytest.mark.parametrize("kind", [*DEFORMABLE_DETR_KINDS, "dino"])
@pytest.mark.parametrize("num_gts", [(3, 5), (0, 4)], ids=["gts3-5", "gts0-4"])
def test_batched_matching_and_sync_free_losses_give_the_stock_losses_bitwise(kind, num_gts, monkeypatch):
    from deform_plugin.integration.mmdet_fast_paths import batched_matching, matching
    stock_head = detr_head(kind)
    fast_head = copy.deepcopy(stock_head)
    holder = nn.Module()
    holder.bbox_head = fast_head
    changed = apply_fast_paths(holder, batched_matching=True, sync_free_losses=True)
    assert changed == {"hungarian_host_syncs": 1, "batched_matching": 1, "sync_free_losses": 1}
    cost_passes = []
    for module, name in ((matching, "_cost_matrix"), (batched_matching, "_cost_matrix"),
                         (batched_matching, "_batched_cost_matrices")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, __name=name, __original=original, **k:
                            cost_passes.append(__name) or __original(*a, **k))
    inputs = detr_loss_inputs(kind, num_gts)
    stock = stock_head.loss_by_feat(**inputs)
    fast = fast_head.loss_by_feat(**inputs)
    assert list(fast) == list(stock)
    for name in stock:
        assert torch.equal(fast[name], stock[name]), name
    # One cost pass for every decoder layer (and DINO's encoder) of every image with gts together, batched over the
    # images where several have gts; the two-stage encoder of Deformable-DETR matches binary proposals one pass per
    # image with gts, as before (batched_losses brings them into the step's pass).
    images_with_gts = sum(n > 0 for n in num_gts)
    decoder = ["_batched_cost_matrices" if images_with_gts > 1 else "_cost_matrix"] if images_with_gts else []
    encoder = ["_cost_matrix"] * images_with_gts if kind == "deformable-detr-two-stage" else []
    assert cost_passes == decoder + encoder
    assert fast_head.assigner.solved_ahead == {}  # nothing outlives the step


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_batched_cost_matrices_are_each_images_own_matrix(dtype):
    from mmengine.structures import InstanceData

    from deform_plugin.integration.mmdet_fast_paths.batched_matching import _batchable, _batched_cost_matrices
    from deform_plugin.integration.mmdet_fast_paths.matching import _cost_matrix
    from mmdet.structures.bbox import bbox_cxcywh_to_xyxy
    assigner = detr_head("dino").assigner
    generator = torch.Generator().manual_seed(3)
    problems = []
    for num_gts, (height, width) in zip((1, 6, 3), ((64, 96), (80, 48), (64, 64))):
        views = [(torch.randn(rows, 5, generator=generator, dtype=dtype),
                  (torch.rand(rows, 4, generator=generator, dtype=dtype) * 0.5 + 0.1)) for rows in (11, 11, 7)]
        gts = InstanceData(bboxes=random_boxes(num_gts, generator, width, height, degenerate=1).to(dtype),
                           labels=torch.randint(0, 5, (num_gts,), generator=generator))
        problems.append((gts, dict(img_shape=(height, width)), views))
    assert _batchable(assigner)
    batched = _batched_cost_matrices(assigner, problems)
    assert batched.shape == (3, 29, 6) and batched.dtype == dtype
    for block, (gts, meta, views) in zip(batched, problems):
        height, width = meta["img_shape"]
        factor = torch.tensor([[width, height, width, height]], dtype=dtype)
        preds = InstanceData(scores=torch.cat([s for s, _ in views]),
                             bboxes=bbox_cxcywh_to_xyxy(torch.cat([b for _, b in views])) * factor)
        own = _cost_matrix(assigner, preds, gts, meta)
        if dtype == torch.float64:
            assert torch.equal(block[:, :len(gts)], own)
        else:  # the CPU's vectorised float32 log/pow may round one element apart in another layout (one ulp)
            torch.testing.assert_close(block[:, :len(gts)], own, rtol=1e-6, atol=1e-6)
    from mmdet.models.task_modules.assigners.match_cost import ClassificationCost, FocalLossCost
    assigner.match_costs.append(ClassificationCost(weight=1.0))  # no batched form: each image on its own
    assert not _batchable(assigner)
    assigner.match_costs[-1] = FocalLossCost(binary_input=True)
    assert not _batchable(assigner)
