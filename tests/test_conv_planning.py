"""deform_plugin.conv_planning: cuDNN's v7 convolution API selected unless the user chose."""
import os

import pytest

from deform_plugin.conv_planning import CUDNN_V8_API_DISABLED, prefer_cudnn_v7_api, selected_api_line


def test_the_v7_api_is_selected_where_the_variable_is_unset(monkeypatch):
    monkeypatch.delenv(CUDNN_V8_API_DISABLED, raising=False)
    assert prefer_cudnn_v7_api() is True
    assert os.environ[CUDNN_V8_API_DISABLED] == "1"


@pytest.mark.parametrize("value, v7", [("0", False), ("1", True), ("ON", True), ("false", False)])
def test_a_value_the_user_set_is_kept(monkeypatch, value, v7):
    monkeypatch.setenv(CUDNN_V8_API_DISABLED, value)
    assert prefer_cudnn_v7_api() is v7
    assert os.environ[CUDNN_V8_API_DISABLED] == value


@pytest.mark.parametrize("value, line", [
    (None, "cuDNN's v8 convolution API (PyTorch's default)"),
    ("1", "cuDNN's v7 convolution API (TORCH_CUDNN_V8_API_DISABLED='1'; read at the process's first convolution)"),
    ("0", "cuDNN's v8 convolution API (TORCH_CUDNN_V8_API_DISABLED='0'; read at the process's first convolution)"),
])
def test_the_log_line_names_the_api_and_who_chose_it(monkeypatch, value, line):
    monkeypatch.setenv(CUDNN_V8_API_DISABLED, "")
    if value is None:
        monkeypatch.delenv(CUDNN_V8_API_DISABLED)
    else:
        monkeypatch.setenv(CUDNN_V8_API_DISABLED, value)
    assert selected_api_line() == line
