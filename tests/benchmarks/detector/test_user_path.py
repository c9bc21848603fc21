"""deform_plugin.benchmarks.detector.user_path (tools/benchmark_train.py): each row's command line, and one tiny CPU
run of a stock and of our row, each through its own training script."""
from __future__ import annotations

import csv
import json

import pytest
from train_benchmark_cases import REPO_ROOT, SOURCE_IMAGES, TINY_COCO_CONFIG

from deform_plugin.benchmarks.detector import user_path
from deform_plugin.benchmarks.detector.coco_source import CocoSource
from deform_plugin.benchmarks.detector.train_report import markdown, summarize
from deform_plugin.benchmarks.stock_process import stock_command


def test_row_commands_use_each_sides_script(tmp_path):
    stock = user_path.row_command(user_path.parse_row("stock:bf16"), tmp_path / "o.py", tmp_path / "w")
    assert stock[1:3] == stock_command(user_path.STOCK_TRAIN_MODULE)
    assert stock[-3:] == ["--amp", "--cfg-options", "optim_wrapper.dtype=bfloat16"]
    ours = user_path.row_command(user_path.parse_row("ours:fp16"), tmp_path / "o.py", tmp_path / "w")
    assert ours[1] == str(REPO_ROOT / "tools" / "train.py") and ours[-2:] == ["--amp-dtype", "float16"]
    assert "--amp" not in user_path.row_command(user_path.parse_row("ours:fp32"), tmp_path / "o.py", tmp_path / "w")
    with pytest.raises(Exception, match="side 'mmcv'.*mode 'tf32'"):
        user_path.parse_row("mmcv:tf32")


def test_row_options_name_the_rows_and_set_their_process_environment(tmp_path):
    plain = user_path.parse_row("ours:bf16")
    assert plain.label == "ours:bf16" and user_path.row_environment(plain, tmp_path / "cold") is None
    row = user_path.parse_row("ours:bf16:cudnn-v7:cold:no-buckets")
    assert row.label == "ours:bf16:no-buckets:cold:cudnn-v7"
    assert (row.buckets, row.cold_cache, row.cudnn_v7) == (False, True, True)
    assert user_path.row_environment(row, tmp_path / "cold") == {"TRITON_CACHE_DIR": str(tmp_path / "cold"),
                                                                 "TORCH_CUDNN_V8_API_DISABLED": "1"}
    assert user_path.row_environment(user_path.parse_row("stock:fp32:cudnn-v7"), tmp_path) == {
        "TORCH_CUDNN_V8_API_DISABLED": "1"}
    with pytest.raises(Exception, match="option 'cudnn-v9' is not one of no-buckets, cold, cudnn-v7, own-shapes"):
        user_path.parse_row("ours:bf16:cudnn-v9")


def test_own_shapes_rows_let_each_rank_pad_to_its_own_bucket():
    row = user_path.parse_row("ours:bf16:own-shapes")
    assert row.own_shapes and row.label == "ours:bf16:own-shapes"
    for text in ("ours:bf16:no-buckets:own-shapes", "stock:fp32:own-shapes"):
        with pytest.raises(Exception, match="own-shapes sets ShapeBucketsHook's padding across ranks"):
            user_path.parse_row(text)


def test_multi_gpu_rows_run_each_script_under_torch_distributed(tmp_path):
    ours = user_path.row_command(user_path.parse_row("ours:bf16"), tmp_path / "o.py", tmp_path / "w", gpus=2,
                                 port=29601)
    assert ours[1:5] == ["-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29601"]
    assert ours[-2:] == ["--launcher", "pytorch"] and "--amp-dtype" in ours
    stock = user_path.row_command(user_path.parse_row("stock:fp32"), tmp_path / "o.py", tmp_path / "w", gpus=2)
    assert stock[5:7] == stock_command(user_path.STOCK_TRAIN_MODULE) and stock[-2:] == ["--launcher", "pytorch"]
    bound = user_path.row_command(user_path.parse_row("ours:bf16"), tmp_path / "o.py", tmp_path / "w", gpus=2,
                                  numa_binding="node", port=29601)
    assert bound[:6] == ours[:5] + ["--numa-binding=node"] and bound[6:] == ours[5:]
    single = user_path.row_command(user_path.parse_row("ours:bf16"), tmp_path / "o.py", tmp_path / "w",
                                   numa_binding="node")
    assert not any("numa" in part for part in single)  # one process: nothing to bind


