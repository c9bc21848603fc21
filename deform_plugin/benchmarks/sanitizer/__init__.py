"""GPU-code checks under NVIDIA's compute-sanitizer: a target program (:mod:`.targets`: every Triton kernel at small
odd sizes in each dtype, one captured training step, one graph inference; :mod:`.kernel_cases`,
:mod:`.detector_cases`), the reading of the sanitizer's reports (:mod:`.reports`) and the runner that runs each
target under each tool and writes the table (:mod:`.run`; the command line is ``tools/sanitize_kernels.py``).
"""
