"""deform_plugin's benchmarks: the op benchmarks (:mod:`.ops`), the whole-detector benchmarks and profile
(:mod:`.detector`), the helpers they share (:mod:`.common`) and the stock processes (:mod:`.stock_process`).

The command lines are ``tools/bench_msda.py``, ``tools/bench_deform_sdpa.py``, ``tools/benchmark.py`` (fixed-size
synthetic batches), ``tools/benchmark_train.py`` (mmengine's Runner on the config's own pipeline),
``tools/profile_step.py`` and ``tools/ap_parity.py`` (stock and fast configs trained over seeds: their bbox AP).
Stock rows run modules of :mod:`.detector` in processes that import this package without deform_plugin's
``__init__`` (:mod:`.stock_process`): nothing here imports the rest of deform_plugin at module level.
"""
