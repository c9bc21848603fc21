"""A config for A/B runs of ShapeBucketsHook's borrowed shapes: CONFIG with other borrowing settings.

    python deform_plugin/benchmarks/detector/borrow_variant.py CONFIG UNTIL_SEEN MAX_PIXELS > variant.py

The variant inherits CONFIG (``_base_`` = its absolute path) and restates its ``custom_hooks`` with the
ShapeBucketsHook's ``borrow_until_seen`` and ``borrow_max_pixels`` replaced (``1`` turns borrowing off).
"""
from __future__ import annotations

import os
import sys
from typing import Sequence


def borrow_variant(config_path: str, until_seen: int, max_pixels: float) -> str:
    """The variant config's text."""
    from mmengine.config import Config
    config_path = os.path.abspath(config_path)
    cfg = Config.fromfile(config_path, import_custom_modules=False)
    hooks, found = [], False
    for hook in cfg.get("custom_hooks", None) or []:
        hook = dict(hook)
        if hook.get("type") == "ShapeBucketsHook":
            hook.update(borrow_until_seen=int(until_seen), borrow_max_pixels=float(max_pixels))
            found = True
        hooks.append(hook)
    if not found:
        raise ValueError(f"{config_path} has no ShapeBucketsHook in custom_hooks: nothing to vary")
    return (f"# {os.path.basename(config_path)} with borrow_until_seen={int(until_seen)}, "
            f"borrow_max_pixels={float(max_pixels):g} (deform_plugin/benchmarks/detector/borrow_variant.py)\n"
            f"_base_ = {config_path!r}\ncustom_hooks = {hooks!r}\n")


def main(argv: Sequence[str]) -> None:
    if len(argv) != 3:
        raise SystemExit(__doc__)
    sys.stdout.write(borrow_variant(argv[0], int(argv[1]), float(argv[2])))


if __name__ == "__main__":
    main(sys.argv[1:])
