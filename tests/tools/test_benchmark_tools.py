"""Smoke runs of tools/benchmark.py and tools/profile_step.py on CPU with a micro Deformable-DETR.

One benchmark run covers: a stock row (child process without deform_plugin), our module with no fast path and
with every fast path, training/inference timing, the profile breakdown, the table, JSON, CSV and PNG. Dropout is
off in the micro config, so the three rows must also agree on the losses (the fast paths are exact).
"""
import csv
import json
import os
import subprocess
import sys

import pytest

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


def _run_tool(script, args, tmp_path):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    completed = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", script), *args], cwd=REPO_ROOT,
                               env=env, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return completed.stdout


@pytest.fixture(scope="module")
def micro_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("configs") / "micro_deformable_detr.py"
    path.write_text(MICRO_DEFORMABLE_DETR)
    return str(path)


def test_benchmark_compares_rows_and_writes_table_json_csv_png(micro_config, tmp_path):
    out_dir = tmp_path / "out"
    stdout = _run_tool("benchmark.py", [micro_config, "--rows", "stock:fp32", "pytorch:fp32:none",
                                        "pytorch:fp32:all", "pytorch:bf16:all", "--profile",
                                        "--out-dir", str(out_dir), *SMALL_RUN], tmp_path)
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
    assert rows["stock:fp32:none"]["train"]["speedup"] == pytest.approx(1.0)
    # Every fast path selected, and it changed something.
    fast = rows["pytorch:fp32:all"]
    assert fast["optimizer"]["constructor"] == "MergedParamGroupsOptimWrapperConstructor"
    assert fast["optimizer"]["param_groups"] < rows["pytorch:fp32:none"]["optimizer"]["param_groups"]
    assert fast["fast_path_sites"] == {"sdpa_attention": 2, "hungarian_host_syncs": 1}
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
    table = (out_dir / "benchmark.md").read_text()
    assert table.startswith("machine: ") and "| pytorch:fp32:all |" in table
    assert (out_dir / "benchmark_profile.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_profile_tool_writes_breakdown_chart_and_trace(micro_config, tmp_path):
    out_dir = tmp_path / "prof"
    stdout = _run_tool("profile_step.py", [micro_config, "--rows", "pytorch:fp32:all", "--trace",
                                           "--out-dir", str(out_dir), *SMALL_RUN], tmp_path)
    assert "[profile] CPU ms/step: MSDA" in stdout
    assert "[train]" not in stdout  # profile only
    report = json.loads((out_dir / "profile.json").read_text())
    (row,) = report["results"]
    components = row["profile"]["components_ms_per_step"]
    assert set(components) == {"MSDA", "GEMM", "convolution", "optimizer", "matching", "elementwise", "memcpy",
                               "other"}
    assert components["MSDA"] > 0 and components["convolution"] > 0 and components["GEMM"] > 0
    assert 0 < row["profile"]["busy_fraction"] <= 1.05
    assert os.path.getsize(row["profile"]["trace"]) > 0
    assert (out_dir / "profile.png").exists()


def test_benchmark_rejects_malformed_rows(micro_config, tmp_path):
    completed = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "benchmark.py"), micro_config,
                                "--rows", "triton:fp8", "--device", "cpu"], cwd=REPO_ROOT, capture_output=True,
                               text=True, timeout=120)
    assert completed.returncode == 2
    assert "mode 'fp8' is not one of fp32, fp16, bf16" in completed.stderr


def _load_benchmark_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("benchmark_under_test", os.path.join(REPO_ROOT, "tools",
                                                                                        "benchmark.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is created
    spec.loader.exec_module(module)
    return module


def test_cuda_profile_analysis_on_synthetic_events():
    """The CUDA branch of the analysis (not reachable on a CPU host) on hand-made kernel events."""
    import re
    from types import SimpleNamespace

    import torch
    from torch.autograd import DeviceType
    benchmark = _load_benchmark_module()

    def event(name, device, start, end, event_id=0, linked=0):
        return SimpleNamespace(name=name, device_type=device, is_async=False, id=event_id,
                               linked_correlation_id=linked, time_range=SimpleNamespace(start=start, end=end),
                               self_cpu_time_total=end - start)
    cpu, gpu = DeviceType.CPU, DeviceType.CUDA
    events = [
        event("deform_plugin::train_step", cpu, 0, 1000),
        event("deform_plugin::matching", cpu, 100, 200),
        event("deform_plugin::optimizer", cpu, 800, 900),
        event("aten::addmm", cpu, 10, 20, event_id=1),
        event("aten::add", cpu, 150, 160, event_id=2),     # launched inside matching
        event("aten::_foreach_mul_", cpu, 810, 820, event_id=3),
        event("sm90_xmma_gemm_f32f32_tn", gpu, 30, 130, event_id=11, linked=1),
        event("vectorized_elementwise_kernel", gpu, 170, 190, event_id=12, linked=2),
        event("multi_tensor_apply_kernel", gpu, 830, 850, event_id=13, linked=3),
        event("msda_backward_kernel", gpu, 400, 700, event_id=14),  # no launching op recorded: by name
        event("ms_deformable_col2im_gpu_kernel", gpu, 690, 720, event_id=15),
        event("Memcpy HtoD (Pageable -> Device)", gpu, 120, 125, event_id=16),
        event("deform_plugin::train_step", gpu, 0, 1000),   # GPU-side annotation: not a kernel
    ]
    result = benchmark.analyse_profile(events, 1, torch.device("cuda"), re.compile(r"ms_?deform|msda", re.I))
    components = result["components_ms_per_step"]
    assert components["GEMM"] == pytest.approx(0.1)
    assert components["matching"] == pytest.approx(0.02)
    assert components["optimizer"] == pytest.approx(0.02)
    assert components["MSDA"] == pytest.approx(0.33)
    assert components["memcpy"] == pytest.approx(0.005)
    assert result["kernels_per_step"] == 6
    # Busy: [30,130] + [170,190] + [400,720] + [830,850] = 460 us of a 1000 us step.
    assert result["busy_fraction"] == pytest.approx(0.46)
    assert result["host_ms_per_step"] == {"matching": 0.1, "optimizer": 0.1}
