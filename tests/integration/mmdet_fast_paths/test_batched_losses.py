"""batched_losses: every decoder layer's DETR losses in one pass give the stock losses and gradients, and wait for
the GPU once."""
import copy

import pytest
import torch
from detr_heads import DEFORMABLE_DETR_KINDS, TWO_STAGE_KINDS, detr_head, detr_loss_inputs, losses_and_gradients
from host_transfers import cuda_syncs_of
from torch import nn

import deform_plugin  # noqa: F401  (mmcv stand-in where mmcv-lite is installed)
from deform_plugin.integration.mmdet_fast_paths import apply_fast_paths


@pytest.mark.parametrize("kind", [*DEFORMABLE_DETR_KINDS, "dino"])
@pytest.mark.parametrize("num_gts", [(3, 5), (0, 4), (0, 0)], ids=["gts3-5", "gts0-4", "gts0-0"])
def test_batched_losses_give_the_stock_losses_and_gradients(kind, num_gts, monkeypatch):
    from deform_plugin.integration.mmdet_fast_paths import batched_losses, batched_matching
    stock_head = detr_head(kind)
    fast_head = copy.deepcopy(stock_head)
    holder = nn.Module()
    holder.bbox_head = fast_head
    changed = apply_fast_paths(holder, sync_free_losses=True, batched_losses=True)
    assert changed["batched_losses"] == 1 and changed["batched_matching"] == 1
    passes = []
    original = batched_losses.layer_losses
    monkeypatch.setattr(batched_losses, "layer_losses", lambda *a, **k: passes.append(a[1].shape[0]) or original(
        *a, **k))
    copies = []
    costs_to_host = batched_matching.costs_to_host
    monkeypatch.setattr(batched_matching, "costs_to_host",
                        lambda costs: copies.append(len(costs)) or costs_to_host(costs))
    per_layer_targets = []
    targets_single = fast_head._get_targets_single
    fast_head._get_targets_single = lambda *a, **k: per_layer_targets.append(1) or targets_single(*a, **k)
    per_layer_denoising = []
    if kind == "dino":
        dn_single = fast_head._loss_dn_single
        fast_head._loss_dn_single = lambda *a, **k: per_layer_denoising.append(1) or dn_single(*a, **k)
    inputs = detr_loss_inputs(kind, num_gts)
    stock, stock_grads = losses_and_gradients(stock_head, inputs)
    fast, fast_grads = losses_and_gradients(fast_head, inputs)
    assert list(fast) == list(stock)
    for name in stock:
        assert fast[name].shape == stock[name].shape, name
        # float32: the same elements, summed per layer over a (layers, ...) view instead of one layer at a time.
        torch.testing.assert_close(fast[name], stock[name], rtol=1e-6, atol=1e-7, msg=name)
    for name in stock_grads:
        torch.testing.assert_close(fast_grads[name], stock_grads[name], rtol=1e-6, atol=1e-8, msg=name)
    # The decoder layers in one pass, the two-stage encoder's proposals in another (Deformable-DETR's against class-0
    # gts); plain and refine Deformable-DETR have no proposals.
    assert passes == ([3, 1] if kind in TWO_STAGE_KINDS else [3])
    # Their cost matrices (the decoder layers' of every image with gts and, for two-stage Deformable-DETR, the
    # proposals': one block each) reach the host in one copy.
    images_with_gts = sum(n > 0 for n in num_gts)
    assert copies == ([2 if kind == "deformable-detr-two-stage" else 1] if images_with_gts else [])
    assert per_layer_targets == []  # no layer fell back to the per-layer path
    # DINO's denoising losses in one pass too; without any gt there are no denoising queries, and stock runs.
    assert len(per_layer_denoising) == (3 if kind == "dino" and max(num_gts) == 0 else 0)
    assert fast_head.losses_ahead == {}  # nothing outlives the step


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_batched_focal_loss_elements_are_mmdets_focal_loss(dtype):
    # On the CPU mmdet's FocalLoss runs its own formula (binary cross-entropy with logits times the focal weight);
    # ours is mmcv's CUDA kernel's (log of the clamped sigmoid): the same function, equal to rounding. In float32
    # the kernel's log(1 - sigmoid(x)) loses digits for large logits (stock's CUDA values do too): float64 checks
    # the formula over a wide range, float32 at the logits of a training step.
    from mmdet.models.losses import FocalLoss

    from deform_plugin.integration.mmdet_fast_paths.batched_losses import focal_loss_elements
    loss_cls = FocalLoss(use_sigmoid=True, gamma=2.0, alpha=0.25, loss_weight=2.0)
    generator = torch.Generator().manual_seed(0)
    scale = 4.0 if dtype == torch.float64 else 1.0
    scores = (torch.randn(40, 7, generator=generator, dtype=dtype) * scale).requires_grad_()
    labels = torch.randint(0, 8, (40,), generator=generator)  # 7: background
    weights = torch.rand(40, generator=generator, dtype=dtype)
    upstream = torch.randn(40, 7, generator=generator, dtype=dtype)
    ours = focal_loss_elements(loss_cls, scores, labels, weights)
    theirs = loss_cls(scores, labels, weights, reduction_override="none")
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(ours, theirs, **tolerance)
    ours_grad, = torch.autograd.grad((ours * upstream).sum(), scores)
    theirs_grad, = torch.autograd.grad((theirs * upstream).sum(), scores)
    torch.testing.assert_close(ours_grad, theirs_grad, **tolerance)


