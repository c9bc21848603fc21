"""The sanitizer's target program: its cases, its NaN poisoning, and its checks passing natively.

On the CPU one kernel case runs end to end in Triton's interpreter at its tiny shape (the interpreter takes minutes
for the full shapes); on a GPU every case runs natively, with every ``torch.empty`` poisoned with NaN, and each of
its results must be finite and match the float64 reference (the graph cases: the eager runs).
"""
import json

import pytest
import torch

from deform_plugin.benchmarks.sanitizer import targets
from deform_plugin.benchmarks.sanitizer.kernel_cases import Check

ON_GPU = torch.cuda.is_available()


def test_the_cases_cover_every_kernel_in_each_dtype():
    cases = targets.all_cases()
    assert {"msda:fp32", "msda:fp16", "msda:bf16", "msda:fp64", "msda-fused:bf16", "msda-fused:fp64", "sdpa:fp16",
            "graph-train:bf16", "graph-infer:fp32"} <= set(cases)
    assert "sdpa:fp64" not in cases and "nms:fp32" in cases and "control:bf16" in cases and len(cases) == 18
    assert targets.is_graph_case("graph-train:fp32") and not targets.is_graph_case("msda-fused:fp32")
    for spec, message in [("msda", "msda runs in"), ("attention:fp32", "the kind must be one of"),
                          ("graph-infer:fp16", "graph-infer runs in fp32, bf16, got 'fp16'")]:
        with pytest.raises(ValueError, match=message):
            targets.parse_case(spec)


def test_poisoned_allocations_are_nan_and_restored_after():
    originals = torch.empty, torch.empty_like, torch.Tensor.new_empty
    with targets.poisoned_allocations():
        assert torch.empty(3).isnan().all() and torch.ones(2).new_empty(4).isnan().all()
        assert torch.empty_like(torch.ones(2, dtype=torch.float16)).isnan().all()
        assert torch.empty(2, dtype=torch.int64).shape == (2,)  # integers are left as they are
    assert (torch.empty, torch.empty_like, torch.Tensor.new_empty) == originals


def test_a_check_fails_on_nan_and_above_its_limit():
    assert Check("a", 1e-5, 1e-4).passed and not Check("b", 2e-4, 1e-4).passed
    assert not Check("c", float("nan"), 1e-4).passed and not Check("d", float("inf"), 0.0).passed


@pytest.mark.skipif(ON_GPU, reason="the GPU tests below run every case natively")
def test_msda_runs_end_to_end_in_the_interpreter_with_poisoned_allocations(tmp_path, capsys):
    out = tmp_path / "checks.json"
    assert targets.main(["msda:fp32", "--device", "cpu", "--tiny", "--poison", "--json", str(out)]) == 0
    checks = json.loads(out.read_text())["cases"]["msda:fp32"]["checks"]
    names = [check["name"] for check in checks]
    assert all(check["passed"] for check in checks) and len(checks) == 13
    assert any("deterministic backward bitwise repeatable" in name for name in names)
    assert any("non-finite locations" in name for name in names)
    assert "case msda:fp32: 13/13 checks passed" in capsys.readouterr().out


@pytest.mark.skipif(ON_GPU, reason="the GPU tests below run every case natively")
def test_nms_runs_end_to_end_in_the_interpreter_with_poisoned_allocations(tmp_path):
    out = tmp_path / "checks.json"
    assert targets.main(["nms:fp32", "--device", "cpu", "--tiny", "--poison", "--json", str(out)]) == 0
    checks = json.loads(out.read_text())["cases"]["nms:fp32"]["checks"]
    assert all(check["passed"] for check in checks) and len(checks) == 4  # kept and count, with and without a mask


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_control_case_checks_a_gemm_and_fails_on_a_wrong_one(dtype, monkeypatch):
    from deform_plugin.benchmarks.sanitizer import kernel_cases
    (check,) = targets.run_case(f"control:{dtype}", "cpu", tiny=True)
    assert check.passed, check
    assert check.error > 0 or dtype == "fp32", check  # bf16 rounds the product
    real_linear = torch.nn.functional.linear
    monkeypatch.setattr(kernel_cases.torch.nn.functional, "linear",
                        lambda inputs, weight: real_linear(inputs, weight) + (100.0 if inputs.dtype != torch.float64
                                                                               else 0.0))
    (check,) = targets.run_case(f"control:{dtype}", "cpu", tiny=True)
    assert not check.passed, check


