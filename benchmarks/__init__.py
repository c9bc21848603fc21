"""deform_plugin's benchmarks: the op benchmarks (:mod:`benchmarks.ops`), the whole-detector benchmarks and profile
(:mod:`benchmarks.detector`) and the helpers they share (:mod:`benchmarks.common`).

The command lines are ``tools/bench_msda.py``, ``tools/bench_deform_sdpa.py``, ``tools/benchmark.py`` (fixed-size
synthetic batches), ``tools/benchmark_train.py`` (mmengine's Runner on the config's own pipeline) and
``tools/profile_step.py``. Nothing under :mod:`benchmarks.detector` imports deform_plugin at module level: its stock
rows run in processes that must never import it.
"""
