"""RMS-norm decoders' elementwise passes, one kernel each, over a step's `[T, d]` rows.

Unfused on a GPU, the residual add and the RMSNorm after it are an add (read two rows, write one), a cast to
float32 (read, write twice the bytes), torch's rms_norm (read and write float32), a multiply by the weight and
the cast back: about 30 d bytes per token in 16 bits and five kernels. `add_rms_norm` reads x and y once and
writes the sum and its normalised form: 8 d bytes, one kernel. `gated_rms_norm` does the delta-rule mixer's
`rmsnorm(o) * w * silu(z)` in one pass (read o, z, write the output) where the unfused one casts, normalises,
takes silu and multiplies in float32 passes; `silu_mul` the gated MLP's `silu(gate) * up` (read two, write one)
where the unfused one runs silu in place then the multiply (read three, write two); `gelu_tanh_mul` T5's gated
feed-forward `gelu_tanh(gate) * up` (Ankh) alike, by the same kernel (its ACTIVATION constexpr).

Rounding points are the unfused ones': the sum rounded to x's dtype before it is normalised (as the add stores
it); statistics and the normalisation in float32; for zero-centred norms (Qwen3.5) the scale (1 + w) applied in
float32 before the one cast, otherwise (Llama, Qwen3) the normalised value cast to the dtype, then multiplied by
w and rounded again (transformers' order); silu(gate) or gelu_tanh(gate) rounded to the dtype before the
product, as the unfused activation stores it.
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from .. import _cuda_math as cm
from .._launch import launch
from .._norm_tiles import residual_rows, rms_weighted
from ..launch_config import RmsNormKnobs


@triton.jit(do_not_specialize=["num_rows"])
def _add_rms_norm_kernel(
    x_ptr, y_ptr, w_ptr, sum_ptr, out_ptr, num_rows, stride_x, stride_y, stride_s, stride_o, eps,
    N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_ROWS: tl.constexpr, HAS_Y: tl.constexpr,
    ZERO_CENTRED: tl.constexpr,
):
    rows, cols, col_ok, ok, x = residual_rows(x_ptr, y_ptr, sum_ptr, num_rows, stride_x, stride_y, stride_s,
                                              N, BLOCK_N, BLOCK_ROWS, HAS_Y)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / N + eps)
    out = rms_weighted(x, rstd, w_ptr, cols, col_ok, ZERO_CENTRED, out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["num_rows"])
def _gated_rms_norm_kernel(
    o_ptr, z_ptr, w_ptr, out_ptr, num_rows, heads, stride_ot, stride_oh, stride_zt, stride_zh, eps,
    N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):
    # Row r is head r % heads of token r // heads: o and z may be views with any token and head strides.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ok = (rows < num_rows)[:, None] & col_ok[None, :]
    t, h = rows // heads, rows % heads
    o = tl.load(o_ptr + (t * stride_ot + h * stride_oh)[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + (t * stride_zt + h * stride_zh)[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(o * o, axis=1) / N + eps)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    out = o * rstd[:, None] * w[None, :] * (z / (1.0 + tl.exp(-z)))
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=ok)


# torch's constants for the tanh GELU (ActivationGeluKernel.cu): kBeta = M_SQRT2 * M_2_SQRTPI * 0.5 in double, then
# float32 (the float nearest sqrt(2 / pi)); kKappa the float nearest 0.044715.
GELU_BETA = tl.constexpr(float(np.float32(1.41421356237309504880 * 1.12837916709551257390 * 0.5)))
GELU_KAPPA = tl.constexpr(float(np.float32(0.044715)))


@triton.jit
def _gelu_tanh(x):
    """torch's float32 tanh GELU on a GPU: 0.5 x (1 + tanhf(kBeta (x + kKappa x^3))), x^3 as (x x) x and the inner
    sum one fma (nvcc contracts torch's `x + kKappa * x_cube`); tanh is _cuda_math's."""
    inner = GELU_BETA * tl.fma(GELU_KAPPA, x * x * x, x)
    return 0.5 * x * (1.0 + cm.tanh(inner))


@triton.jit(do_not_specialize=["num_rows"])
def _act_mul_kernel(
    g_ptr, u_ptr, out_ptr, num_rows, num_cols, stride_g, stride_u, stride_o,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, ACTIVATION: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    ok = (rows < num_rows)[:, None] & (cols < num_cols)[None, :]
    g = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=ok, other=0.0)
    u = tl.load(u_ptr + rows[:, None] * stride_u + cols[None, :], mask=ok, other=0.0)
    gf = g.to(tl.float32)
    if ACTIVATION == "gelu_tanh":
        act = _gelu_tanh(gf).to(g.dtype)   # rounded as the unfused gelu stores it
    else:
        act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)   # rounded as the in-place silu stores it
    out = act.to(tl.float32) * u.to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=ok)


def _rows_per_program(knobs: RmsNormKnobs, block_n: int) -> int:
    return max(1, min(knobs.max_rows, knobs.block_elements // block_n))


def add_rms_norm_triton(x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, eps: float, zero_centred: bool,
                        out_dtype: torch.dtype | None, knobs: RmsNormKnobs) -> tuple[torch.Tensor, torch.Tensor]:
    """op.add_rms_norm's Triton launch; arguments already checked."""
    T, d = x.shape
    sum_dtype = x.dtype if y is None else torch.promote_types(x.dtype, y.dtype)
    out = torch.empty(T, d, dtype=out_dtype or sum_dtype, device=x.device)
    s = x if y is None else torch.empty(T, d, dtype=sum_dtype, device=x.device)
    if T == 0:
        return s, out
    block_n = triton.next_power_of_2(d)
    block_rows = _rows_per_program(knobs, block_n)
    launch(_add_rms_norm_kernel, (triton.cdiv(T, block_rows),),
           x, x if y is None else y, weight, s, out, T, x.stride(0), x.stride(0) if y is None else y.stride(0),
           s.stride(0), out.stride(0), float(eps),
           N=d, BLOCK_N=block_n, BLOCK_ROWS=block_rows, HAS_Y=y is not None, ZERO_CENTRED=bool(zero_centred),
           num_warps=knobs.num_warps)
    return s, out


def gated_rms_norm_triton(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                          knobs: RmsNormKnobs) -> torch.Tensor:
    """op.gated_rms_norm's Triton launch; arguments already checked."""
    o3, z3 = (o, z) if o.dim() == 3 else (o[:, None], z[:, None])
    T, H, V = o3.shape
    out = torch.empty(o.shape, dtype=z.dtype, device=o.device)
    if T * H == 0:
        return out
    block_n = triton.next_power_of_2(V)
    block_rows = _rows_per_program(knobs, block_n)
    launch(_gated_rms_norm_kernel, (triton.cdiv(T * H, block_rows),),
           o3, z3, weight, out, T * H, H, o3.stride(0), o3.stride(1), z3.stride(0), z3.stride(1), float(eps),
           N=V, BLOCK_N=block_n, BLOCK_ROWS=block_rows, num_warps=knobs.num_warps)
    return out


def act_mul_triton(gate: torch.Tensor, up: torch.Tensor, activation: str, k: RmsNormKnobs) -> torch.Tensor:
    """op.silu_mul's and op.gelu_tanh_mul's Triton launch (ACTIVATION "silu" or "gelu_tanh"); arguments checked."""
    T, n = gate.shape
    out = torch.empty(T, n, dtype=gate.dtype, device=gate.device)
    if T * n == 0:
        return out
    launch(_act_mul_kernel, (triton.cdiv(T, k.silu_block_rows), triton.cdiv(n, k.silu_block_cols)),
           gate, up, out, T, n, gate.stride(0), up.stride(0), out.stride(0),
           BLOCK_ROWS=k.silu_block_rows, BLOCK_COLS=k.silu_block_cols, ACTIVATION=activation,
           num_warps=k.silu_num_warps)
    return out
