"""The graph cache's capture decisions: captured once a signature recurs, never recaptured, capped."""
import pytest
import torch

from deform_plugin.cuda_graphs import CapturePolicy, GraphCache


def _run(cache, keys, kind="fp32"):
    """Feed calls of ``keys``; capture (a dummy entry) wherever the cache says so. The sequence of decisions."""
    decisions = []
    for key in keys:
        if key in cache.entries:
            cache.replays += 1
            decisions.append("replay")
        elif cache.earns_capture(key, kind):
            assert cache.capture(key, lambda: object(), torch.device("cpu")) is not None
            decisions.append("capture")
        else:
            cache.note_eager_call(key)
            decisions.append("eager")
    return decisions


def test_a_signature_is_captured_at_its_second_call_by_default():
    cache = GraphCache("test")
    assert _run(cache, ["a", "b", "a", "a", "b", "c"]) == ["eager", "eager", "capture", "replay", "capture", "eager"]
    assert cache.stats()["graphs"] == 2 and cache.first_call_captures == 0


def test_sizes_seen_once_are_never_captured():
    cache = GraphCache("test")
    assert _run(cache, [f"size{i}" for i in range(20)]) == ["eager"] * 20
    assert not cache.entries and cache.capture_seconds == 0


def test_capture_after_one_captures_new_shapes_of_a_warmed_up_kind_at_their_first_call():
    cache = GraphCache("test", CapturePolicy(capture_after=1))
    assert _run(cache, ["a", "a", "b"]) == ["eager", "capture", "capture"]
    assert _run(cache, ["c"], kind="bf16") == ["eager"]  # a new kind warms up first
    assert cache.first_call_captures == 1  # "b": it never ran eagerly


def test_past_max_graphs_new_signatures_run_eagerly_and_nothing_is_recaptured():
    cache = GraphCache("test", CapturePolicy(max_graphs=2))
    calls = ["a", "b", "c", "d"] * 4  # a working set larger than the cap, alternating
    decisions = _run(cache, calls)
    assert decisions.count("capture") == 2 and set(cache.entries) == {"a", "b"}
    assert decisions[-4:] == ["replay", "replay", "eager", "eager"]
    assert "max_graphs" in cache.eager_reasons["c"] and cache.capped


def test_past_the_memory_cap_new_signatures_run_eagerly(monkeypatch):
    cache = GraphCache("test", CapturePolicy(max_graph_memory_mb=3))
    reserved = iter(range(0, 100 << 20, 2 << 20))  # each capture adds 2 MiB to the reserved memory
    monkeypatch.setattr(GraphCache, "_reserved", staticmethod(lambda device: next(reserved)))
    decisions = _run(cache, ["a", "a", "b", "b", "c", "c"])
    assert decisions == ["eager", "capture", "eager", "capture", "eager", "eager"]
    assert cache.stats()["graph_memory_mb"] == 4 and "max_graph_memory_mb=3" in cache.capped


def test_a_failed_capture_after_a_warm_up_falls_back_for_good_with_the_reason():
    cache = GraphCache("test")

    def fails():
        raise RuntimeError("operation not permitted when stream is capturing\nmore lines")
    cache.earns_capture("a")
    assert cache.earns_capture("a")
    cache.note_eager_call("a")
    assert cache.capture("a", fails, torch.device("cpu")) is None
    assert cache.eager_reasons["a"] == "its capture failed (operation not permitted when stream is capturing)"
    assert not cache.earns_capture("a")


def test_a_failed_capture_of_a_signature_that_never_ran_is_tried_again_after_an_eager_call():
    cache = GraphCache("test", CapturePolicy(capture_after=1))
    attempts = []

    def build():
        attempts.append(1)
        if len(attempts) == 1:
            raise ValueError("a plan needs a run first")
        return "graph"
    cache.earns_capture("warm-up")
    assert cache.earns_capture("a")
    assert cache.capture("a", build, torch.device("cpu")) is None and not cache.eager_reasons
    cache.note_eager_call("a")
    assert cache.earns_capture("a") and cache.capture("a", build, torch.device("cpu")) == "graph"


def test_asking_again_for_a_captured_signature_is_an_error():
    cache = GraphCache("test")
    cache.earns_capture("a")
    cache.earns_capture("a")
    cache.capture("a", lambda: "graph", torch.device("cpu"))
    with pytest.raises(RuntimeError, match="has a graph already"):
        cache.earns_capture("a")
