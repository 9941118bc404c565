"""The per-head RMS norm of queries or keys and their rotary embedding, in place, in one pass.

An unfused RMS-norm decoder normalises each query and key head (Qwen3.5: zero-centred, (1 + w); Qwen3: Llama's
order, cast then * w) in a float32 copy, casts it back, then rotates it (pipeline/models/layers/rotary.py
Rotary.apply: a product with cos, two half-updates, the cast back; with a partial rotation a copy of the rest):
some ten passes over the tensor, each a kernel, plus two dtype conversions. Here a program takes a tile of
(token, head) rows of the projection's output, loads each row once as three tiles (the two rotary halves and the
channels past the rotation), normalises it, rotates the halves and stores it back: 4 bytes an element in 16
bits, one launch (`norm_rotate_qk_`: one for a layer's queries and keys together, the programs split between
them, each with its own base, strides and weight). The tensor may be a view with any token and head strides
(Qwen3.5's queries sit between their gates, a head stride of 2 head_dim), so nothing is copied out of the
projection.

Rounding points are the unfused layer's (pipeline/models/layers/norms.py RMSNorm, then Rotary.apply): mean square
and normalisation in float32; zero_centred: times (1 + w) in float32, one cast; else cast, then times w and
rounded again. The rotation of those stored values: with float32_math (ESM's rotaries) in float32, rounded once;
without (Llama's, Qwen's: the model dtype's ops) each product rounded to the dtype, then their sum rounded, as
`rot * cos`, `x2 * sin` and the in-place `sub_` / `add_` store them. Each thread loads and stores the same
elements, so the in-place update needs no barrier.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .._launch import launch
from .._norm_tiles import rms_weighted
from ..launch_config import RotaryKnobs


@triton.jit
def _rounded(x, like):
    """x rounded to like's dtype, back in float32 (where a 16-bit torch op stores its result)."""
    return x.to(like.dtype).to(tl.float32)


# Not specialised: the token-dependent counts, and the head counts (a 1 would become a constant in one branch of
# the choice below and an integer in the other).
@triton.jit(do_not_specialize=["num_rows", "num_heads", "num_rows2", "num_heads2", "programs"])
def _norm_rotate_kernel(
    x_ptr, cos_ptr, sin_ptr, w_ptr, num_rows, num_heads, stride_t, stride_h, stride_cos, stride_sin, eps,
    x2_ptr, w2_ptr, num_rows2, num_heads2, stride2_t, stride2_h, programs,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, REST: tl.constexpr,
    BLOCK_REST: tl.constexpr, HAS_WEIGHT: tl.constexpr, ZERO_CENTRED: tl.constexpr, FLOAT32_MATH: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    """Rows r = token * num_heads + head; columns i < HALF of a head's first rotary half, paired with i + HALF;
    REST channels past the rotation (normalised, not rotated; untouched without a weight). The first `programs`
    programs take x (with w), the rest the second tensor x2 (with w2: a layer's keys beside its queries); with
    num_rows2 = 0 there are no others."""
    pid = tl.program_id(0)
    if pid >= programs:   # the second tensor: its own base, rows, heads, strides and weight
        pid -= programs
        x_ptr, w_ptr, num_rows, num_heads = x2_ptr, w2_ptr, num_rows2, num_heads2
        stride_t, stride_h = stride2_t, stride2_h
    rows = pid.to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < num_rows
    token = rows // num_heads
    head = rows % num_heads
    row = x_ptr + (token * stride_t + head * stride_h)[:, None]
    cols = tl.arange(0, BLOCK_HALF)
    col_ok = cols < HALF
    ok = row_ok[:, None] & col_ok[None, :]
    x1 = tl.load(row + cols[None, :], mask=ok, other=0.0)
    x2 = tl.load(row + HALF + cols[None, :], mask=ok, other=0.0)
    if HAS_WEIGHT:
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        squares = tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)
        if REST > 0:
            rest = tl.arange(0, BLOCK_REST)
            rest_ok = row_ok[:, None] & (rest < REST)[None, :]
            xr = tl.load(row + 2 * HALF + rest[None, :], mask=rest_ok, other=0.0)
            r = xr.to(tl.float32)
            squares += tl.sum(r * r, axis=1)
            rstd = 1.0 / tl.sqrt(squares / HEAD_DIM + eps)
            tl.store(row + 2 * HALF + rest[None, :], rms_weighted(xr, rstd, w_ptr, 2 * HALF + rest, rest < REST,
                                                               ZERO_CENTRED, xr.dtype), mask=rest_ok)
        else:
            rstd = 1.0 / tl.sqrt(squares / HEAD_DIM + eps)
        x1 = rms_weighted(x1, rstd, w_ptr, cols, col_ok, ZERO_CENTRED, x1.dtype)
        x2 = rms_weighted(x2, rstd, w_ptr, HALF + cols, col_ok, ZERO_CENTRED, x2.dtype)
    # cos and sin repeat their first half (the frequencies concatenated twice): one load serves both halves.
    c = tl.load(cos_ptr + token[:, None] * stride_cos + cols[None, :], mask=ok, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + token[:, None] * stride_sin + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    if FLOAT32_MATH:
        o1 = a * c - b * s
        o2 = b * c + a * s
    else:   # rot * cos, x2 * sin and x1 * sin stored in the dtype, then the sub_ / add_ stored again
        o1 = _rounded(a * c, x1) - _rounded(b * s, x1)
        o2 = _rounded(b * c, x2) + _rounded(a * s, x2)
    tl.store(row + cols[None, :], o1.to(x1.dtype), mask=ok)
    tl.store(row + HALF + cols[None, :], o2.to(x2.dtype), mask=ok)


def norm_rotate_triton(x, weight, x2, weight2, cos, sin, eps, zero_centred, head_dim, float32_math, block_rows,
                       knobs: RotaryKnobs) -> None:
    """op.norm_rotate_'s and op.norm_rotate_qk_'s Triton launch over x's (token, head) rows, then x2's (None: none);
    arguments already checked."""
    T, H, _ = x.shape
    H2 = 0 if x2 is None else x2.shape[1]
    if T * (H + H2) == 0:
        return
    rd = cos.shape[-1]
    cos, sin = cos.reshape(T, rd), sin.reshape(T, rd)
    half, rest = rd // 2, head_dim - rd
    block_half, block_rest = triton.next_power_of_2(half), triton.next_power_of_2(max(rest, 1))
    if block_rows is None:
        fit = max(1, knobs.norm_block_elements // (2 * block_half + (block_rest if rest else 0)))
        block_rows = 1 << (fit.bit_length() - 1)
    programs = triton.cdiv(T * H, block_rows)
    x2 = x if x2 is None else x2
    w, w2 = (x, x2) if weight is None else (weight, weight2 if weight2 is not None else weight)
    launch(_norm_rotate_kernel, (programs + triton.cdiv(T * H2, block_rows),),
           x, cos, sin, w, T * H, H, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), float(eps),
           x2, w2, T * H2, max(H2, 1), x2.stride(0), x2.stride(1), programs,
           HEAD_DIM=head_dim, HALF=half, BLOCK_HALF=block_half, REST=rest, BLOCK_REST=block_rest,
           HAS_WEIGHT=weight is not None, ZERO_CENTRED=bool(zero_centred), FLOAT32_MATH=bool(float32_math),
           BLOCK_ROWS=block_rows, num_warps=knobs.norm_num_warps)
