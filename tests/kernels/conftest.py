"""Kernel tests run the Triton kernels on the GPU when there is one, else through the interpreter.

TRITON_INTERPRET=1 must be set before any module defining Triton kernels is imported (triton decides
compiled vs interpreted when a kernel is decorated); setting it here, at collection time, covers this
directory as long as nothing imported triton_kernels earlier in the session.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
