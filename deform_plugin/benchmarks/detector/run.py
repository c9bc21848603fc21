"""The whole-detector benchmark's command line and its loop over configs and rows.

``tools/benchmark.py`` and ``tools/profile_step.py`` call :func:`main`; stock rows re-enter it in a child process
(``... --child-json OUT``, see :mod:`.children`).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import traceback
from typing import List, Optional, Sequence, Tuple

import torch

from deform_plugin.benchmarks.common import machine_info, machine_line
from deform_plugin.benchmarks.detector.children import check_still_stock, prepare_stock_process, run_row_in_child
from deform_plugin.benchmarks.detector.configs import (default_shape, drop_pretrained_init, load_config,
                                                       optim_wrapper_config, read_config, resolve_fast_paths,
                                                       runner_logging, shape_problems, short_config_name)
from deform_plugin.benchmarks.detector.profiling import profile_lines, profile_training
from deform_plugin.benchmarks.detector.random_text_encoder import RANDOM_TEXT_ENCODER, TIMING_ONLY_LABEL
from deform_plugin.benchmarks.detector.report import add_speedups, format_table, write_outputs
from deform_plugin.benchmarks.detector.rows import BACKEND_CHOICES, MODE_CHOICES, Row, build_rows, parse_row, row_result
from deform_plugin.benchmarks.detector.synthetic import make_batch, make_variable_batches
from deform_plugin.benchmarks.detector.timing import mmdet_line, time_inference, time_training, time_variable_sizes


def build_parser(description: Optional[str] = None, profile_only: bool = False) -> argparse.ArgumentParser:
    """The options of tools/benchmark.py; with ``profile_only``, those of tools/profile_step.py, which makes no
    timing runs and so offers none of their options."""
    parser = argparse.ArgumentParser(description=description or __doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configs", nargs="+", help="config files (local files; stock configs via configs/...)")
    parser.add_argument("--rows", nargs="+", type=parse_row, help="BACKEND:MODE[:FAST] rows; the first is the "
                        "baseline. Without --rows: every combination of --backends x --modes x --fast")
    parser.add_argument("--backends", nargs="+", default=["auto"], choices=BACKEND_CHOICES)
    parser.add_argument("--modes", nargs="+", default=["fp32"], choices=MODE_CHOICES)
    parser.add_argument("--fast", nargs="+", default=["config"], help="config | none | all | optim+sdpa+matching")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", nargs=2, type=int, default=None, metavar=("H", "W"),
                        help="synthetic image size. Default: per config, the first fixed size of its training "
                        "pipeline (Resize scale, LSJ crop size: 1024 1024 for Mask2Former), else of its test "
                        "pipeline (800 1333 for the DETR family), else 800 1333")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--num-gts", type=int, default=10, help="ground-truth objects per synthetic image")
    if profile_only:
        parser.set_defaults(warmup=0, steps=0, variable_sizes=0, inference_warmup=0, inference_steps=0, profile=False,
                            profile_only=True, no_progress=True)
    else:
        parser.add_argument("--warmup", type=int, default=5)
        parser.add_argument("--steps", type=int, default=20, help="timed training steps (0: skip training)")
        parser.add_argument("--variable-sizes", type=int, default=0, metavar="N",
                            help="also time N training steps on batches of new random-resize sizes (shorter side "
                            "480-800, longer <= 1333, COCO-like aspect ratios), then the same N batches again: img/s "
                            "at new sizes, at seen sizes, and the cost of a new size per step")
        parser.add_argument("--inference-warmup", type=int, default=5)
        parser.add_argument("--inference-steps", type=int, default=20, help="timed batch-1 inferences (0: skip)")
        parser.add_argument("--profile", action="store_true", help="also profile --profile-steps steps per row")
        parser.add_argument("--profile-only", action="store_true", help="profile without the timing runs")
    parser.add_argument("--profile-steps", type=int, default=3, help="profiled training steps per row")
    parser.add_argument("--trace", action="store_true", help="write a Chrome trace per profiled row (--out-dir)")
    parser.add_argument("--msda-kernel-regex", default=r"ms_?deform|msda|deform_?attn|grid_sampler",
                        help="kernel/op names counted as MSDA in profiles")
    parser.add_argument("--tf32", action="store_true", help="allow TF32 matmuls/convs (PyTorch default: off)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=None, help="write NAME.json, NAME.csv, NAME.md (and NAME_profile.png)"
                        + (" (default: work_dirs/profile/<config stem>)" if profile_only else ""))
    parser.add_argument("--name", default="benchmark", help="file stem of the outputs")
    parser.add_argument("--cfg-options", nargs="+", default=None, help="key=value overrides, as in mmdet tools")
    if not profile_only:
        parser.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    parser.add_argument("--fail-fast", action="store_true", help="stop at the first failing row")
    parser.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                        help="start no new row after this many seconds (they are reported as skipped)")
    parser.add_argument("--child-json", default=None, help=argparse.SUPPRESS)
    return parser


def parse_cfg_options(items: Optional[List[str]]) -> Optional[dict]:
    if not items:
        return None
    from mmengine.config import DictAction
    parser = argparse.ArgumentParser()
    parser.add_argument("--o", nargs="+", action=DictAction)
    return parser.parse_args(["--o", *items]).o


def resolve_shape(config_path: str, args) -> Tuple[Tuple[int, int], str, Optional[str]]:
    """The (H, W) a config runs at, where it came from, and why the model cannot take it (None when it can)."""
    cfg = read_config(config_path, args.cfg_options)
    default, default_source = default_shape(cfg)
    shape, source = (tuple(args.shape), "--shape") if args.shape else (default, default_source)
    problems = shape_problems(cfg, shape)
    if not problems:
        return shape, source, None
    if shape != default and not shape_problems(cfg, default):
        problems.append(f"the config's own size, {default[0]} {default[1]} ({default_source}), works")
    return shape, source, f"shape {shape[0]}x{shape[1]} ({source}) cannot run: " + "; ".join(problems)


def run_row_in_process(config_path: str, row: Row, args, shape: Tuple[int, int]) -> dict:
    device = torch.device(args.device)
    result = row_result(config_path, row, shape=list(shape))
    if row.mode != "fp32" and device.type != "cuda":
        result.update(status="skipped", error="AMP modes need CUDA (mmengine AmpOptimWrapper)")
        return result
    if row.mode == "bf16" and not torch.cuda.is_bf16_supported():
        result.update(status="skipped", error="this GPU has no bf16 support")
        return result
    if not row.plugin:
        prepare_stock_process(device)
    cfg = load_config(config_path, args.cfg_options, plugin=row.plugin)
    language_model = cfg.model.get("language_model") or {}
    if language_model.get("type") == RANDOM_TEXT_ENCODER:
        result["text_encoder"] = TIMING_ONLY_LABEL
    speedups = resolve_fast_paths(cfg, row)
    if row.plugin:
        from deform_plugin.ops import set_default_backend
        set_default_backend(row.backend)
    from mmdet.registry import MODELS
    from mmengine.optim import build_optim_wrapper
    drop_pretrained_init(cfg.model)
    torch.manual_seed(args.seed)
    model = MODELS.build(cfg.model)
    # Modules such as DeformableDETR.level_embed are torch.empty until init_weights(): without it every row would
    # start from different (possibly non-finite) garbage.
    model.init_weights()
    model.to(device)
    result["fast_path_sites"] = {}
    if row.plugin and speedups.fast_paths.selected():
        from deform_plugin.integration.mmdet_fast_paths import apply_fast_paths
        result["fast_path_sites"] = apply_fast_paths(model, speedups.fast_paths)
    model.train()
    optim_wrapper = build_optim_wrapper(model, optim_wrapper_config(cfg, row.mode, plugin=row.plugin))
    optimizer = optim_wrapper.optimizer
    result["optimizer"] = {"constructor": cfg.optim_wrapper.get("constructor", "DefaultOptimWrapperConstructor"),
                           "param_groups": len(optimizer.param_groups),
                           "fused": bool(optimizer.defaults.get("fused")),
                           "foreach": optimizer.defaults.get("foreach")}
    eval_divisor = model.data_preprocessor.pad_size_divisor
    train_divisor = eval_divisor
    if speedups.bucket_divisor:  # as ShapeBucketsHook does in the Runner: training batches only
        from deform_plugin.engine import ShapeBucketsHook
        train_divisor = ShapeBucketsHook.training_divisor(eval_divisor, speedups.bucket_divisor)
        result["fast_path_sites"]["shape_buckets"] = train_divisor
    model.data_preprocessor.pad_size_divisor = train_divisor
    height, width = shape
    batch = make_batch(model, args.batch_size, height, width, args.num_gts, args.seed)
    label = f"{short_config_name(config_path)} {row.label}"
    # As the Runner of a configs/fast variant logs (no per-step read of the gradient norm).
    with runner_logging(cfg, row):
        if not args.profile_only:
            if args.steps > 0:
                result["train"] = time_training(model, optim_wrapper, batch, device, args.warmup, args.steps,
                                                not args.no_progress, label)
                print(f"{label} " + mmdet_line("train", result["train"]["img_per_s"], result["train"]["memory"]),
                      flush=True)
            if args.variable_sizes > 0:
                batches = make_variable_batches(model, args.variable_sizes, args.batch_size, args.num_gts,
                                                args.seed)
                v = time_variable_sizes(model, optim_wrapper, batches, device, not args.no_progress, label)
                result["variable"] = v
                print(f"{label} [train, variable sizes] new sizes {v['new_sizes']['img_per_s']:.2f} img/s, seen "
                      f"sizes {v['seen_sizes']['img_per_s']:.2f} img/s, a new size costs "
                      f"{v['new_size_cost_ms']:.0f} ms ({v['distinct_batch_shapes']} distinct batch shapes)",
                      flush=True)
                del batches
            model.data_preprocessor.pad_size_divisor = eval_divisor
            if args.inference_steps > 0:
                batch1 = make_batch(model, 1, height, width, args.num_gts, args.seed)
                if speedups.graph_inference and device.type == "cuda":
                    from deform_plugin.integration.mmdet_graph_inference import enable_graph_inference
                    result["fast_path_sites"]["graph_inference"] = type(enable_graph_inference(model)).__name__
                result["inference"] = time_inference(model, batch1, device, row.mode, args.inference_warmup,
                                                     args.inference_steps, not args.no_progress, label)
                print(f"{label} " + mmdet_line("inference", result["inference"]["fps"],
                                               result["inference"]["memory"]), flush=True)
        if args.profile or args.profile_only:
            model.data_preprocessor.pad_size_divisor = train_divisor
            trace = None
            if args.trace and args.out_dir:
                trace = os.path.join(
                    args.out_dir, f"trace_{short_config_name(config_path)}_{row.label.replace(':', '-')}.json")
            result["profile"] = profile_training(model, optim_wrapper, batch, device, args.profile_steps, trace,
                                                 re.compile(args.msda_kernel_regex, re.I))
            print(profile_lines(label, result["profile"]), flush=True)
    if not row.plugin:
        check_still_stock()
    del model, optim_wrapper, optimizer, batch
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def run_row(config_path: str, row: Row, args, shape: Tuple[int, int]) -> dict:
    try:
        if not row.plugin and not args.child_json:
            return run_row_in_child(config_path, row, args, shape)
        return run_row_in_process(config_path, row, args, shape)
    except Exception as error:  # one failing row (OOM, unsupported dtype) must not lose the others
        if args.fail_fast:
            raise
        traceback.print_exc()
        return row_result(config_path, row, "failed", shape=list(shape),
                          error=f"{type(error).__name__}: {error}"[:500])


def main(argv: Optional[Sequence[str]] = None, description: Optional[str] = None, **defaults) -> int:
    """Run the benchmark; ``defaults`` override argument defaults (``tools/profile_step.py``: profile only)."""
    parser = build_parser(description, profile_only=defaults.get("profile_only", False))
    parser.set_defaults(**defaults)
    args = parser.parse_args(argv)
    from mmengine.logging import MMLogger
    # The per-parameter 'paramwise_options' lines of optimizer construction would bury the results.
    MMLogger.get_instance("deform_plugin_benchmark", log_level="WARNING")
    args.cfg_options = parse_cfg_options(args.cfg_options)
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    torch.backends.cudnn.allow_tf32 = args.tf32
    rows = build_rows(args)
    if args.child_json:
        result = run_row(args.configs[0], rows[0], args, tuple(args.shape))
        with open(args.child_json, "w") as f:
            json.dump(result, f, default=str)
        return 0
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
    info = machine_info(torch.device(args.device))
    print(machine_line(info), flush=True)
    results = []
    started = time.perf_counter()
    for config_path in args.configs:
        try:
            shape, source, problem = resolve_shape(config_path, args)
        except Exception as error:  # an unreadable config fails its rows and the others go on, as a failing row
            if args.fail_fast:
                raise
            shape, source, problem = args.shape, None, f"cannot read the config: {type(error).__name__}: {error}"
        if problem:
            if args.fail_fast:
                raise SystemExit(f"{config_path}: {problem}")
            print(f"{config_path}: {problem}", file=sys.stderr, flush=True)
        else:
            print(f"{short_config_name(config_path)}: shape {shape[0]}x{shape[1]} ({source})", flush=True)
        for row in rows:
            if problem:
                results.append(row_result(config_path, row, "failed", shape=shape and list(shape), error=problem))
            elif args.time_budget is not None and time.perf_counter() - started > args.time_budget:
                results.append(row_result(config_path, row, "skipped", shape=list(shape),
                                          error=f"--time-budget {args.time_budget:.0f} s used up"))
            else:
                results.append(run_row(config_path, row, args, shape))
            if args.out_dir:  # partial results survive a run killed by a time limit
                add_speedups(results)
                write_outputs(results, info, args, rows, format_table(results, info))
    add_speedups(results)
    table = format_table(results, info)
    print("\n" + table, flush=True)
    for kind, path in write_outputs(results, info, args, rows, table).items():
        print(f"wrote {kind}: {path}")
    return 0 if all(r["status"] in ("ok", "skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
