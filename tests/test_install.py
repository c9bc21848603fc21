"""deform_plugin installs into an environment that already has torch, mmcv and mmdet, offline, and reports itself.

A fresh virtualenv sees the running interpreter's packages (mmdet and the rest); pip installs a copy of this
repository into it with no dependencies and no index, as the README's "existing environment" path does; then
``python -m deform_plugin check`` runs from a folder outside the clone.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import site
import subprocess
import venv
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# Build outputs and local state that a fresh clone does not have.
NOT_IN_A_CLONE = (".git", ".venv", ".whl", ".cache", ".pytest_cache", "__pycache__", "*.egg-info", "build", "dist",
                  "work_dirs", "bench_results")


def _run(command, cwd, env):
    return subprocess.run([str(part) for part in command], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.skipif(importlib.util.find_spec("pip") is None, reason="pip is not installed in this environment")
@pytest.mark.skipif(importlib.util.find_spec("setuptools") is None,
                    reason="setuptools (the build backend) is not installed in this environment")
def test_a_copy_of_the_clone_installs_offline_and_the_check_reports_it(tmp_path):
    source = tmp_path / "clone"
    shutil.copytree(REPO_ROOT, source, ignore=shutil.ignore_patterns(*NOT_IN_A_CLONE))
    environment = tmp_path / "env"
    # --without-pip: the running environment's pip serves (no ensurepip, no download).
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(environment)
    python = environment / "bin" / "python"
    new_site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path,
                         os.environ).stdout.strip())
    # The running interpreter may itself be a virtualenv (make's .venv): its packages come after the new ones.
    (new_site / "running_environment.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")

    install = _run([python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", source],
                   tmp_path, env)
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-3000:]

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    check = _run([python, "-m", "deform_plugin", "check"], elsewhere, env)
    assert check.returncode == 0, check.stdout + check.stderr
    from deform_plugin import __version__
    first_line = check.stdout.splitlines()[0]
    assert first_line.startswith(f"deform_plugin  {__version__} (installed, ")
    assert first_line.endswith(f"{new_site / 'deform_plugin'})")  # the installed copy, not the clone
    assert "mmdet.models imports" in check.stdout and check.stdout.rstrip().splitlines()[-1].startswith("ready:")
    script = environment / "bin" / "deform-plugin"
    assert "deform_plugin.__main__" in script.read_text() and os.access(script, os.X_OK)
