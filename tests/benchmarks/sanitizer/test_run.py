"""The sanitizer runner without a GPU: finding compute-sanitizer, its command lines and environment, and whole runs
through a stand-in compute-sanitizer that prints a canned report."""
import json
import os
import stat
import sys
import textwrap

import pytest
import torch

from deform_plugin.benchmarks.sanitizer import run

# Prints a report for the tool it is given, writes the target's checks file, exits as compute-sanitizer would.
FAKE_SANITIZER = textwrap.dedent('''\
    #!{python}
    import json, os, sys, time
    args = sys.argv[1:]
    tool = args[args.index("--tool") + 1]
    target = args[args.index("-m") - 1:]
    case = target[2 + 1]
    print("========= COMPUTE-SANITIZER")
    print("caching off:", os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING"), "args:", " ".join(args[:8]))
    if os.environ.get("FAKE_SANITIZER_HANG"):
        time.sleep(60)
    checks = [dict(name="forward", error=1e-7, limit=1e-4, passed=True)]
    with open(target[target.index("--json") + 1], "w") as handle:
        json.dump(dict(cases={{case: dict(checks=checks)}}), handle)
    if tool == "memcheck" and case.startswith("msda"):
        print("========= Invalid __global__ read of size 4 bytes")
        print("=========     at msda_forward_kernel+0x1b0 in triton_kernels.py:128")
        print("=========     Address 0x7f00 is out of bounds")
        print("=========")
        print("========= ERROR SUMMARY: 1 error")
        sys.exit(86)
    print("========= ERROR SUMMARY: 0 errors")
''')


@pytest.fixture
def fake_sanitizer(tmp_path):
    path = tmp_path / "bin" / "compute-sanitizer"
    path.parent.mkdir()
    path.write_text(FAKE_SANITIZER.format(python=sys.executable))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.fixture
def pretend_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def _runs(out):
    return {(r["tool"], r["case"]): r for r in json.loads((out / "sanitize.json").read_text())["runs"]}


def test_the_runner_reads_each_tools_report_and_writes_the_table(tmp_path, fake_sanitizer, pretend_cuda, capsys):
    out = tmp_path / "out"
    code = run.main(["--out", str(out), "--sanitizer", fake_sanitizer, "--skip-native", "--device", "cpu",
                     "--cases", "msda:fp32", "graph-infer:fp32", "--tools", "memcheck", "racecheck", "--jobs", "2"])
    assert code == 1  # one finding
    runs = _runs(out)
    assert len(runs) == 4
    found = runs[("memcheck", "msda:fp32")]
    assert found["status"] == "1 reported" and found["error_summary"] == 1
    assert found["findings"] == [dict(category="memory", kernel="msda_forward_kernel",
                                      message="Invalid __global__ read of size 4 bytes", count=1)]
    assert (found["checks_passed"], found["checks_total"]) == (1, 1)
    for key in [("memcheck", "graph-infer:fp32"), ("racecheck", "msda:fp32"), ("racecheck", "graph-infer:fp32")]:
        assert runs[key]["status"] == "clean" and runs[key]["error_summary"] == 0, key
    # The kernel cases' memory checks run without the caching allocator; the graph cases and racecheck keep it.
    assert not found["caching_allocator"] and runs[("memcheck", "graph-infer:fp32")]["caching_allocator"]
    assert runs[("racecheck", "msda:fp32")]["caching_allocator"]
    log = (out / found["log"]).read_text()
    assert "caching off: 1" in log and "--padding 512" in log and "--error-exitcode 86" in log
    assert "caching off: None" in (out / runs[("racecheck", "msda:fp32")]["log"]).read_text()
    table = (out / "sanitize.md").read_text()
    assert table.startswith("machine: ") and "compute-sanitizer: " + fake_sanitizer in table
    assert "| memcheck | msda:fp32 | 1 reported | 1 | memory in msda_forward_kernel: Invalid __global__ read" in table
    assert "memcheck msda:fp32: 1 reported" in capsys.readouterr().out


def test_a_hanging_run_is_killed_at_its_timeout(tmp_path, fake_sanitizer, pretend_cuda, monkeypatch):
    monkeypatch.setenv("FAKE_SANITIZER_HANG", "1")
    out = tmp_path / "out"
    assert run.main(["--out", str(out), "--sanitizer", fake_sanitizer, "--skip-native", "--device", "cpu",
                     "--cases", "sdpa:bf16", "--tools", "initcheck", "--timeout", "1"]) == 1
    (timed_out,) = _runs(out).values()
    assert timed_out["status"] == "timeout (1 s)" and timed_out["seconds"] < 30


def test_nothing_starts_after_the_deadline(tmp_path, fake_sanitizer, pretend_cuda):
    out = tmp_path / "out"
    assert run.main(["--out", str(out), "--sanitizer", fake_sanitizer, "--skip-native", "--device", "cpu",
                     "--cases", "msda:bf16", "--tools", "racecheck", "--deadline", "0"]) == 1
    assert [r["status"] for r in _runs(out).values()] == ["not run (deadline)"]


