"""deform_plugin.benchmarks.stock_process: benchmark modules in a process where deform_plugin itself stays out."""
import subprocess
import sys
from pathlib import Path

import pytest

from deform_plugin.benchmarks import stock_process

REPO_ROOT = Path(__file__).resolve().parents[2]

# Imports, in a stock process, every module a stock row runs; then reports whether deform_plugin itself came in, and
# again after an ordinary import of one of its modules.
STOCK_IMPORTS = """
import runpy, sys
launcher = runpy.run_path(sys.argv[1])
launcher["register_package_without_init"]()
import deform_plugin.benchmarks.detector.iteration_timer, deform_plugin.benchmarks.detector.run
import deform_plugin.benchmarks.detector.step_profiler, deform_plugin.benchmarks.detector.stock_train
print(launcher["plugin_imported"]())
import deform_plugin.ops
print(launcher["plugin_imported"]())
"""


def test_a_stock_process_imports_the_benchmarks_without_deform_plugin():
    result = subprocess.run([sys.executable, "-c", STOCK_IMPORTS, stock_process.__file__], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["False", "True"]


def test_plugin_modules_are_the_package_and_all_of_it_but_the_benchmarks():
    assert stock_process.is_plugin_module("deform_plugin")
    assert stock_process.is_plugin_module("deform_plugin.engine")
    assert not stock_process.is_plugin_module("deform_plugin.benchmarks.detector.iteration_timer")
    assert not stock_process.is_plugin_module("mmdet.models")
    assert not stock_process.is_plugin_module("deform_plugin_cache")


def test_the_stock_command_runs_a_benchmarks_module_through_this_file():
    module = "deform_plugin.benchmarks.detector.stock_train"
    assert stock_process.stock_command(module) == [str(Path(stock_process.__file__).resolve()), module]
    with pytest.raises(ValueError, match="not 'deform_plugin.engine'"):
        stock_process.stock_command("deform_plugin.engine")
