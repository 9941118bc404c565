"""The public op `linear_gelu`: its checks, then the Triton matrix product (kernel.py, imported only on that path,
so a CPU-only install never imports triton) or the torch path."""
from __future__ import annotations

import torch

from .._device import kernels, knobs_for, use_triton
from ..launch_config import GemmKnobs
from .torch_path import linear_gelu_torch


def gemm_knobs(device: torch.device, **given) -> GemmKnobs:
    """The product's launch knobs for `device`: the launch table's row, with the knobs given (not None)."""
    return knobs_for(device, "gemm", **given)


def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                block_m: int | None = None, block_n: int | None = None, block_k: int | None = None,
                group_m: int | None = None, num_warps: int | None = None,
                num_stages: int | None = None) -> torch.Tensor:
    """gelu(x @ weight.T + bias) with the exact (erf) GELU, `[M, N]` in x's dtype.

    x `[M, K]` (any row stride, contiguous K), weight `[N, K]` (nn.Linear's layout, contiguous), bias `[N]` or
    None. Products accumulate in float32 (float32 inputs as true float32 products, for tests: the engine runs
    16-bit weights on a GPU); the bias and the GELU apply to the accumulator, rounded once at the store. Tensors on CPU run
    linear_gelu_torch unless TRITON_INTERPRET=1. Launch knobs (Triton only): block_m, block_n, block_k
    (powers of two, >= 16), group_m, num_warps, num_stages; None takes the launch table's row for the GPU.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or x.stride(1) != 1:
        raise ValueError(f"x must be [M, K] with contiguous K and weight [N, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if not use_triton(x):
        return linear_gelu_torch(x, weight, bias)
    kn = gemm_knobs(x.device, block_m=block_m, block_n=block_n, block_k=block_k, group_m=group_m,
                    num_warps=num_warps, num_stages=num_stages)
    return kernels("linear_gelu.kernel").linear_gelu_triton(x, weight, bias, kn)
