"""The target program that compute-sanitizer watches: ``python -m deform_plugin.benchmarks.sanitizer.targets CASE...``.

Cases (``KIND:DTYPE``):

    msda:{fp32,fp16,bf16,fp64}        the plain MSDA op: forward, backward, deterministic backward (kernel_cases)
    msda-fused:{fp32,fp16,bf16,fp64}  the fused MSDA op, reference points and boxes
    sdpa:{fp32,fp16,bf16}             deform_sdpa forward and backward
    nms:fp32                          greedy NMS with fixed-shape outputs (it computes in float32)
    control:{fp32,bf16}               no code of ours: a cuBLAS GEMM and an elementwise multiply (the tool's baseline)
    graph-train:{fp32,bf16}           a small DINO's training steps: eager, captured, replayed (detector_cases)
    graph-infer:{fp32,bf16}           a small DINO's graph inference: eager, captured, replayed

Each case prints one line per check (``check CASE | NAME | error | limit | ok``) and a summary line; the exit
status is 0 when every check passed, 1 otherwise. ``--poison`` fills every ``torch.empty``, ``torch.empty_like``
and ``Tensor.new_empty`` made from Python with NaN (FLA's trick, on the GPU too): an element a kernel never writes
then shows as NaN (allocations made while a CUDA graph is captured are left as they are: see
:func:`poisoned_allocations`). Leave it off under compute-sanitizer's initcheck, which must see the memory
uninitialised. ``--json PATH`` writes the checks. On a machine without CUDA, ``--device cpu`` with
``TRITON_INTERPRET=1`` runs the kernel cases in Triton's interpreter, and the detector cases run eagerly (no graph
is captured on a CPU: they check their references and bookkeeping only).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

KERNEL_KINDS = ("msda", "msda-fused", "sdpa", "nms", "control")
GRAPH_KINDS = ("graph-train", "graph-infer")
GRAPH_DTYPES = ("fp32", "bf16")


def case_dtypes() -> Dict[str, Tuple[str, ...]]:
    from .kernel_cases import CONTROL_DTYPES, MSDA_DTYPES, NMS_DTYPES, SDPA_DTYPES
    return {"msda": MSDA_DTYPES, "msda-fused": MSDA_DTYPES, "sdpa": SDPA_DTYPES, "nms": NMS_DTYPES,
            "graph-train": GRAPH_DTYPES, "graph-infer": GRAPH_DTYPES, "control": CONTROL_DTYPES}


def all_cases() -> Tuple[str, ...]:
    return tuple(f"{kind}:{dtype}" for kind, dtypes in case_dtypes().items() for dtype in dtypes)


def parse_case(spec: str) -> Tuple[str, str]:
    """``(kind, dtype)`` of ``KIND:DTYPE``; ValueError naming what is wrong."""
    kind, _, dtype = spec.partition(":")
    dtypes = case_dtypes()
    if kind not in dtypes:
        raise ValueError(f"case {spec!r}: the kind must be one of {', '.join(dtypes)}, got {kind!r}")
    if dtype not in dtypes[kind]:
        raise ValueError(f"case {spec!r}: {kind} runs in {', '.join(dtypes[kind])}, got {dtype!r}")
    return kind, dtype


def is_graph_case(spec: str) -> bool:
    return parse_case(spec)[0] in GRAPH_KINDS


@contextlib.contextmanager
def poisoned_allocations() -> Iterator[None]:
    """Inside the block, ``torch.empty``, ``torch.empty_like`` and ``Tensor.new_empty`` return floating tensors
    filled with NaN, except while a CUDA graph is being captured: there the fill would be a node of the graph, run at
    every replay, and would overwrite what the caller writes into a static buffer between replays (the training
    region's output gradients are allocated during its backward capture and filled before each replay)."""
    import torch
    real = (torch.empty, torch.empty_like, torch.Tensor.new_empty)

    def poison(tensor):
        if tensor.is_floating_point() and not (tensor.is_cuda and torch.cuda.is_current_stream_capturing()):
            tensor.fill_(float("nan"))
        return tensor

    torch.empty = lambda *args, **kwargs: poison(real[0](*args, **kwargs))
    torch.empty_like = lambda *args, **kwargs: poison(real[1](*args, **kwargs))
    torch.Tensor.new_empty = lambda self, *args, **kwargs: poison(real[2](self, *args, **kwargs))
    try:
        yield
    finally:
        torch.empty, torch.empty_like, torch.Tensor.new_empty = real


def run_case(spec: str, device, poison: bool = False, tiny: bool = False) -> list:
    """The checks of one case on ``device`` (a list of :class:`.kernel_cases.Check`); ``tiny``: the kernel cases'
    smallest shape only (for Triton's CPU interpreter)."""
    import torch

    import deform_plugin  # noqa: F401  (before mmdet: the mmcv-lite stand-in)
    kind, dtype = parse_case(spec)
    device = torch.device(device)
    with poisoned_allocations() if poison else contextlib.nullcontext():
        if kind in KERNEL_KINDS:
            from .kernel_cases import KERNEL_CASES
            return KERNEL_CASES[kind][0](dtype, device, tiny=tiny)
        from .detector_cases import graph_inference_checks, graph_training_checks
        return (graph_training_checks if kind == "graph-train" else graph_inference_checks)(dtype, device)


def build_parser(description: Optional[str] = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description or __doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cases", nargs="+", help="KIND:DTYPE cases (see above), or 'all'")
    parser.add_argument("--device", default="cuda", help="device (default: cuda)")
    parser.add_argument("--poison", action="store_true", help="fill torch.empty & co. with NaN (not under initcheck)")
    parser.add_argument("--tiny", action="store_true",
                        help="kernel cases at their smallest shape only (seconds in Triton's CPU interpreter)")
    parser.add_argument("--json", help="write the checks to this JSON file")
    return parser


def expand_cases(specs: Sequence[str]) -> List[str]:
    cases = list(all_cases()) if list(specs) == ["all"] else list(specs)
    for spec in cases:
        parse_case(spec)
    return cases


def main(argv: Optional[Sequence[str]] = None, description: Optional[str] = None) -> int:
    parser = build_parser(description)
    args = parser.parse_args(argv)
    try:
        cases = expand_cases(args.cases)
    except ValueError as error:
        parser.error(str(error))
    results: Dict[str, dict] = {}
    failed = 0
    for spec in cases:
        started = time.perf_counter()
        checks = run_case(spec, args.device, poison=args.poison, tiny=args.tiny)
        seconds = time.perf_counter() - started
        bad = [check for check in checks if not check.passed]
        failed += len(bad)
        for check in checks:
            print(f"check {spec} | {check.name} | {check.error:.3g} | {check.limit:.3g} | "
                  f"{'ok' if check.passed else 'FAILED'}", flush=True)
        print(f"case {spec}: {len(checks) - len(bad)}/{len(checks)} checks passed in {seconds:.1f} s", flush=True)
        results[spec] = dict(seconds=seconds, checks=[check.as_dict() for check in checks])
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(dict(poison=args.poison, device=args.device, cases=results), handle, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
