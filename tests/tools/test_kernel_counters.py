"""The counters tool's parts that need no GPU: target checks, the ncu command lines, reading ncu's raw CSV."""
from pathlib import Path

import pytest

from deform_plugin.benchmarks.ops import counters

RAW_CSV = '''==PROF== Connected to process 1714
"ID","Kernel Name","Block Size","dram__throughput.avg.pct_of_peak_sustained_elapsed","gpu__time_duration.sum",\
"l1tex__t_sector_hit_rate.pct","l1tex__throughput.avg.pct_of_peak_sustained_elapsed","lts__t_sectors_op_red.sum",\
"lts__t_sectors_op_read.sum","lts__t_sectors_op_write.sum","lts__throughput.avg.pct_of_peak_sustained_elapsed",\
"launch__registers_per_thread"
"","","","%","usecond","%","%","sector","sector","sector","%","register/thread"
"0","msda_forward_kernel","(32, 1, 1)","12.8","171.136","45.6","96.5","0","32,638,347","712,000","79.5","64"
"1","msda_backward_kernel","(32, 1, 1)","5.1","1,181.60","32.4","50.2","132,494,044","34,841,693","17,344,362",\
"94.2","125"
'''


def test_raw_csv_rows_are_scaled_and_named():
    rows = counters.parse_raw_csv(RAW_CSV)
    assert [row["kernel"] for row in rows] == ["msda_forward_kernel", "msda_backward_kernel"]
    backward = rows[1]
    assert backward["ms"] == pytest.approx(1.1816)
    assert backward["L2 reduction Msectors"] == pytest.approx(132.494044)
    assert backward["L2 % of peak"] == pytest.approx(94.2)
    assert backward["registers"] == 125
    assert backward["occupancy %"] is None  # not in this report: shown as '-', never as 0
    table = counters.format_rows([dict(target="msda:encoder_b2:uniform:bf16", **row) for row in rows])
    assert table[1][:4] == ["msda:encoder_b2:uniform:bf16", "msda_backward_kernel", "1.182", "32.4"]
    assert table[1][-1] == "-"


def test_a_duration_in_an_unknown_unit_is_left_out():
    rows = counters.parse_raw_csv(RAW_CSV.replace('"usecond"', '"fortnight"'))
    assert rows[0]["ms"] is None and rows[0]["L1 hit %"] == pytest.approx(45.6)


def test_an_empty_report_gives_no_rows():
    assert counters.parse_raw_csv("==PROF== No kernels were profiled.\n") == []


@pytest.mark.parametrize("spec, message", [
    ("msdaa:encoder_b2:uniform:fp32", "kind must be one of"),
    ("msda:encoder_b2:fp32", "takes 3 ':'-separated fields, got 2"),
    ("sdpa:fp64", "dtype must be one of"),
    ("msda-fused:encoder_b9:bf16", "case must be one of"),
    ("msda:encoder_b2:gaussian:fp32", "dist must be 'uniform' or 'realistic', got 'gaussian'"),
])
def test_bad_targets_are_named(spec, message):
    with pytest.raises(ValueError, match=message):
        counters.parse_target(spec)


def test_command_lines_profile_the_targets_kernels(tmp_path):
    command = counters.profile_command("/opt/ncu", "msda-fused:encoder_b2:bf16", tmp_path / "r.ncu-rep")
    assert command[:3] == ["/opt/ncu", "--clock-control", "none"]
    assert command[command.index("-k") + 1] == "regex:msda_"
    metrics = command[command.index("--metrics") + 1].split(",")
    assert set(metrics) == {metric for metric, _, _ in counters.COUNTERS.values()}
    assert command[-4:] == ["-m", "deform_plugin.benchmarks.ops.counters", "--launch", "msda-fused:encoder_b2:bf16"]
    assert counters.profile_command("ncu", "sdpa:bf16", Path("x"))[6] == "regex:deform_sdpa"
    exported = counters.export_command("/opt/ncu", tmp_path / "r.ncu-rep")
    assert exported[:3] == ["/opt/ncu", "-i", str(tmp_path / "r.ncu-rep")] and "raw" in exported


def test_a_missing_ncu_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere/ncu"):
        counters.find_ncu(str(tmp_path / "nowhere" / "ncu"))


def test_without_a_gpu_the_tool_says_so(tmp_path, capsys, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert counters.main(["--out", str(tmp_path), "--targets", "sdpa:fp32"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_targets_are_checked_before_anything_runs(tmp_path):
    with pytest.raises(ValueError, match="kind must be one of"):
        counters.main(["--out", str(tmp_path), "--targets", "sdpa:fp32", "nope:fp32"])
