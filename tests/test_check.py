"""``python -m deform_plugin check``: the report of this environment, and an error with exit status 1 for each missing
or unsupported requirement."""
from __future__ import annotations

import pytest
import torch

from deform_plugin import check
from deform_plugin.__main__ import main
from deform_plugin.integration.mmcv_lite import compiled_mmcv_ops_available
from deform_plugin.ops import backend


def _lines(text: str) -> dict:
    return {line.split("  ", 1)[0]: line.split("  ", 1)[1].strip() for line in text.splitlines() if "  " in line}


def test_check_reports_this_environment(capsys):
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    lines = _lines(out)
    assert lines["torch"].startswith(torch.__version__)
    assert ("stand-in serves MSDA" in lines["mmcv"]) != compiled_mmcv_ops_available()
    expected = "triton" if torch.cuda.is_available() else "pytorch"
    assert f"with {expected!r}" in lines["backend"]
    if torch.cuda.is_available():
        assert lines["GPU"].startswith(torch.cuda.get_device_name(0))
    else:
        assert lines["GPU"].startswith("none")
    assert out.rstrip().splitlines()[-1].startswith("ready:")


def test_a_missing_requirement_is_named_with_its_install_line_and_exits_1(monkeypatch, capsys):
    real = check.distribution_version
    monkeypatch.setattr(check, "distribution_version",
                        lambda *names: None if "mmdet" in names else real(*names))
    assert check.run_check() == 1
    captured = capsys.readouterr()
    assert _lines(captured.out)["mmdet"] == "not installed"
    assert "error: mmdet is not installed: pip install --no-deps mmdet==3.3.0" in captured.err
    assert "ready:" not in captured.out


def test_a_bad_backend_variable_is_reported(monkeypatch, capsys):
    monkeypatch.setattr(backend, "_default_backend", backend._UNSET)  # read the variable again
    monkeypatch.setenv(backend.BACKEND_ENV, "cuda-fast")
    assert check.run_check() == 1
    err = capsys.readouterr().err
    assert f"error: environment variable {backend.BACKEND_ENV} = 'cuda-fast' is not a backend" in err


@pytest.mark.parametrize("name, version, problem", [
    ("mmcv", "2.0.0rc4", None),
    ("mmcv", "2.1.0", None),
    ("mmcv", "2.2.0", "mmcv 2.2.0 is too new: deform_plugin supports mmcv < 2.2.0"),
    ("torch", "2.13.0+cpu", None),
    ("torch", "2.0.1", "torch 2.0.1 is too old: deform_plugin needs torch >= 2.1"),
    ("mmdet", "3.4.0", "mmdet 3.4.0 is too new: deform_plugin supports mmdet < 3.4"),
    ("mmengine", "0.9.1", "mmengine 0.9.1 is too old: deform_plugin needs mmengine >= 0.10"),
])
def test_versions_outside_the_supported_range_are_named(name, version, problem):
    assert check.range_problem(name, version) == problem


def test_no_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2 and "COMMAND" in capsys.readouterr().err