def test_each_multi_gpu_row_rendezvouses_on_a_port_nothing_holds(tmp_path):
    import socket
    command = user_path.row_command(user_path.parse_row("ours:bf16"), tmp_path / "o.py", tmp_path / "w", gpus=4)
    port = int(next(part for part in command if part.startswith("--master_port=")).split("=")[1])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:  # it is free: a rank could listen on it
        listener.bind(("127.0.0.1", port))
        listener.listen()
        taken = listener.getsockname()[1]
        assert user_path.free_port() != taken  # and a port in use is never handed out


def test_every_row_runs_on_each_gpu_count_in_turn(tmp_path, monkeypatch):
    runs = []

    def fake_run_row(config_path, base_cfg, row, source, settings, scratch, out_dir):
        runs.append((row.label, settings.gpus))
        return dict(config=str(config_path), row=row.label, gpus=settings.gpus, status="ok", wall_s=0.0, log="-")
    monkeypatch.setattr(user_path, "run_row", fake_run_row)
    rows = [user_path.parse_row("stock:fp32"), user_path.parse_row("ours:bf16")]
    results = user_path.run_benchmark([TINY_COCO_CONFIG], rows, user_path.Settings(), source=None, out_dir=tmp_path,
                                      progress=lambda line: None, gpu_counts=[1, 4])
    assert runs == [("stock:fp32", 1), ("ours:bf16", 1), ("stock:fp32", 4), ("ours:bf16", 4)]
    assert [r["gpus"] for r in results] == [1, 1, 4, 4]
    args = user_path.build_parser().parse_args([str(TINY_COCO_CONFIG), "--gpus", "1", "4"])
    assert args.gpus == [1, 4] and user_path.build_parser().parse_args([str(TINY_COCO_CONFIG)]).gpus == [1]


def test_under_a_deadline_a_row_starts_only_where_the_longest_row_so_far_still_fits(tmp_path, monkeypatch):
    now, timeouts = [0.0], []

    def fake_run_row(config_path, base_cfg, row, source, settings, scratch, out_dir):
        timeouts.append(settings.timeout_s)
        took = 50.0 if row.mode == "fp32" else 80.0
        now[0] += took
        return dict(config=str(config_path), row=row.label, gpus=settings.gpus, status="ok", wall_s=took, log="-")
    monkeypatch.setattr(user_path, "run_row", fake_run_row)
    rows = [user_path.parse_row(text) for text in ("stock:fp32", "ours:bf16", "ours:fp32", "ours:bf16:cold")]
    results = user_path.run_benchmark([TINY_COCO_CONFIG], rows, user_path.Settings(timeout_s=3600), source=None,
                                      out_dir=tmp_path, progress=lambda line: None, deadline=200.0,
                                      clock=lambda: now[0])
    # 200 s: the first row may start (60 s assumed), the second (50 s taken so far, 150 left), the third needs the
    # 80 s the second took (70 left): skipped, as is the fourth; each row that ran was limited to what was left.
    assert [r["status"] for r in results] == ["ok", "ok", "skipped", "skipped"]
    assert timeouts == [200.0, 150.0]
    assert results[2]["error"] == "not started: 70 s were left before --deadline, and a row takes about 80 s"
    text = markdown(summarize(results, user_path.Settings(), CocoSource(tmp_path, 4, 0)))
    assert "ours:fp32 skipped** (log: None):" in text and "a row takes about 80 s" in text
    with pytest.raises(SystemExit, match="--deadline 5: give more than the 5 s kept for the report"):
        user_path.main([str(TINY_COCO_CONFIG), "--deadline", "5"])


@pytest.mark.parametrize("text", ["0", "two", "-1"])
def test_a_bad_gpu_count_is_refused_with_its_text(text):
    import argparse
    with pytest.raises(argparse.ArgumentTypeError, match=f"--gpus '{text}'"):
        user_path.parse_gpu_count(text)


