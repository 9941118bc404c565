"""The public op `add_layer_norm`: its checks, then the Triton kernel (kernel.py, imported only on that path,
so a CPU-only install never imports triton) or the torch path."""
from __future__ import annotations

import torch

from .._device import kernels, knobs_for, use_triton
from ..launch_config import NormKnobs
from .torch_path import add_layer_norm_torch


def norm_knobs(device: torch.device, **given: int | None) -> NormKnobs:
    """The kernel's launch knobs for `device`: the launch table's row, with the knobs given (not None)."""
    return knobs_for(device, "norm", **given)


def add_layer_norm(x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
                   eps: float, *, num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, LayerNorm(s)) with s = x + y (or x alone when y is None), both new `[T, d]` tensors in x's dtype.

    x, y `[T, d]` (any row stride, contiguous channels); weight, bias `[d]` (bias may be None). The sum is
    rounded to x's dtype before it is normalised, as an unfused add stores it; mean and variance in float32.
    Tensors on CPU run add_layer_norm_torch unless TRITON_INTERPRET=1. Launch knob (Triton only): num_warps
    (None: the launch table's row for the tensors' GPU)."""
    if x.dim() != 2 or x.stride(1) != 1 or (y is not None and (y.shape != x.shape or y.stride(1) != 1)):
        raise ValueError(f"x and y must be [T, d] with contiguous channels, got {tuple(x.shape)} and "
                         f"{None if y is None else tuple(y.shape)}")
    if not use_triton(x):
        return add_layer_norm_torch(x, y, weight, bias, eps)
    knobs = norm_knobs(x.device, num_warps=num_warps)
    return kernels("layer_norm.kernel").add_layer_norm_triton(x, y, weight, bias, eps, knobs)