@pytest.mark.skipif(ON_GPU, reason="the GPU tests below run every case natively")
def test_graph_inference_case_runs_eagerly_on_the_cpu():
    """Without CUDA graphs the case still checks its reference logic: the fast-inference detector at its bucket
    against the eager-at-buckets one, no graph, no replay."""
    checks = targets.run_case("graph-infer:fp32", "cpu", poison=True)
    assert all(check.passed for check in checks) and len(checks) == 13
    assert checks[-1].name == "graphs 0, replays 0 (expected 0, 0)"


def test_a_failed_check_gives_exit_status_1(monkeypatch, capsys):
    monkeypatch.setattr(targets, "run_case", lambda spec, device, poison, tiny: [Check("forward", float("nan"),
                                                                                      1e-4)])
    assert targets.main(["sdpa:fp32", "--device", "cpu"]) == 1
    assert "check sdpa:fp32 | forward | nan | 0.0001 | FAILED" in capsys.readouterr().out


@pytest.mark.skipif(not ON_GPU, reason="the targets' full shapes and CUDA graphs need a CUDA device")
@pytest.mark.parametrize("case", targets.all_cases())
def test_every_case_passes_natively_on_the_gpu_with_poisoned_allocations(case):
    checks = targets.run_case(case, "cuda", poison=True)
    failed = [(check.name, check.error, check.limit) for check in checks if not check.passed]
    assert checks and not failed, failed


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a CUDA device")
def test_no_poison_is_captured_into_a_cuda_graph():
    """A buffer allocated during a capture and written between replays (a static buffer) must keep what the caller
    wrote: a captured NaN fill would overwrite it at every replay."""
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with targets.poisoned_allocations():
        with torch.cuda.stream(stream):
            graph.capture_begin()
            static = torch.empty(4, device="cuda")
            graph.capture_end()
    static.fill_(1.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static.cpu(), torch.ones(4))


def test_graph_inference_box_check_allows_swaps_within_the_score_tolerance_and_not_moved_boxes():
    from deform_plugin.benchmarks.sanitizer.detector_cases import farthest_top_box

    reference_scores = torch.tensor([0.9, 0.8, 0.501, 0.500, 0.1])
    reference_boxes = torch.tensor([[0.0, 0, 10, 10], [20, 20, 30, 30], [40, 40, 50, 50], [60, 60, 70, 70],
                                    [80, 80, 90, 90]])
    # The third and fourth are tied within the tolerance: either may be the top 3's last.
    swapped = reference_boxes[[0, 1, 3]]
    assert farthest_top_box(swapped, reference_scores, reference_boxes, top=3, score_limit=0.01) == 0.0
    # Beyond the tolerance the swap is an error, reported as the distance to the nearest candidate.
    assert farthest_top_box(swapped, reference_scores, reference_boxes, top=3, score_limit=1e-4) == 20.0
    # A box that moved is measured against its nearest candidate; one that is not a candidate counts as far.
    moved = reference_boxes[:3].clone()
    moved[1] += 1.5
    assert farthest_top_box(moved, reference_scores, reference_boxes, top=3, score_limit=0.01) == 1.5
    assert farthest_top_box(reference_boxes[[0, 1, 4]], reference_scores, reference_boxes, top=3,
                            score_limit=0.01) == 20.0
    assert farthest_top_box(reference_boxes[:0], reference_scores[:0], reference_boxes[:0], 3, 0.01) == 0.0
    assert farthest_top_box(reference_boxes[:1], reference_scores[:0], reference_boxes[:0], 3, 0.01) == float("inf")