def test_batched_focal_loss_elements_read_nothing_on_the_host():
    # Meta tensors hold no values: any host read of the labels or scores (mmcv's CUDA launcher reads target.max())
    # raises here; the CUDA test below counts real syncs.
    from mmdet.models.losses import FocalLoss

    from deform_plugin.integration.mmdet_fast_paths.batched_losses import focal_loss_elements
    loss_cls = FocalLoss(use_sigmoid=True, gamma=2.0, alpha=0.25, loss_weight=2.0)
    scores = torch.empty(40, 7, device="meta", dtype=torch.bfloat16, requires_grad=True)
    out = focal_loss_elements(loss_cls, scores, torch.empty(40, dtype=torch.long, device="meta"),
                              torch.empty(40, device="meta"))
    assert out.shape == (40, 7) and out.dtype == torch.float32  # bf16 scores in float32, as mmcv takes them
    grad, = torch.autograd.grad(out.sum(), scores)
    assert grad.shape == (40, 7) and grad.dtype == torch.bfloat16


def _stock_and_fast_losses_under(spy_class, kind):
    """``spy.calls`` of stock's and of the batched head's losses and backward, each run under a fresh ``spy_class()``
    mode, on the same inputs."""
    heads = _stock_and_batched_heads(kind)
    inputs = detr_loss_inputs(kind, (3, 5))
    calls = []
    for head in heads:
        with spy_class() as spy:
            losses_and_gradients(head, inputs)
        calls.append(spy.calls)
    return calls


def _stock_and_batched_heads(kind, device="cpu"):
    """A DETR head and its copy with the sync-free, batched losses (and the matching they build on)."""
    stock_head = detr_head(kind).to(device)
    fast_head = copy.deepcopy(stock_head)
    holder = nn.Module()
    holder.bbox_head = fast_head
    apply_fast_paths(holder, sync_free_losses=True, batched_losses=True)
    return stock_head, fast_head


@pytest.mark.parametrize("kind", [*DEFORMABLE_DETR_KINDS, "dino"])
def test_fast_detr_losses_assign_no_python_scalar_by_index(kind):
    # `x[index] = 1.0` on a CUDA tensor copies the scalar to the device with a blocking copy in torch <= 2.11 (the
    # GPU hosts' torch): one host sync per call, which the CUDA count below found per image in DINO's denoising
    # targets. On the CPU the pattern is visible as an index_put_ whose value is a 0-dim tensor.
    from torch.utils._python_dispatch import TorchDispatchMode

    class ScalarIndexPuts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._schema.name in ("aten::index_put_", "aten::index_put", "aten::_index_put_impl_"):
                self.calls += isinstance(args[2], torch.Tensor) and args[2].dim() == 0
            return func(*args, **(kwargs or {}))

    counts = _stock_and_fast_losses_under(ScalarIndexPuts, kind)
    assert counts[0] > 0 and counts[1] == 0, counts  # stock's targets set their box weights so, per image


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs are a CUDA matter")
@pytest.mark.parametrize("kind", [*DEFORMABLE_DETR_KINDS, "dino"])
def test_fast_detr_losses_wait_for_the_gpu_once_on_cuda(kind):
    stock_head, fast_head = _stock_and_batched_heads(kind, device="cuda")
    inputs = detr_loss_inputs(kind, (3, 5))
    inputs = {name: value.cuda() if isinstance(value, torch.Tensor) else value for name, value in inputs.items()}
    for gt in inputs["batch_gt_instances"]:
        gt.bboxes, gt.labels = gt.bboxes.cuda(), gt.labels.cuda()
    syncs = [cuda_syncs_of(lambda: losses_and_gradients(head, inputs)) for head in (stock_head, fast_head)]
    # Stock: per layer and image the cost copy, the nonzero() calls, mmcv's focal loss reading target.max(); ours:
    # the one copy of every cost matrix (the focal loss without mmcv's read).
    assert syncs[0] >= 3 * 2 * 3 and syncs[1] == 1, syncs


@pytest.mark.parametrize("kind", [*DEFORMABLE_DETR_KINDS, "dino"])
def test_fast_detr_losses_wait_for_the_gpu_once(kind):
    """The calls of a head's loss and backward that would block the host on a GPU (recorded on the CPU): stock's
    per-layer matching and targets make dozens; the fast paths leave the one copy of every cost matrix."""
    from host_transfers import HostTransferSpy
    stock, fast = _stock_and_fast_losses_under(HostTransferSpy, kind)
    assert len(stock) >= 3 * 2 * 3, stock  # per layer and image at least the cost copy and two nonzero() calls
    assert fast == [("cpu", "costs_to_host")]


def test_batched_losses_leave_heads_with_other_losses_alone():
    from mmdet.registry import MODELS
    head = detr_head("dino")
    head.loss_iou = MODELS.build(dict(type="IoULoss", loss_weight=2.0))
    holder = nn.Module()
    holder.bbox_head = head
    assert apply_fast_paths(holder, batched_losses=True)["batched_losses"] == 0
