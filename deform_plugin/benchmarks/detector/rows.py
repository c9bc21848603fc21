"""The row grammar of the detector benchmark: ``BACKEND:MODE[:FAST]``.

    BACKEND  stock    mmdet/mmcv untouched, in a child process that never imports deform_plugin
             mmcv | pytorch | triton | auto
                      deform_plugin's MSDA module with that backend (``set_default_backend``)
    MODE     fp32 | fp16 | bf16    (fp16/bf16 = mmengine ``AmpOptimWrapper`` with that dtype; autocast at inference)
    FAST     config (default: whatever the config selects) | none | all | a '+' list of
             optim (merged param groups + fused/foreach optimizer), sdpa (SDPA attention bricks),
             matching (batched Hungarian matching with fewer host syncs), losses (sync-free loss normalisers),
             forward (sync-free forward), graph (training: the forward and backward replayed from CUDA graphs per
             input shape; inference rows: the forward captured in a CUDA graph), nms (DDQ-DETR's NMS in float32)
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import List, Optional

BACKEND_CHOICES = ("stock", "mmcv", "pytorch", "triton", "auto")
MODE_CHOICES = ("fp32", "fp16", "bf16")
# 'all' selects the exact ones; 'buckets' (ShapeBucketsHook's training padding) changes the padding, so a row names it.
EXACT_FAST_PATH_CHOICES = ("optim", "sdpa", "matching", "losses", "batched", "forward", "graph", "ffn", "nms")
FAST_PATH_CHOICES = EXACT_FAST_PATH_CHOICES + ("buckets",)


@dataclass(frozen=True)
class Row:
    backend: str
    mode: str
    fast: str = "config"  # 'config', 'none', 'all' or a '+' list of FAST_PATH_CHOICES

    @property
    def label(self) -> str:
        return f"{self.backend}:{self.mode}:{self.fast}"

    @property
    def plugin(self) -> bool:
        """Whether the row runs deform_plugin (every row but stock)."""
        return self.backend != "stock"

    def fast_set(self) -> Optional[frozenset]:
        """The fast paths to force, or None to keep what the config selects."""
        if self.fast == "config":
            return None
        if self.fast == "none":
            return frozenset()
        if self.fast == "all":
            return frozenset(EXACT_FAST_PATH_CHOICES)
        return frozenset(self.fast.split("+"))


def parse_row(text: str) -> Row:
    """A :class:`Row` from ``BACKEND:MODE[:FAST]``; ``argparse.ArgumentTypeError`` listing every problem."""
    parts = text.split(":")
    if not 2 <= len(parts) <= 3:
        raise argparse.ArgumentTypeError(f"row {text!r} is not BACKEND:MODE[:FAST]")
    backend, mode = parts[0], parts[1]
    fast = parts[2] if len(parts) == 3 else "config"
    problems = []
    if backend not in BACKEND_CHOICES:
        problems.append(f"backend {backend!r} is not one of {', '.join(BACKEND_CHOICES)}")
    if mode not in MODE_CHOICES:
        problems.append(f"mode {mode!r} is not one of {', '.join(MODE_CHOICES)}")
    if fast not in ("config", "none", "all"):
        unknown = [name for name in fast.split("+") if name not in FAST_PATH_CHOICES]
        if unknown:
            problems.append(f"fast paths {unknown} are not among config, none, all or a '+' list of "
                            f"{', '.join(FAST_PATH_CHOICES)}")
    if backend == "stock" and fast not in ("config", "none"):
        problems.append("a stock row runs without deform_plugin, so it takes no fast paths")
    if problems:
        raise argparse.ArgumentTypeError(f"row {text!r}: " + "; ".join(problems))
    return Row(backend, mode, "none" if backend == "stock" else fast)


def build_rows(args) -> List[Row]:
    """``--rows``, or every combination of ``--backends`` x ``--modes`` x ``--fast``."""
    if args.rows:
        return list(args.rows)
    return [parse_row(f"{b}:{m}:{f}") for b in args.backends for m in args.modes for f in args.fast]


def row_result(config: str, row: Row, status: str = "ok", **fields) -> dict:
    """The head of every row's result: config, row and its parts, status (ok, skipped, failed)."""
    return {"config": config, "row": row.label, "backend": row.backend, "mode": row.mode, "fast": row.fast,
            "status": status, **fields}
