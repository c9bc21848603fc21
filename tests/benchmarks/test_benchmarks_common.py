"""deform_plugin.benchmarks.common: the machine line, timing statistics, memory, the error metric and the writers."""
import csv
import importlib.util
import math
import re

import pytest
import torch

from deform_plugin.benchmarks import common

INFO = {"device": "NVIDIA H100 80GB HBM3 (132 SMs)", "cuda": "12.8", "torch": "2.13.0", "triton": "3.6.0",
        "mmcv": "2.1.0", "mmcv_compiled_ops": False, "mmdet": "3.3.0", "mmengine": "0.10.7", "python": "3.11.7",
        "commit": "abc1234+dirty", "date_utc": "2026-11-26 09:00"}


def test_machine_line_names_every_part():
    line = common.machine_line(INFO)
    assert line == ("machine: NVIDIA H100 80GB HBM3 (132 SMs), CUDA 12.8, torch 2.13.0, triton 3.6.0, mmcv 2.1.0 "
                    "(compiled ops: no), mmdet 3.3.0, python 3.11.7, commit abc1234+dirty, 2026-11-26 09:00 UTC")
    assert "(compiled ops: unknown)" in common.machine_line(dict(INFO, mmcv_compiled_ops=None))


def test_machine_info_of_this_cpu(monkeypatch):
    monkeypatch.setenv("DEFORM_PLUGIN_COMMIT", "0123abc")
    info = common.machine_info(torch.device("cpu"))
    assert re.fullmatch(r".* \(\d+ cores\)", info["device"])
    assert info["torch"] == torch.__version__ and info["commit"] == "0123abc"
    assert info["mmcv_compiled_ops"] in (True, False)
    assert common.machine_line(info).startswith("machine: ")


def test_repo_commit_from_git_or_unknown(monkeypatch):
    monkeypatch.delenv("DEFORM_PLUGIN_COMMIT", raising=False)
    assert re.fullmatch(r"[0-9a-f]{4,40}(\+dirty)?|unknown", common.repo_commit())


def test_relative_error_is_norm_based():
    expected = torch.tensor([3.0, 4.0])                                       # norm 5
    assert common.relative_error(torch.tensor([3.0, 4.5]), expected) == pytest.approx(0.1)  # max-based: 0.125
    assert common.relative_error(expected.half(), expected.double()) == 0.0
    assert common.relative_error(torch.zeros(3), torch.zeros(3)) == 0.0
    assert common.relative_error(torch.tensor([3.0, float("nan")]), expected) == math.inf
    assert common.relative_error(torch.tensor([3.0, float("inf")]), expected) == math.inf


def test_summarize_ms_quantiles():
    stats = common.summarize_ms([0.005, 0.001, 0.004, 0.002, 0.003])
    assert stats["median_ms"] == pytest.approx(3.0)
    assert stats["p20_ms"] == pytest.approx(1.8) and stats["p80_ms"] == pytest.approx(4.2)
    assert (stats["min_ms"], stats["max_ms"], stats["n"]) == (pytest.approx(1.0), pytest.approx(5.0), 5)


def test_do_bench_on_cpu_calls_the_function_and_orders_quantiles():
    calls = []
    median, p20, p80 = common.do_bench(lambda: calls.append(1), device="cpu", cpu_calls=5)
    assert len(calls) == 5 and 0 <= p20 <= median <= p80


def test_memory_helpers_off_cuda():
    cpu = torch.device("cpu")
    common.reset_peak_memory(cpu)
    assert common.peak_memory_mb(cpu) is None
    assert math.isnan(common.peak_extra_memory_mb(lambda: torch.zeros(10), cpu))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="peak CUDA memory needs a CUDA device")
def test_peak_extra_memory_counts_what_the_call_allocates():
    device = torch.device("cuda")
    extra = common.peak_extra_memory_mb(lambda: torch.empty(16 * 2 ** 20, dtype=torch.uint8, device=device), device)
    assert 16 <= extra < 24


def test_write_csv_appends_and_widens_the_header(tmp_path):
    path = tmp_path / "rows.csv"
    common.write_csv(path, [{"a": 1, "b": 2}])
    common.write_csv(path, [{"a": 3, "b": 4}], append=True)
    common.write_csv(path, [{"a": 5, "c": 6}], append=True)
    with open(path) as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames == ["a", "b", "c"]
    assert rows == [{"a": "1", "b": "2", "c": ""}, {"a": "3", "b": "4", "c": ""}, {"a": "5", "b": "", "c": "6"}]
    common.write_csv(path, [{"b": 7}], fields=["b"])  # without append: a new file
    assert path.read_text().splitlines() == ["b", "7"]


def test_markdown_table_plain_and_padded():
    assert common.markdown_table(["row", "ms"], [["a", 1.5], ["bb", "-"]]) == \
        "| row | ms |\n|---|---|\n| a | 1.5 |\n| bb | - |"
    assert common.markdown_table(["row", "ms"], [["a", 1.5], ["bbbb", "-"]], pad=True) == \
        "| row  | ms  |\n|------|-----|\n| a    | 1.5 |\n| bbbb | -   |"


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="plots need matplotlib (extra 'bench')")
def test_plot_lines_writes_a_png_and_skips_nan(tmp_path):
    path = common.plot_lines(tmp_path / "plot.png", [
        dict(series={"triton": [(1, 2.0), (2, 1.0)], "pytorch": [(1, float("nan"))]}, xlabel="x", ylabel="ms"),
        dict(series={"triton": [(1, float("nan"))]}, xlabel="x", ylabel="MB", xlog=False, vline=1)], title="t")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
