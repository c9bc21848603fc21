"""Test-session setup shared by every test file.

Without a CUDA device the Triton kernels can only run in Triton's interpreter, which is chosen when the kernels are
decorated: TRITON_INTERPRET must be set before anything imports triton, so it is set here, first.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
