"""Backend choice: per-op tables, the process default and the environment variable."""
import pytest
import torch

from deform_plugin.ops import backend


@pytest.fixture
def default_from_environment(monkeypatch):
    """The process default as a fresh process would read it from DEFORM_PLUGIN_BACKEND."""
    def read(value):
        monkeypatch.setattr(backend, "_default_backend", backend._UNSET)
        if value is None:
            monkeypatch.delenv(backend.BACKEND_ENV, raising=False)
        else:
            monkeypatch.setenv(backend.BACKEND_ENV, value)
        return backend.get_default_backend()
    yield read


def test_environment_variable_sets_the_default(default_from_environment):
    assert default_from_environment("pytorch") == "pytorch"
    assert default_from_environment(None) == "auto"


@pytest.mark.parametrize("empty", ["", "  "], ids=["empty", "blank"])
def test_empty_environment_variable_means_unset(default_from_environment, empty):
    assert default_from_environment(empty) == "auto"


def test_bad_environment_variable_is_named_in_the_error(default_from_environment):
    with pytest.raises(ValueError, match=r"environment variable DEFORM_PLUGIN_BACKEND = 'garbage' is not a backend"):
        default_from_environment("garbage")


def test_each_op_lists_only_its_own_backends():
    import deform_plugin  # noqa: F401  (the integration registers MSDA's 'mmcv' backend where mmcv is present)
    assert backend.backend_names("deform_sdpa") == ("auto", "triton", "pytorch")
    assert backend.backend_names("msda")[:3] == ("auto", "triton", "pytorch")
    with pytest.raises(ValueError, match="deform_sdpa has no backend 'mmcv'"):
        backend.resolve_backend("deform_sdpa", "mmcv", torch.device("cpu"))


def test_a_default_an_op_does_not_offer_counts_as_auto(monkeypatch):
    import deform_plugin  # noqa: F401
    monkeypatch.setattr(backend, "_default_backend", "mmcv")
    assert backend.resolve_backend("deform_sdpa", None, torch.device("cpu")) == "pytorch"


def test_builtin_names_cannot_be_registered():
    with pytest.raises(ValueError, match="built in"):
        backend.register_backend("msda", "triton", lambda *a: None, lambda device: None)


def test_triton_warm_up_runs_on_a_thread_and_fills_the_caches_the_first_call_reads(monkeypatch):
    from deform_plugin.ops.msda import functional, prepare_triton_in_background

    monkeypatch.setattr(functional.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(functional, "triton_interpreter_enabled", lambda: False)
    monkeypatch.setattr(functional, "triton_unavailable_reason", lambda device: None)
    monkeypatch.setattr(functional, "_triton_op_module", None)
    monkeypatch.setattr(functional, "_warm_up_thread", None)
    from triton.runtime.cache import triton_key
    triton_key.cache_clear()
    thread = prepare_triton_in_background()
    assert thread is not None and thread.daemon and thread.name == "deform_plugin-triton-warm-up"
    thread.join(timeout=120)
    assert not thread.is_alive()
    assert triton_key.cache_info().currsize == 1  # Triton's cache key: computed, kept for the first launch
    assert functional._triton_op_module is not None  # the custom ops: registered
    assert prepare_triton_in_background() is thread  # once per process


def test_triton_warm_up_starts_nothing_without_cuda_and_swallows_its_own_errors(monkeypatch):
    from deform_plugin.ops.msda import functional, prepare_triton_in_background

    monkeypatch.setattr(functional, "_warm_up_thread", None)
    monkeypatch.setattr(functional.torch.cuda, "is_available", lambda: False)
    assert prepare_triton_in_background() is None
    monkeypatch.setattr(functional.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(functional, "triton_interpreter_enabled", lambda: False)
    monkeypatch.setattr(functional, "triton_unavailable_reason", lambda device: None)

    def broken():
        raise RuntimeError("no cache dir")

    monkeypatch.setattr(functional, "warm_up_triton", broken)
    errors = []
    monkeypatch.setattr(functional.threading, "excepthook", lambda args: errors.append(args))
    thread = prepare_triton_in_background()
    thread.join(timeout=60)
    assert errors == []  # a warm-up that fails leaves the work (and the error) to the first call


def test_first_call_warm_up_follows_the_backend_a_module_asks_for(monkeypatch):
    from deform_plugin.ops.msda import functional, prepare_first_call_in_background

    started = []
    monkeypatch.setattr(functional, "prepare_triton_in_background", lambda: started.append(1) or "thread")
    assert prepare_first_call_in_background("pytorch") is None
    assert prepare_first_call_in_background("mmcv") is None
    assert started == []
    assert prepare_first_call_in_background("triton") == "thread"
    assert prepare_first_call_in_background("auto") == "thread"
    with backend.default_backend("pytorch"):
        assert prepare_first_call_in_background(None) is None
    with backend.default_backend("auto"):
        assert prepare_first_call_in_background(None) == "thread"
    assert len(started) == 3


def test_building_the_module_asks_for_the_first_call_warm_up_of_its_backend(monkeypatch):
    import deform_plugin  # noqa: F401
    from deform_plugin.models import msda as msda_module

    requested = []
    monkeypatch.setattr(msda_module, "prepare_first_call_in_background", lambda name: requested.append(name))
    msda_module.MultiScaleDeformableAttention(embed_dims=32, num_heads=2, num_levels=2, num_points=2)
    msda_module.MultiScaleDeformableAttention(embed_dims=32, num_heads=2, num_levels=2, num_points=2,
                                              backend="pytorch")
    assert requested == [None, "pytorch"]
