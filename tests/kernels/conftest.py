"""Kernel tests: on a machine without CUDA the Triton kernels run in the interpreter.

TRITON_INTERPRET must be set before any ``triton.jit`` decorator runs, hence here, at collection.
GPU tests carry ``@pytest.mark.gpu`` and skip themselves when CUDA is absent.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
