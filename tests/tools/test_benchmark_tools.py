"""Smoke runs of the benchmark command lines on CPU: tools/benchmark.py and tools/profile_step.py with a micro
Deformable-DETR, tools/bench_deform_sdpa.py under the Triton interpreter, tools/bench_msda.py on CUDA only.

One benchmark run covers: a stock row (child process without deform_plugin), our module with no fast path and
with every fast path, training/inference timing, the profile breakdown, the tables, JSON, CSV and PNG. Dropout is
off in the micro config, so the three rows must also agree on the losses (the fast paths are exact).
"""
import csv
import json
import os
import subprocess
import sys

import pytest
import torch
from checkout import checkout_environment
from tool_main import run_tool_main

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MICRO_DEFORMABLE_DETR = """
_base_ = 'mmdet::deformable_detr/deformable-detr-refine_r50_16xb2-50e_coco.py'
custom_imports = dict(imports=['deform_plugin'], allow_failed_imports=False)
embed_dims = 64
model = dict(
    num_queries=20,
    backbone=dict(depth=18, base_channels=16, init_cfg=None),
    neck=dict(in_channels=[32, 64, 128], out_channels=embed_dims, norm_cfg=dict(type='GN', num_groups=8)),
    encoder=dict(num_layers=1, layer_cfg=dict(
        self_attn_cfg=dict(embed_dims=embed_dims, num_heads=4, dropout=0.0),
        ffn_cfg=dict(embed_dims=embed_dims, feedforward_channels=128, ffn_drop=0.0))),
    decoder=dict(num_layers=2, layer_cfg=dict(
        self_attn_cfg=dict(embed_dims=embed_dims, num_heads=4, dropout=0.0),
        cross_attn_cfg=dict(embed_dims=embed_dims, num_heads=4, dropout=0.0),
        ffn_cfg=dict(embed_dims=embed_dims, feedforward_channels=128, ffn_drop=0.0))),
    positional_encoding=dict(num_feats=embed_dims // 2),
    bbox_head=dict(num_classes=5, embed_dims=embed_dims))
"""

SMALL_RUN = ["--device", "cpu", "--shape", "64", "64", "--batch-size", "2", "--num-gts", "3", "--warmup", "1",
             "--steps", "1", "--inference-warmup", "0", "--inference-steps", "1", "--profile-steps", "1",
             "--no-progress"]


def _run_tool(script, args, expect_rc=0, cwd=REPO_ROOT):
    completed = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", script), *args], cwd=cwd,
                               env=checkout_environment(PYTHONWARNINGS="ignore"), capture_output=True, text=True,
                               timeout=300)
    assert completed.returncode == expect_rc, completed.stdout[-3000:] + completed.stderr[-3000:]
    return completed


@pytest.fixture(scope="module")
def micro_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("configs") / "micro_deformable_detr.py"
    path.write_text(MICRO_DEFORMABLE_DETR)
    return str(path)