def test_a_missing_sanitizer_or_gpu_is_said_and_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run.main(["--out", str(tmp_path), "--cases", "msda:fp32"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert run.main(["--out", str(tmp_path), "--cases", "msda:fp32", "--sanitizer", str(tmp_path / "nowhere")]) == 2
    assert f"compute-sanitizer not found (looked in: {tmp_path / 'nowhere'})" in capsys.readouterr().err


def test_the_sanitizer_is_found_on_path_then_in_cuda_home(tmp_path, fake_sanitizer, monkeypatch):
    monkeypatch.setattr(run.shutil, "which", lambda name: None)
    monkeypatch.setenv("CUDA_HOME", os.path.dirname(os.path.dirname(fake_sanitizer)))
    assert run.sanitizer_candidates()[0] == fake_sanitizer
    assert run.find_sanitizer() == fake_sanitizer
    monkeypatch.setattr(run.shutil, "which", lambda name: "/somewhere/else/compute-sanitizer")
    assert run.sanitizer_candidates()[:2] == ["/somewhere/else/compute-sanitizer", fake_sanitizer]
    assert run.find_sanitizer(str(tmp_path / "missing")) is None


def test_command_lines_and_environment():
    target = run.target_command("sdpa:fp16", "cuda", "x.json", poison=False, tiny=False)
    assert target[1:4] == ["-m", run.TARGET_MODULE, "sdpa:fp16"] and "--poison" not in target
    assert "--poison" in run.target_command("sdpa:fp16", "cuda", "x.json", poison=True, tiny=True)
    command = run.sanitizer_command("/cs", "racecheck", target, ["--racecheck-report", "all"])
    assert command[:3] == ["/cs", "--tool", "racecheck"] and "--padding" not in command
    assert command[-len(target) - 2:-len(target)] == ["--racecheck-report", "all"]
    assert run.run_environment("msda-fused:bf16", "initcheck")[run.NO_CACHING_ENV] == "1"
    assert run.NO_CACHING_ENV not in run.run_environment("graph-train:bf16", "memcheck")
    assert run.NO_CACHING_ENV not in run.run_environment("msda:fp32", None)


def test_bad_cases_are_refused_before_anything_runs(tmp_path, capsys):
    with pytest.raises(SystemExit):
        run.main(["--out", str(tmp_path), "--cases", "sdpa:fp64"])
    assert "sdpa runs in fp32, fp16, bf16, got 'fp64'" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available() or run.find_sanitizer() is None,
                    reason="needs a CUDA device and compute-sanitizer")
def test_memcheck_finds_nothing_in_the_plain_msda_kernels(tmp_path):
    out = tmp_path / "out"
    code = run.main(["--out", str(out), "--tools", "memcheck", "--cases", "msda:fp32", "--jobs", "1",
                     "--timeout", "300"])
    runs = _runs(out)
    assert code == 0, (out / "sanitize.md").read_text()
    assert runs[("memcheck", "msda:fp32")]["error_summary"] == 0
    assert not runs[("memcheck", "msda:fp32")]["caching_allocator"]


def test_terminating_the_runner_ends_its_running_processes(tmp_path):
    """The targets run in sessions of their own (so that a timeout kills a target's whole tree): SIGTERM to the
    runner, as ``timeout`` sends, must end them too."""
    import threading
    import time
    log = tmp_path / "hang.log"
    result = {}
    command = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"]
    thread = threading.Thread(target=lambda: result.update(out=run._run_process(command, dict(os.environ), log, 120)))
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while "up" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.05)
        run.stop_running_processes()
        thread.join(20)
        assert not thread.is_alive()
        code, output = result["out"]
        assert code is not None and code < 0 and "up" in output  # killed by a signal, not timed out
    finally:
        run._stopping.clear()


def test_grouped_dtypes_run_one_process_per_kind_and_tool(tmp_path, fake_sanitizer, pretend_cuda):
    out = tmp_path / "out"
    assert run.group_by_kind(["msda:fp32", "sdpa:bf16", "msda:bf16"]) == ["msda:fp32,msda:bf16", "sdpa:bf16"]
    code = run.main(["--out", str(out), "--sanitizer", fake_sanitizer, "--skip-native", "--device", "cpu",
                     "--cases", "msda:fp32", "msda:bf16", "sdpa:fp16", "--tools", "racecheck", "--group-dtypes"])
    assert code == 0
    runs = _runs(out)
    assert set(runs) == {("racecheck", "msda:fp32,msda:bf16"), ("racecheck", "sdpa:fp16")}
    grouped = runs[("racecheck", "msda:fp32,msda:bf16")]
    assert grouped["log"] == "logs/racecheck_msda_fp32-bf16.log" and grouped["status"] == "clean"
    assert "msda:fp32 msda:bf16 --device cpu" in (out / grouped["log"]).read_text()
