"""Run a patch on a module of another package right after it is imported (or at once, if it already is).

Importing deform_plugin must not import mmdet by itself, yet some of mmdet's modules need a patch before anyone
uses them: a meta-path finder wraps the loader of each target module so that the patch runs as soon as the
module's own code has executed.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
from typing import Callable, Dict

_finder = None


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """A meta-path finder that runs a patch function right after a target module executes."""

    def __init__(self):
        self.patches: Dict[str, Callable] = {}
        self._busy = threading.local()

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.patches or getattr(self._busy, "active", False):
            return None
        self._busy.active = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.active = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        original_exec = spec.loader.exec_module
        patch = self.patches[fullname]

        def exec_then_patch(module):
            original_exec(module)
            patch(module)

        spec.loader.exec_module = exec_then_patch
        return spec


def patch_when_imported(module_name: str, patch: Callable) -> None:
    """Call ``patch(module)`` now if ``module_name`` is imported, else right after its import."""
    global _finder
    if module_name in sys.modules:
        patch(sys.modules[module_name])
        return
    if _finder is None:
        _finder = _PatchAfterImport()
        sys.meta_path.insert(0, _finder)
    _finder.patches[module_name] = patch
