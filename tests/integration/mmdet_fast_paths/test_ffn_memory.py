"""The FFN memory fast paths give stock's outputs, random draws and gradients bitwise: relu_dropout_fusion keeps one
activation for backward instead of three, ffn_recompute keeps only the FFN's input."""
import copy

import pytest
import torch
import torch.nn.functional as F
from small_detectors import small_detector
from torch import nn

import deform_plugin  # noqa: F401  (mmcv stand-in where mmcv-lite is installed)
from deform_plugin.integration.mmdet_fast_paths import apply_fast_paths
from deform_plugin.integration.mmdet_fast_paths.ffn_memory import (ReLUDropout, enable_ffn_recompute,
                                                                   enable_relu_dropout_fusion, recomputed_ffn_class)


def _ffn(ffn_drop=0.3, dtype=torch.float32, act="ReLU", num_fcs=2):
    from mmcv.cnn.bricks.transformer import FFN
    torch.manual_seed(0)
    return FFN(embed_dims=16, feedforward_channels=64, num_fcs=num_fcs, ffn_drop=ffn_drop,
               act_cfg=dict(type=act, inplace=True) if act == "ReLU" else dict(type=act)).to(dtype)


def _inputs(dtype, device="cpu"):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(3, 50, 16, generator=generator).to(dtype)
    x[0, :5] = 0.0  # exact zeros reach the ReLU too
    return x.to(device), torch.randn(3, 50, 16, generator=generator).to(dtype).to(device)


def _step(ffn, x, grad, seed=7):
    x = x.clone().requires_grad_()
    torch.manual_seed(seed)
    out = ffn(x)
    out.backward(grad)
    return out.detach(), x.grad, {name: p.grad for name, p in ffn.named_parameters()}


def _assert_same_step(stock, fast, x, grad):
    stock_out, stock_x_grad, stock_grads = _step(stock, x, grad)
    fast_out, fast_x_grad, fast_grads = _step(fast, x, grad)
    assert torch.equal(fast_out, stock_out)
    assert torch.equal(fast_x_grad, stock_x_grad)
    assert list(fast_grads) == list(stock_grads)
    for name in stock_grads:
        assert torch.equal(fast_grads[name], stock_grads[name]), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("num_fcs", [2, 3])
def test_fused_ffn_gives_the_stock_outputs_random_draws_and_gradients_bitwise(dtype, num_fcs):
    stock = _ffn(dtype=dtype, num_fcs=num_fcs)
    fast = copy.deepcopy(stock)
    assert enable_relu_dropout_fusion(fast) == num_fcs - 1
    assert list(fast.state_dict()) == list(stock.state_dict())
    x, grad = _inputs(dtype)
    _assert_same_step(stock, fast, x, grad)
    stock.eval()
    fast.eval()
    _assert_same_step(stock, fast, x, grad)  # eval: no dropout


def test_the_fused_ffn_keeps_one_hidden_activation_for_backward_instead_of_three():
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    def saved_bytes(ffn, x):
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            ffn(x.clone().requires_grad_())
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
        return sum(storages.values())

    stock = _ffn(dtype=torch.bfloat16)
    fast = copy.deepcopy(stock)
    enable_relu_dropout_fusion(fast)
    x, _ = _inputs(torch.bfloat16)
    hidden_elements = x.shape[0] * x.shape[1] * 64
    # Stock keeps the ReLU's output (2 bytes), the dropout's output (2, the next Linear's input) and what the
    # dropout's backward needs: a bool mask (1 byte) from CUDA's fused kernel, elsewhere its bf16 noise (2 bytes).
    assert saved_bytes(stock, x) - saved_bytes(fast, x) == hidden_elements * (2 + 2)


