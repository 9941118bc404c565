"""gelu(x @ weight.T + bias) as one Triton matrix product with the activation in its epilogue.

An encoder's first MLP product writes a `[T, 4d]` tensor that a GELU kernel then reads and writes again:
16 d bytes per token in 16 bits, the largest elementwise pass of an ESM-2 layer. Applying the erf GELU to the
float32 accumulator before the one store removes that pass (and rounds once instead of twice). cuBLASLt's
own GELU epilogue is the tanh approximation, not the erf form ESM and BERT-style models use, so the product is
ours: tiles of BLOCK_M x BLOCK_N outputs reduced over K in BLOCK_K steps (software-pipelined num_stages deep),
programs ordered in groups of GROUP_M row tiles so a group's weight tiles stay in L2. Each output's reduction
order depends only on K and BLOCK_K, never on the number of rows, so a row's bits do not change with the batch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._launch import launch
from ..launch_config import GemmKnobs


@triton.jit(do_not_specialize=["M"])
def _linear_gelu_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, M, stride_xm, stride_wn, stride_om,
    N: tl.constexpr, K: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    per_group = GROUP_M * tiles_n
    group = pid // per_group
    first_m = group * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows and columns past the edge read row/column 0 instead (valid memory; their results are never stored),
    # so the loads of the K loop need no row or column masks.
    rows = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + cols[None, :] * stride_wn + offs_k[:, None]     # weight.T tile [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if K % BLOCK_K == 0:
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:
            k_ok = offs_k < K - k * BLOCK_K
            a = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols).to(tl.float32)[None, :]
    out = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476))
    ok = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :], out.to(out_ptr.dtype.element_ty),
             mask=ok)


def linear_gelu_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kn: GemmKnobs) -> torch.Tensor:
    """op.linear_gelu's Triton launch; arguments already checked."""
    M, K = x.shape
    N = weight.shape[0]
    weight = weight.contiguous()
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    grid = (triton.cdiv(M, kn.block_m) * triton.cdiv(N, kn.block_n),)
    launch(_linear_gelu_kernel, grid, x, weight, weight if bias is None else bias, out, M, x.stride(0),
           weight.stride(0), out.stride(0), N=N, K=K, HAS_BIAS=bias is not None,
           DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=kn.block_m,
           BLOCK_N=kn.block_n, BLOCK_K=kn.block_k, GROUP_M=kn.group_m, num_warps=kn.num_warps,
           num_stages=kn.num_stages)
    return out
