"""deform_plugin's benchmarks: an importable package that the thin scripts in tools/ run."""
