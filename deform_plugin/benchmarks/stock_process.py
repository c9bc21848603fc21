"""Processes that measure stock mmdet and mmcv: a benchmark module run where deform_plugin is never imported.

    python deform_plugin/benchmarks/stock_process.py MODULE [ARGS ...]

A stock row must see mmdet and mmcv as they are, but ``import deform_plugin.benchmarks.X`` runs
``deform_plugin/__init__.py`` first, and that installs deform_plugin into them (our MSDA at mmdet's construction
sites; with mmcv-lite, a stand-in for mmcv's compiled ops). Run by path, this file imports the standard library only:
it registers the ``deform_plugin`` package of this checkout without running its ``__init__``, so that
``deform_plugin.benchmarks`` and its modules import on their own, then runs MODULE (a ``deform_plugin.benchmarks``
module) as ``__main__`` with ARGS. :func:`stock_command` builds such a command line; :func:`plugin_imported` tells a
stock process whether anything has imported deform_plugin after all.
"""
from __future__ import annotations

import importlib.util
import runpy
import sys
from pathlib import Path
from typing import List, Sequence

PACKAGE = "deform_plugin"
BENCHMARKS = PACKAGE + ".benchmarks"
PACKAGE_DIR = Path(__file__).resolve().parents[1]


def stock_command(module: str) -> List[str]:
    """What follows the interpreter (``python`` or ``torch.distributed.run``'s options) to run ``module`` stock."""
    if not module.startswith(BENCHMARKS + "."):
        raise ValueError(f"a stock process runs a module of {BENCHMARKS}, not {module!r}")
    return [str(Path(__file__).resolve()), module]


def is_plugin_module(name: str) -> bool:
    """Whether importing module ``name`` imports deform_plugin itself: the package or any module of it but its
    benchmarks (a config's ``custom_imports`` entry, a name in ``sys.modules``)."""
    parts = name.split(".")
    return parts[0] == PACKAGE and parts[1:2] != ["benchmarks"]


def plugin_imported() -> bool:
    """Whether deform_plugin itself is imported in this process: any of its modules but its benchmarks (an ordinary
    ``import deform_plugin`` counts, as its ``__init__`` imports ``deform_plugin.ops`` and ``.integration``)."""
    return any(is_plugin_module(name) for name in list(sys.modules) if name != PACKAGE)


def register_package_without_init() -> None:
    """Make this checkout's ``deform_plugin`` the process's package, its ``__init__`` not run: its submodules import
    as usual, and a later ``import deform_plugin`` finds it already imported."""
    if PACKAGE in sys.modules:
        raise RuntimeError(f"{PACKAGE} is already imported: this process is not stock")
    spec = importlib.util.spec_from_file_location(PACKAGE, PACKAGE_DIR / "__init__.py",
                                                  submodule_search_locations=[str(PACKAGE_DIR)])
    sys.modules[PACKAGE] = importlib.util.module_from_spec(spec)


def main(argv: Sequence[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    module, args = argv[0], list(argv[1:])
    stock_command(module)  # refuses a module outside the benchmarks
    register_package_without_init()
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