def test_benchmark_compares_rows_and_writes_table_json_csv_png(micro_config, tmp_path):
    out_dir = tmp_path / "out"
    stdout = _run_tool("benchmark.py", [micro_config, "--rows", "stock:fp32", "pytorch:fp32:none",
                                        "pytorch:fp32:all", "pytorch:bf16:all", "--profile",
                                        "--out-dir", str(out_dir), *SMALL_RUN]).stdout
    assert stdout.startswith("machine: ")
    assert "[train] fps: " in stdout and " ms/img, cuda memory: " in stdout
    assert "[inference] fps: " in stdout and "[profile] CPU ms/step: " in stdout
    report = json.loads((out_dir / "benchmark.json").read_text())
    assert report["machine"]["torch"] and report["machine"]["commit"]
    rows = {r["row"]: r for r in report["results"]}
    assert list(rows) == ["stock:fp32:none", "pytorch:fp32:none", "pytorch:fp32:all", "pytorch:bf16:all"]
    assert rows["pytorch:bf16:all"]["status"] == "skipped"  # AMP needs CUDA
    for label in ("stock:fp32:none", "pytorch:fp32:none", "pytorch:fp32:all"):
        row = rows[label]
        assert row["status"] == "ok", row
        assert row["train"]["median_ms"] > 0 and row["train"]["img_per_s"] > 0
        assert row["inference"]["fps"] > 0
        assert row["baseline_row"] == "stock:fp32:none"
        profile = row["profile"]
        assert profile["time_kind"] == "CPU" and profile["ops_per_step"] > 0
        assert profile["components_ms_per_step"]["optimizer"] > 0
        assert profile["components_ms_per_step"]["matching"] > 0
        assert profile["host_ms_per_step"]["matching"] > 0
        for name in ("forward", "backward", "optimizer"):
            assert profile["host_ms_per_step"][name] > 0, name
        # A CPU row has no device: its host time is its op time, and .item() reads are its only host waits.
        assert profile["host_components_ms_per_step"] == profile["components_ms_per_step"]
        assert profile["host_syncs_per_step"] is None and profile["host_reads_per_step"] > 0
        assert row["shape"] == [64, 64]
    assert rows["stock:fp32:none"]["train"]["speedup"] == pytest.approx(1.0)
    # Every fast path selected, and it changed something.
    fast = rows["pytorch:fp32:all"]
    assert fast["optimizer"]["constructor"] == "MergedParamGroupsOptimWrapperConstructor"
    assert fast["optimizer"]["param_groups"] < rows["pytorch:fp32:none"]["optimizer"]["param_groups"]
    # The demo detector: two attention bricks, one assigner and head, one detector with a forward to make sync-free;
    # graph inference needs CUDA and is not applied on a CPU; the graph-replayed training region runs eagerly there;
    # three FFNs without dropout (recomputed in the backward), none with (nothing to fuse); no DDQ-DETR NMS.
    assert fast["fast_path_sites"] == {"sdpa_attention": 2, "hungarian_host_syncs": 1, "batched_matching": 1,
                                       "sync_free_losses": 1, "batched_losses": 1, "sync_free_forward": 1,
                                       "relu_dropout_fusion": 0, "ffn_recompute": 3, "float32_nms": 0,
                                       "cuda_graphs": 1}
    # Exact fast paths: the first step's loss (forward) and the next one (after an optimizer step) agree.
    for key in ("first_step_losses", "last_step_losses"):
        reference = rows["pytorch:fp32:none"]["train"][key]["loss"]
        assert fast["train"][key]["loss"] == pytest.approx(reference, rel=1e-5)
        assert rows["stock:fp32:none"]["train"][key]["loss"] == pytest.approx(reference, rel=1e-4)
    # The second step ran on updated weights, so its agreement covers the optimizer too.
    none_train = rows["pytorch:fp32:none"]["train"]
    assert none_train["last_step_losses"]["loss"] != none_train["first_step_losses"]["loss"]
    with open(out_dir / "benchmark.csv") as f:
        csv_rows = list(csv.DictReader(f))
    assert [r["row"] for r in csv_rows] == list(rows)
    assert float(csv_rows[2]["train_speedup"]) > 0
    assert csv_rows[2]["shape"] == "64x64" and float(csv_rows[2]["profile_host_reads_per_step"]) > 0
    assert float(csv_rows[2]["profile_host_optimizer_ms"]) > 0 and float(csv_rows[2]["host_backward_ms"]) > 0
    table = (out_dir / "benchmark.md").read_text()
    assert table.startswith("machine: ") and "| pytorch:fp32:all |" in table
    assert ("| row | time | step wall ms | busy | unprofiled step wall ms | busy (unprofiled wall) "
            "| kernels (ops)/step | host syncs/step | host reads/step |") in table
    assert (out_dir / "benchmark_profile.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# SMALL_RUN less the timing runs' options, which tools/profile_step.py does not offer.
PROFILE_RUN = ["--device", "cpu", "--shape", "64", "64", "--batch-size", "2", "--num-gts", "3", "--profile-steps", "1"]


def test_profile_tool_writes_breakdown_chart_and_trace(micro_config, tmp_path):
    # Without --out-dir: the default folder, named after the config, under the working directory.
    out_dir = tmp_path / "work_dirs" / "profile" / "micro_deformable_detr"
    stdout = _run_tool("profile_step.py", [micro_config, "--rows", "pytorch:fp32:all", "--trace", *PROFILE_RUN],
                       cwd=tmp_path).stdout
    assert stdout.startswith(f"the report goes to {os.path.join('work_dirs', 'profile', 'micro_deformable_detr')} ")
    assert "[profile] CPU ms/step: MSDA" in stdout
    assert "[train]" not in stdout  # profile only
    report = json.loads((out_dir / "profile.json").read_text())
    (row,) = report["results"]
    components = row["profile"]["components_ms_per_step"]
    assert set(components) == {"MSDA", "GEMM", "convolution", "optimizer", "matching", "elementwise", "memcpy",
                               "other"}
    # MSDA time comes from the op's own deform_plugin::msda range.
    assert components["MSDA"] > 0 and components["convolution"] > 0 and components["GEMM"] > 0
    assert row["profile"]["host_ms_per_step"]["msda"] > 0
    assert 0 < row["profile"]["busy_fraction"] <= 1.05
    assert row["profile"]["unprofiled_step_wall_ms"] > 0
    assert row["profile"]["busy_fraction_unprofiled"] is None  # CPU row: no device to keep busy
    assert "host reads/step (aten::_local_scalar_dense)" in stdout
    assert os.path.getsize(tmp_path / row["profile"]["trace"]) > 0  # relative to the working directory
    assert (out_dir / "profile.png").exists()


def test_profile_tool_help_describes_the_profile(monkeypatch, capsys):
    # The command line's own answers (help, a refused option) need no fresh interpreter: run in this process.
    status, stdout, _ = run_tool_main("profile_step.py", ["--help"], monkeypatch, capsys)
    assert status == 0
    assert stdout.startswith("usage: profile_step.py")
    assert "Profile training steps of mmdet configs" in stdout and "--profile-steps" in stdout
    assert "Whole-detector benchmark" not in stdout
    # The timing runs' options do nothing in a profile: not offered.
    for option in ("--steps", "--warmup", "--variable-sizes", "--inference-steps", "--inference-warmup", "--profile ",
                   "--profile-only", "--no-progress"):
        assert option not in stdout, option
    assert "(default: work_dirs/profile/<config stem>)" in stdout
    status, _, stderr = run_tool_main("profile_step.py", ["x.py", "--steps", "3"], monkeypatch, capsys)
    assert status == 2 and "unrecognized arguments: --steps 3" in stderr


def test_benchmark_refuses_a_shape_mask2former_cannot_take(tmp_path):
    """Mask2Former pads batches to its 1024x1024 LSJ crop; 800x1333 is wider than that and less tall."""
    config = os.path.join(REPO_ROOT, "configs", "mask2former", "mask2former_r50_8xb2-lsj-50e_coco_deform-plugin.py")
    completed = _run_tool("benchmark.py", [config, "--shape", "800", "1333", "--rows", "pytorch:fp32", "--device",
                                           "cpu", "--out-dir", str(tmp_path)], expect_rc=1)
    assert "shape 800x1333 (--shape) cannot run" in completed.stderr
    assert "BatchFixedSizePad" in completed.stderr and "800x1344" in completed.stderr
    assert "the config's own size, 1024 1024" in completed.stderr
    (row,) = json.loads((tmp_path / "benchmark.json").read_text())["results"]
    assert row["status"] == "failed" and "cannot run" in row["error"]


def test_bench_deform_sdpa_smoke_on_cpu(tmp_path):
    tiny = ["--smoke-cpu", "--out", str(tmp_path), "--sizes", "4", "--modes", "fwd", "--batch", "1", "--views", "2",
            "--samples", "2", "--heads", "1", "--head-dim", "4"]
    stdout = _run_tool("bench_deform_sdpa.py", tiny).stdout
    assert stdout.startswith("machine: ")
    assert "| size | mode | backend |" in stdout
    with open(tmp_path / "bench_deform_sdpa.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["size"], r["mode"], r["backend"]) for r in rows] == [("4", "fwd", "pytorch"), ("4", "fwd", "triton")]
    assert float(rows[1]["err_fp64"]) < 1e-5
    assert (tmp_path / "latency_fp32.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bench_msda times CUDA kernels")
def test_bench_msda_one_case_on_cuda(tmp_path):
    stdout = _run_tool("bench_msda.py", ["--cases", "decoder_q300", "--dtypes", "fp32", "--dists", "uniform",
                                         "--rep", "5", "--out", str(tmp_path), "--deterministic"]).stdout
    assert stdout.startswith("machine: ") and "check decoder_q300 fp32 uniform triton det" in stdout
    assert "FAILED" not in stdout
    with open(tmp_path / "msda_bench.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["impl"] for r in rows} >= {"triton", "triton det"} and all(float(r["fwd_ms"]) > 0 for r in rows)
    assert all(float(r["grad_value_err"]) < 1e-5 for r in rows if r["impl"].startswith("triton"))


def test_bench_msda_checks_the_deterministic_backward_against_float64(monkeypatch):
    # The deterministic row's errors come from the sort-and-segment backward, the other row's from the atomics
    # (both run here under the Triton interpreter); the setting is restored after each block.
    from deform_plugin.benchmarks.ops import msda as bench
    from deform_plugin.ops.msda import triton_launch
    backwards = []
    launch = triton_launch.msda_backward
    monkeypatch.setattr(triton_launch, "msda_backward",
                        lambda *args, deterministic, **kwargs: backwards.append(deterministic)
                        or launch(*args, deterministic=deterministic, **kwargs))
    case = bench.Case("tiny", levels=((4, 6), (2, 3)), batch=2, queries=5, heads=2, head_dim=8, points=2)
    inputs = bench.make_inputs(case, torch.float32, "uniform", device="cpu")
    impls = bench.implementations(torch.float32, "reference", deterministic=True)
    assert set(impls) == {"triton", bench.DETERMINISTIC, "reference"}
    assert not torch.are_deterministic_algorithms_enabled()
    for impl in ("triton", bench.DETERMINISTIC):
        with bench.deterministic_algorithms(impl == bench.DETERMINISTIC):
            assert torch.are_deterministic_algorithms_enabled() == (impl == bench.DETERMINISTIC)
            errors = bench.check_against_float64(impls[impl], inputs)
        assert not torch.are_deterministic_algorithms_enabled()
        assert bench.errors_pass(errors, "fp32"), (impl, errors)
    assert backwards == [False, True]


def test_benchmark_rejects_malformed_rows(micro_config, monkeypatch, capsys):
    # Refused by the command line's parser, before any row runs: in this process (no fresh interpreter needed).
    status, _, stderr = run_tool_main("benchmark.py", [micro_config, "--rows", "triton:fp8", "--device", "cpu"],
                                      monkeypatch, capsys)
    assert status == 2
    assert "mode 'fp8' is not one of fp32, fp16, bf16" in stderr


def test_msda_host_split_times_every_piece_of_the_plain_op():
    # On the CPU only our column runs (the Triton kernels under the interpreter; mmcv's is a CUDA op): each piece is
    # timed, and the table says which column did not run.
    from deform_plugin.benchmarks.ops import msda_entry
    from deform_plugin.benchmarks.ops.msda import Case
    case = Case("tiny", levels=((4, 6), (2, 3)), batch=2, queries=5, heads=2, head_dim=8, points=2)
    rows = msda_entry.host_split(case, torch.float32, "uniform", device="cpu", calls=1, repeats=1, warmup=0)
    assert [r["piece"] for r in rows] == list(msda_entry.HOST_SPLIT_PIECES)
    assert all(r["case"] == "tiny" and r["dtype"] == "fp32" for r in rows)
    assert all(r["ours_us"] > 0 for r in rows) and all(r["stock_us"] is None for r in rows)
    lines = msda_entry.format_host_split(rows, "machine: cpu").splitlines()
    assert lines[0] == "machine: cpu" and len(lines) == 4 + len(rows)
    assert "| tiny" in lines[3] and lines[3].rstrip(" |").endswith("-")


@pytest.mark.parametrize("option, value", [("--cases", "encoder_b2,encoder_b3"), ("--dtypes", "fp8"),
                                           ("--dists", "gaussian")])
def test_msda_entry_benchmark_names_an_unknown_case_dtype_or_dist(option, value, capsys):
    from deform_plugin.benchmarks.ops import msda_entry
    with pytest.raises(SystemExit) as stopped:
        msda_entry.main([option, value, "--host-split"])
    assert stopped.value.code == 2
    bad = value.split(",")[-1]
    assert f"{option}: unknown '{bad}'" in capsys.readouterr().err
