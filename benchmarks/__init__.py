"""deform_plugin's benchmarks (op benchmarks under :mod:`benchmarks.ops`)."""
