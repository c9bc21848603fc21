"""``python -m deform_plugin check`` (or the ``deform-plugin check`` console script): see :mod:`deform_plugin.check`."""
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
    args = parser.parse_args(argv)
    if args.command == "check":
        from .check import run_check
        return run_check()
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
