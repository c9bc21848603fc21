"""``python -m deform_plugin check|warmup`` (or the ``deform-plugin`` console script): see :mod:`deform_plugin.check`
and :mod:`deform_plugin.warmup`."""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deform_plugin",
                                     description="deform_plugin's command line: fused Triton multi-scale deformable "
                                     "attention for MMDetection 3.x")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    commands.add_parser("check", help="print what deform_plugin found in this environment (mmcv's compiled ops or "
                        "the stand-in, Triton, the GPU, versions, the backend 'auto' picks); exit 1 if something "
                        "required is missing", description="Print what deform_plugin found in this environment; "
                        "exit 1 if something required is missing or unsupported.")
    warmup = commands.add_parser(
        "warmup", help="compile every Triton MSDA kernel variant a config's model launches, into Triton's on-disk "
        "cache (once per machine)", description="Compile every Triton MSDA kernel variant that CONFIG's model "
        "launches, in float32 and the --amp-dtype given, one process per kernel variant, into Triton's on-disk "
        "cache: for this machine's GPU, or with --arch for a GPU architecture on a machine without one.")
    warmup.add_argument("config", help="an mmdet config with custom_imports=['deform_plugin']")
    warmup.add_argument("--amp-dtype", choices=("float16", "bfloat16"), action="append", default=[],
                        help="also the variants of this autocast dtype (repeatable)")
    warmup.add_argument("--serial", action="store_true", help="compile one after another in this process")
    warmup.add_argument("--arch", type=int, default=None, metavar="CAPABILITY",
                        help="compile for this CUDA compute capability, major * 10 + minor (90: H100/H200, 80: "
                        "A100), without a GPU; TRITON_CACHE_DIR then names the cache to fill")
    args = parser.parse_args(argv)
    if args.command == "check":
        from .check import run_check
        return run_check()
    if args.command == "warmup":
        from .cli import require_path
        require_path("config", args.config)
        from .warmup import run_warmup
        return run_warmup(args.config, ["float32"] + args.amp_dtype, parallel=not args.serial, arch=args.arch)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