def test_the_fused_kernel_branch_is_native_dropouts_backward_with_the_mask_read_off_the_output():
    # On CUDA, F.dropout runs ATen's fused kernel (native_dropout); the fused branch differentiates it with
    # native_dropout_backward and the mask ``output > 0``: equal to native_dropout's own backward after ReLU's.
    for dtype in (torch.float32, torch.bfloat16):
        x, grad = _inputs(dtype)
        x = x.requires_grad_()
        torch.manual_seed(3)
        out, _ = torch.native_dropout(F.relu(x), 0.3, True)
        out.backward(grad)
        fused = torch.ops.aten.native_dropout_backward(grad, out.detach() > 0, 1.0 / (1.0 - 0.3))
        assert torch.equal(fused, x.grad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused dropout kernel runs on CUDA only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_ffn_gives_the_stock_outputs_and_gradients_bitwise_on_cuda(dtype):
    stock = _ffn(dtype=dtype).cuda()
    fast = copy.deepcopy(stock)
    enable_relu_dropout_fusion(fast)
    x, grad = _inputs(dtype, "cuda")
    _assert_same_step(stock, fast, x, grad)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        stock(x.clone().requires_grad_())
    assert any(t.dtype == torch.bool for t in saved)  # the fused kernel's mask: what the fast path saves no more
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _assert_same_step(stock.float(), fast.float(), x.float(), grad.float())


@pytest.mark.parametrize("ffn_drop, act", [(0.0, "ReLU"), (0.3, "GELU")])
def test_ffns_without_a_drawing_dropout_or_without_relu_are_left_alone(ffn_drop, act):
    ffn = _ffn(ffn_drop=ffn_drop, act=act)
    assert enable_relu_dropout_fusion(ffn) == 0
    assert not any(isinstance(module, ReLUDropout) for module in ffn.modules())


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.1])
def test_relu_dropout_refuses_a_probability_outside_zero_to_one(bad):
    with pytest.raises(ValueError, match=f"got {bad!r}"):
        ReLUDropout(bad)


@pytest.mark.parametrize("name, fused, recomputed", [("deformable-detr-two-stage", 12, 0), ("dino", 0, 12)])
def test_the_switches_reach_every_ffn_of_a_detector_that_they_apply_to(name, fused, recomputed):
    # Deformable-DETR: six encoder and six decoder FFNs with dropout 0.1 (fused); DINO's have dropout 0 (recomputed).
    detector = small_detector(name, dtype=torch.float32)
    holder = nn.Module()
    holder.detector = detector
    assert apply_fast_paths(holder, relu_dropout_fusion=True, ffn_recompute=True) == {
        "relu_dropout_fusion": fused, "ffn_recompute": recomputed}


# ---- ffn_recompute ------------------------------------------------------------------------------------------------

def _saved_bytes(ffn, x):
    """Bytes of the activations ``ffn``'s forward keeps for the backward (parameters, which exist anyway, aside)."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        ffn(x.clone().requires_grad_())
    parameters = {p.untyped_storage().data_ptr() for p in ffn.parameters()}
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved
                if t.untyped_storage().data_ptr() not in parameters}.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("num_fcs", [2, 3])
def test_recomputed_ffn_gives_the_stock_outputs_and_gradients_bitwise(dtype, num_fcs):
    stock = _ffn(ffn_drop=0.0, dtype=dtype, num_fcs=num_fcs)
    fast = copy.deepcopy(stock)
    assert enable_ffn_recompute(fast) == 1 and type(fast) is recomputed_ffn_class()
    assert list(fast.state_dict()) == list(stock.state_dict())
    x, grad = _inputs(dtype)
    _assert_same_step(stock, fast, x, grad)
    stock.eval()
    fast.eval()
    _assert_same_step(stock, fast, x, grad)


def test_the_recomputed_ffn_keeps_only_its_input_for_backward():
    stock = _ffn(ffn_drop=0.0, dtype=torch.bfloat16)
    fast = copy.deepcopy(stock)
    enable_ffn_recompute(fast)
    x, _ = _inputs(torch.bfloat16)
    assert _saved_bytes(fast, x) == x.untyped_storage().nbytes()
    # Stock keeps the input and the hidden activation (the ReLU's output, the second Linear's input: 2 bytes).
    assert _saved_bytes(stock, x) - _saved_bytes(fast, x) == x.shape[0] * x.shape[1] * 64 * 2


@pytest.mark.parametrize("fuse_first", [False, True])
def test_ffns_whose_dropout_draws_are_not_recomputed(fuse_first):
    ffn = _ffn(ffn_drop=0.3)
    if fuse_first:
        assert enable_relu_dropout_fusion(ffn) == 1
    assert enable_ffn_recompute(ffn) == 0  # recomputing a dropout would need the generator's state restored


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recomputed_ffn_gives_the_stock_outputs_and_gradients_bitwise_on_cuda(dtype):
    stock = _ffn(ffn_drop=0.0, dtype=dtype).cuda()
    fast = copy.deepcopy(stock)
    enable_ffn_recompute(fast)
    x, grad = _inputs(dtype, "cuda")
    _assert_same_step(stock, fast, x, grad)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _assert_same_step(stock.float(), fast.float(), x.float(), grad.float())
