"""The MSDA host launchers: index dtype, block sizes, kept launch plans, and int64 indexing giving the int32
results."""
import pytest
import torch

triton = pytest.importorskip("triton")
from msda_cases import DEVICE, DTYPES, ON_GPU, make_case, make_fused_case  # noqa: E402

pytestmark = pytest.mark.usefixtures("poisoned_allocations")


def test_index_dtype_follows_the_largest_tensor():
    """int32 index arithmetic only where no tensor of the launch can overflow it (element counts of value, the
    per-sample tensors and the output)."""
    from deform_plugin.ops.msda.triton_launch import _INT32_INDEX_MAX_NUMEL, _index_dtype

    small, large = 1000, _INT32_INDEX_MAX_NUMEL + 1
    assert _index_dtype(small, small, small) == triton.language.int32
    assert _index_dtype(large, small, small) == triton.language.int64
    assert _index_dtype(small, small, large) == triton.language.int64
    # The deterministic backward writes two entries per location element.
    assert _index_dtype(small, _INT32_INDEX_MAX_NUMEL // 2 + 1, small) == triton.language.int64
    assert _index_dtype(small, _INT32_INDEX_MAX_NUMEL // 2, small) == triton.language.int32


def test_forward_blocks_give_each_thread_one_16_byte_load_per_row():
    """The forward takes 4 queries of 32 float32 channels (8 in 16-bit); the backward 8 in every dtype; neither
    depends on the query count."""
    from deform_plugin.ops.msda.triton_launch import choose_config

    assert choose_config(32, forward_element_size=4).block_q == 4
    assert choose_config(32, forward_element_size=2).block_q == 8
    assert choose_config(32, forward_element_size=8).block_q == 2
    assert choose_config(32).block_q == 8
    assert choose_config(64, forward_element_size=2).block_q == 4
    assert choose_config(16, forward_element_size=4).block_q == 8
    for config in (choose_config(32, forward_element_size=4), choose_config(32)):
        assert config.num_warps == 1 and config.block_d == 32


@pytest.mark.parametrize("dtype_name, block_q", [("fp32", 4), ("bf16", 8)])
def test_launch_plans_follow_the_chosen_blocks(dtype_name, block_q):
    """A call's kept launch plan (default blocks: config None) holds the forward's and the backward's grid."""
    from deform_plugin.ops.msda import triton_launch

    value, shapes, starts, locations, weights = make_case([(6, 7), (3, 4)], 2, 13, 2, 32, 2, DTYPES[dtype_name],
                                                          seed=8)
    grad_output = torch.randn(2, 13, 64, generator=torch.Generator().manual_seed(9)).to(value)
    triton_launch.msda_forward(value, shapes, starts, locations, weights)
    triton_launch.msda_backward(grad_output, value, shapes, starts, locations, weights)
    grids = {key[0]: plan.grid for key, plan in triton_launch._plans.items()
             if key[1] is None and key[2] == value.shape and key[3] == value.dtype and key[5] == locations.shape}
    assert grids == {"forward": (-(-13 // block_q), 2, 2), "backward": (2, 2, 2)}


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_int64_indexing_gives_the_same_results(fused, monkeypatch):
    """The int64 variant (for tensors past 2^30 elements) computes what the int32 one does: exactly, but for the
    order in which a GPU's atomics add into grad_value."""
    from deform_plugin.ops.msda import triton_launch

    if fused:
        case = make_fused_case([(6, 7), (3, 4)], 2, 5, 2, 8, 2, 4, torch.float32, seed=5)
        value, shapes, starts, extra = case[0], case[1], case[2], case[3:]
        forward, backward = triton_launch.fused_msda_forward, triton_launch.fused_msda_backward
    else:
        value, shapes, starts, *extra = make_case([(6, 7), (3, 4)], 2, 5, 2, 8, 2, torch.float32, seed=5)
        forward, backward = triton_launch.msda_forward, triton_launch.msda_backward
    grad_output = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(6)).to(DEVICE)

    def run(config=None):
        return (forward(value, shapes, starts, *extra, config=config),
                *backward(grad_output, value, shapes, starts, *extra, config=config))
    int32_results = run()
    monkeypatch.setattr(triton_launch, "_INT32_INDEX_MAX_NUMEL", 0)
    monkeypatch.setattr(triton_launch, "_plans", {})  # the plans kept by the int32 run chose int32
    int64_results = run()
    constexprs = [plan.variant[-1] for plan in triton_launch._plans.values()]
    assert constexprs and all(triton.language.int64 in c and triton.language.int32 not in c for c in constexprs)
    grad_value_index = 1
    for index, (a, b) in enumerate(zip(int32_results, int64_results)):
        if index == grad_value_index and ON_GPU:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(a, b)