@pytest.mark.parametrize("text", ["151", "a:3", "0:3", "151:0", "1:2:3"])
def test_a_bad_profile_window_is_refused_with_its_text(text):
    import argparse
    with pytest.raises(argparse.ArgumentTypeError, match=text):
        user_path.parse_profile_window(text)


def test_tiny_benchmark_runs_stock_and_our_rows(tmp_path, source, monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the child processes: one thread each on a small shared CPU
    out_dir = tmp_path / "out"
    status = user_path.main([
        str(TINY_COCO_CONFIG), "--rows", "stock:fp32", "ours:fp32", "--iters", "3", "--first-iters", "1",
        "--batch-size", "2", "--workers", "1", "--images", str(SOURCE_IMAGES),
        "--data-cache", str(source.root.parent), "--out-dir", str(out_dir), "--timeout", "300"])
    report = json.loads((out_dir / "train_benchmark.json").read_text())
    assert status == 0, [r["error"] for r in report["results"]]
    stock, ours = report["results"]
    for result in (stock, ours):
        assert result["status"] == "ok"
        # first, first_100 (the whole of a 3-iteration run), all, steady
        assert [w["img_per_s"] > 0 for w in result["timing"]["windows"]] == [True, True, True, True]
        assert result["timing"]["iterations_run"] == 3 and result["timing"]["images_run"] == 6
    assert stock["timing"]["deform_plugin_loaded"] is False
    assert list(stock["timing"]["msda_modules"]) == ["mmcv.ops.multi_scale_deform_attn.MultiScaleDeformableAttention"]
    assert ours["timing"]["deform_plugin_loaded"] is True
    assert list(ours["timing"]["msda_modules"]) == ["deform_plugin.models.msda.MultiScaleDeformableAttention"]
    rows = report["rows"]
    assert rows[0]["speedup"] == pytest.approx(1.0) and rows[1]["speedup"] > 0
    markdown = (out_dir / "train_benchmark.md").read_text()
    assert "| stock:fp32 | ok |" in markdown and "| ours:fp32 | ok |" in markdown
    assert "| img/s it 1-3 |" in markdown and "| 1-3 / steady |" in markdown  # a run shorter than 100 iterations
    assert "| stock:fp32 | ok |" in capsys.readouterr().out  # the table is printed too
    with open(out_dir / "train_benchmark.csv") as handle:
        assert [r["row"] for r in csv.DictReader(handle)] == ["stock:fp32", "ours:fp32"]
    # Each row's timing file stays in the out dir as the row ends, and --report-only remakes the report from them
    # alone (a run cut short keeps its finished rows), in the order the rows ran: the first stays the baseline.
    again = tmp_path / "again"
    assert user_path.main(["--report-only", str(out_dir), "--iters", "3", "--first-iters", "1", "--batch-size", "2",
                           "--images", str(SOURCE_IMAGES), "--out-dir", str(again)]) == 0
    remade = json.loads((again / "train_benchmark.json").read_text())
    assert [(r["config"], r["row"], r["steady_img_s"], r["speedup"]) for r in remade["rows"]] == [
        (r["config"], r["row"], r["steady_img_s"], r["speedup"]) for r in rows]
    with pytest.raises(SystemExit, match="holds no timing files"):
        user_path.main(["--report-only", str(tmp_path / "nothing"), "--out-dir", str(again)])


def test_report_only_names_a_file_that_is_not_a_timing_file(tmp_path):
    (tmp_path / "timing").mkdir()
    (tmp_path / "timing" / "notes.json").write_text(json.dumps({"label": "ours:bf16"}))
    with pytest.raises(ValueError, match=r"notes.json is not a timing file of this benchmark"):
        user_path.results_from_timing_files(tmp_path)
    (tmp_path / "timing" / "notes.json").unlink()
    (tmp_path / "timing" / "cfg__ours-bf16__2gpus.json").write_text(json.dumps({"label": "ours:bf16", "windows": []}))
    (result,) = user_path.results_from_timing_files(tmp_path)
    assert (result["config"], result["row"], result["gpus"], result["status"]) == ("cfg.py", "ours:bf16", 2, "ok")
