"""The residual add and the LayerNorm after it in one pass over a step's `[T, d]` rows.

Unfused, a pre-LayerNorm layer adds its sublayer's output to the residual stream (read two rows, write one)
and then normalises it (read it again, write the normalised row): 10 d bytes per token in 16 bits, two
kernels. Here a program reads both rows once and writes the sum and its normalised form: 8 d bytes, one
kernel. Statistics in float32 over the row as stored (the sum is rounded to the tensor's dtype first, as the
unfused add stores it), two passes over registers: mean, then the centred variance.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._launch import launch
from .._norm_tiles import residual_rows
from ..launch_config import NormKnobs


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


def add_layer_norm_triton(x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
                          eps: float, knobs: NormKnobs) -> tuple[torch.Tensor, torch.Tensor]:
    """op.add_layer_norm's Triton launch; arguments already checked."""
    T, d = x.shape
    out = torch.empty(T, d, dtype=x.dtype, device=x.device)
    s = x if y is None else torch.empty(T, d, dtype=x.dtype, device=x.device)
    if T == 0:
        return s, out
    block_n = triton.next_power_of_2(d)
    # Rows per program: about 4,096 elements a program, so narrow models do not launch a program per row.
    block_rows = max(1, min(16, 4096 // block_n))
    launch(_add_layer_norm_kernel, (triton.cdiv(T, block_rows),),
           x, x if y is None else y, weight, weight if bias is None else bias, s, out, T, x.stride(0),
           x.stride(0) if y is None else y.stride(0), s.stride(0), out.stride(0), float(eps),
           N=d, BLOCK_N=block_n, BLOCK_ROWS=block_rows, HAS_Y=y is not None, HAS_BIAS=bias is not None,
           num_warps=knobs.num_warps)
    return s, out
