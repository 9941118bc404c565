"""Which implementation an op runs for given tensors.

CUDA tensors run the Triton kernels. CPU tensors run the Triton kernels through the interpreter when
TRITON_INTERPRET=1 is set (it must be set before triton is imported), and the plain torch reference
otherwise, so the engine works on any machine.
"""
import os

import torch


def use_triton(t: torch.Tensor) -> bool:
    """True when `t`'s op should run the Triton kernel rather than the torch reference."""
    if t.is_cuda:
        return True
    return os.environ.get("TRITON_INTERPRET") == "1"
