"""deform_plugin.benchmarks.detector.step_profiler: the profile holds exactly the chosen iterations."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch



def test_the_step_profiler_profiles_only_its_iterations(tmp_path):
    import gzip

    from deform_plugin.benchmarks.detector.step_profiler import StepProfilerHook
    with pytest.raises(ValueError, match="first=0"):
        StepProfilerHook(first=0)
    hook = StepProfilerHook(first=3, steps=2, out_dir=str(tmp_path / "p"))
    runner = SimpleNamespace(iter=0, work_dir=str(tmp_path))
    x = torch.randn(32, 32)
    for index in range(6):
        runner.iter = index
        hook.before_train_iter(runner, index)
        # Each iteration its own op: the tables must hold exactly those of iterations 3 and 4.
        (torch.mm, torch.add, torch.sub, torch.mul, torch.div, torch.maximum)[index](x, x)
        hook.after_train_iter(runner, index)
    text = (tmp_path / "p" / "profile_rank0.txt").read_text()
    assert text.startswith("rank 0: iterations 3-4,")
    assert "aten::sub" in text and "aten::mul" in text
    assert not any(op in text for op in ("aten::mm", "aten::add", "aten::div", "aten::maximum"))
    trace = json.loads(gzip.open(tmp_path / "p" / "trace_rank0.json.gz").read())
    assert any(event.get("name") == "aten::sub" for event in trace["traceEvents"])
