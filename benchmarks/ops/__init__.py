"""Op benchmarks: :mod:`.reference_memory` (the CPU reference MSDA against mmcv's grid_sample path)."""
