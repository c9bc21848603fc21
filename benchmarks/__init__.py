"""deform_plugin's benchmarks: the op benchmarks (:mod:`benchmarks.ops`), the whole-detector benchmark and profile
(:mod:`benchmarks.detector`) and the helpers they share (:mod:`benchmarks.common`).

The command lines are ``tools/bench_msda.py``, ``tools/bench_deform_sdpa.py``, ``tools/benchmark.py`` and
``tools/profile_step.py``. Nothing under :mod:`benchmarks.detector` imports deform_plugin at module level: its stock
rows run in processes that must never import it.
"""
