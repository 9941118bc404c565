"""Rotate a fused QKV projection's queries and keys in place, and scale the queries, in one pass.

An unfused layer reads and writes its queries and keys about seven times for this (the scale, a float32 copy,
cos and sin products, the two half-updates, the cast back; pipeline/models/layers/rotary.py), each pass a
kernel of its own: 14 kernels and ~80 d bytes per token and layer for ESM-2. Here a program takes a tile of
(token, head) rows of the QKV output, loads each row's two rotary halves once, and writes them back rotated:
12 d bytes (read q and k, write them) and one launch. The values attention then reads stay where the
projection put them, so nothing else is copied.

Each thread loads and stores the same elements (the two halves are separate tiles of one layout), so the
in-place update needs no barrier. Math in float32; the query scale is applied first and rounded to the
tensor's dtype, as `q * scale` is in the unfused layer.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._launch import launch
from ..launch_config import RotaryKnobs


@triton.jit(do_not_specialize=["num_rows"])
def _rotate_qk_kernel(
    qkv_ptr, cos_ptr, sin_ptr, num_rows, stride_t, stride_cos, stride_sin, q_scale,
    NUM_Q_HEADS: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr, REST: tl.constexpr, BLOCK_REST: tl.constexpr, SCALE_Q: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    """Rows r = token * NUM_HEADS + head over the query and key heads (queries first); columns i < HALF of a
    head's first half, paired with i + HALF. REST channels past the rotation pass through (scaled for q)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    token = rows // NUM_HEADS
    head = rows % NUM_HEADS
    row_ok = rows < num_rows
    cols = tl.arange(0, BLOCK_HALF)
    ok = row_ok[:, None] & (cols < HALF)[None, :]
    base = qkv_ptr + token[:, None] * stride_t + (head * HEAD_DIM)[:, None] + cols[None, :]
    x1 = tl.load(base, mask=ok, other=0.0)
    x2 = tl.load(base + HALF, mask=ok, other=0.0)
    if SCALE_Q:
        is_q = (head < NUM_Q_HEADS)[:, None]
        x1 = tl.where(is_q, (x1.to(tl.float32) * q_scale).to(x1.dtype), x1)
        x2 = tl.where(is_q, (x2.to(tl.float32) * q_scale).to(x2.dtype), x2)
    # cos and sin repeat their first half (the frequencies concatenated twice): one load serves both halves.
    c = tl.load(cos_ptr + token[:, None] * stride_cos + cols[None, :], mask=ok, other=1.0).to(tl.float32)
    s = tl.load(sin_ptr + token[:, None] * stride_sin + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    tl.store(base, (a * c - b * s).to(x1.dtype), mask=ok)
    tl.store(base + HALF, (b * c + a * s).to(x2.dtype), mask=ok)
    if REST > 0:
        if SCALE_Q:   # partial rotation: the query's other channels still take the scale
            rest = tl.arange(0, BLOCK_REST)
            rest_ok = (row_ok & (head < NUM_Q_HEADS))[:, None] & (rest < REST)[None, :]
            tail = qkv_ptr + token[:, None] * stride_t + (head * HEAD_DIM + 2 * HALF)[:, None] + rest[None, :]
            x = tl.load(tail, mask=rest_ok, other=0.0)
            tl.store(tail, (x.to(tl.float32) * q_scale).to(x.dtype), mask=rest_ok)


def rotate_qk_triton(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, num_q_heads: int, num_kv_heads: int,
                     head_dim: int, q_scale: float, knobs: RotaryKnobs) -> torch.Tensor:
    """op.rotate_qk_'s Triton launch; arguments already checked."""
    T, rd = qkv.shape[0], cos.shape[-1]
    if T == 0:
        return qkv
    cos, sin = cos.reshape(T, rd), sin.reshape(T, rd)
    half, rest = rd // 2, head_dim - rd
    heads = num_q_heads + num_kv_heads
    rows = T * heads
    launch(_rotate_qk_kernel, (triton.cdiv(rows, knobs.block_rows),),
           qkv, cos, sin, rows, qkv.stride(0), cos.stride(0), sin.stride(0), float(q_scale),
           NUM_Q_HEADS=num_q_heads, NUM_HEADS=heads, HEAD_DIM=head_dim, HALF=half,
           BLOCK_HALF=triton.next_power_of_2(half), REST=rest, BLOCK_REST=triton.next_power_of_2(max(rest, 1)),
           SCALE_Q=q_scale != 1.0, BLOCK_ROWS=knobs.block_rows, num_warps=knobs.num_warps)
    return qkv
