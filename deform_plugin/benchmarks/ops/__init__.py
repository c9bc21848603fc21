"""Op benchmarks: :mod:`.msda` (with the floors of :mod:`.floors`) and :mod:`.deform_sdpa`. They need a CUDA device
(``bench_deform_sdpa --smoke-cpu`` checks the tool itself under the Triton interpreter)."""
