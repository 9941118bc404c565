"""The residual add and the LayerNorm after it in one pass over a step's `[T, d]` rows.

Unfused, a pre-LayerNorm layer adds its sublayer's output to the residual stream (read two rows, write one)
and then normalises it (read it again, write the normalised row): 10 d bytes per token in 16 bits, two
kernels. Here a program reads both rows once and writes the sum and its normalised form: 8 d bytes, one
kernel. Statistics in float32 over the row as stored (the sum is rounded to the tensor's dtype first, as the
unfused add stores it), two passes over registers: mean, then the centred variance.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from .._device import target_of, use_triton
from .._launch import launch
from .._norm_tiles import residual_rows
from ..launch_config import NormKnobs, launch_row
from .torch_path import add_layer_norm_torch


@triton.jit(do_not_specialize=["num_rows"])
def _add_layer_norm_kernel(
    x_ptr, y_ptr, w_ptr, b_ptr, sum_ptr, out_ptr, num_rows, stride_x, stride_y, stride_s, stride_o, eps,
    N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_ROWS: tl.constexpr, HAS_Y: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    rows, cols, col_ok, ok, x = residual_rows(x_ptr, y_ptr, sum_ptr, num_rows, stride_x, stride_y, stride_s,
                                              N, BLOCK_N, BLOCK_ROWS, HAS_Y)
    xf = x.to(tl.float32)
    mean = tl.sum(xf, axis=1) / N
    centred = tl.where(col_ok[None, :], xf - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / N + eps)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    out = centred * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        out += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=ok)


def norm_knobs(device: torch.device, **given: int | None) -> NormKnobs:
    """The kernel's launch knobs for `device`: the launch table's row, with the knobs given (not None)."""
    row = launch_row(target_of(device)).norm
    return replace(row, **{name: value for name, value in given.items() if value is not None})


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
    T, d = x.shape
    out = torch.empty(T, d, dtype=x.dtype, device=x.device)
    s = x if y is None else torch.empty(T, d, dtype=x.dtype, device=x.device)
    if T == 0:
        return s, out
    knobs = norm_knobs(x.device, num_warps=num_warps)
    block_n = triton.next_power_of_2(d)
    # Rows per program: about 4,096 elements a program, so narrow models do not launch a program per row.
    block_rows = max(1, min(16, 4096 // block_n))
    launch(_add_layer_norm_kernel, (triton.cdiv(T, block_rows),),
           x, x if y is None else y, weight, weight if bias is None else bias, s, out, T, x.stride(0),
           x.stride(0) if y is None else y.stride(0), s.stride(0), out.stride(0), float(eps),
           N=d, BLOCK_N=block_n, BLOCK_ROWS=block_rows, HAS_Y=y is not None, HAS_BIAS=bias is not None,
           num_warps=knobs.num_warps)
    return s, out
