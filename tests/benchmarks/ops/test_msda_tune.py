"""deform_plugin.benchmarks.ops.msda's launcher sweep: it times the plain and the fused launchers under each
configuration (run here on a tiny case through Triton's interpreter: the plumbing, never a number to report)."""
import pytest
import torch

pytest.importorskip("triton")
from deform_plugin.benchmarks.ops import msda  # noqa: E402


@pytest.mark.parametrize("queries", [None, 5], ids=["encoder-like", "decoder-boxes"])
def test_tune_times_plain_and_fused_launchers_per_config(queries, monkeypatch, capsys):
    from deform_plugin.benchmarks import common
    case = msda.Case("tiny", ((4, 5), (2, 3)), batch=1, queries=queries, heads=2, head_dim=8, points=2)
    monkeypatch.setattr(msda, "TUNE_CONFIGS", ((16, 2, 1), (8, 1, 1)))
    # One timed call per launch, not do_bench's three on a CPU (tested on their own): the interpreter is slow.
    timed = []

    def do_bench(fn, device=None, rep=100):
        timed.append(rep)
        return common.do_bench(fn, device=device, rep=rep, cpu_calls=1)
    monkeypatch.setattr(msda, "do_bench", do_bench)
    rows = msda.tune(["tiny"], ["fp32"], ["uniform"], rep=1, device="cpu", cases={"tiny": case})
    assert [(row["block_q"], row["warps"]) for row in rows] == [(16, 2), (8, 1)]
    assert timed == [1] * 8  # each configuration's four launches, at the requested repetition
    for row in rows:
        for kernel in ("fwd", "bwd", "fused fwd", "fused bwd"):
            assert row[f"{kernel} ms"] > 0
    assert "tiny fp32 uniform: | bq16w2s1 fwd " in capsys.readouterr().out


def test_fused_inputs_are_points_for_encoders_and_boxes_for_decoders():
    for queries, ref_dim in ((None, 2), (7, 4)):
        case = msda.Case("tiny", ((4, 5), (2, 3)), batch=2, queries=queries, heads=2, head_dim=8, points=2)
        value, shapes, starts, locations, weights = msda.make_inputs(case, torch.float32, "uniform", device="cpu")
        ref, offsets, logits = msda.fused_inputs(case, torch.bfloat16, locations, device="cpu")
        assert ref.shape == (2, case.num_queries, 2, ref_dim) and ref.dtype == torch.bfloat16
        assert offsets.shape == locations.shape and logits.shape == weights.shape
