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

from dataclasses import replace

import torch
import triton
import triton.language as tl

from .._device import target_of, use_triton
from .._launch import launch
from ..launch_config import GemmKnobs, launch_row
from .torch_path import linear_gelu_torch


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


def gemm_knobs(device: torch.device, **given) -> GemmKnobs:
    """The product's launch knobs for `device`: the launch table's row, with the knobs given (not None)."""
    row = launch_row(target_of(device)).gemm
    return replace(row, **{name: value for name, value in given.items() if value is not None})


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
    M, K = x.shape
    N = weight.shape[0]
    weight = weight.contiguous()
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    kn = gemm_knobs(x.device, block_m=block_m, block_n=block_n, block_k=block_k, group_m=group_m,
                    num_warps=num_warps, num_stages=num_stages)
    grid = (triton.cdiv(M, kn.block_m) * triton.cdiv(N, kn.block_n),)
    launch(_linear_gelu_kernel, grid, x, weight, weight if bias is None else bias, out, M, x.stride(0),
           weight.stride(0), out.stride(0), N=N, K=K, HAS_BIAS=bias is not None,
           DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=kn.block_m,
           BLOCK_N=kn.block_n, BLOCK_K=kn.block_k, GROUP_M=kn.group_m, num_warps=kn.num_warps,
           num_stages=kn.num_stages)
    return out
