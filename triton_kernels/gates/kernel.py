"""Qwen3.5's gates, one pass each: the gated attention's output gate and the delta-rule layers' decay and write
gates.

Unfused on a GPU, the attention's `o * sigmoid(gate)` copies the gate out of the projection (`reshape`: it sits
between the queries, a head stride of 2 head_dim), takes its sigmoid (read, write) and multiplies (read two,
write): about 12 q_size bytes per token in 16 bits and three kernels. `sigmoid_gate` reads o and the gate where
they are and writes the product: 6 q_size bytes, one kernel. The delta rule's gates `g = -exp(A_log) *
softplus(a + dt_bias)` (float32) and `beta = sigmoid(b)` were eight small kernels a layer (casts, exp, neg, add,
softplus, mul, sigmoid) over `[T, HV]`; `delta_rule_gates` is one.

Rounding points are the unfused ops' on a GPU: sigmoid in float32 (`1 / (1 + expf(-x))`, CUDA's expf as torch's
kernel calls it: _cuda_math) rounded to the gate's dtype, as `torch.sigmoid` stores it, then the product in float32
rounded once; g in float32 throughout (softplus with beta 1 and threshold 20: `x > 20 ? x : log1pf(expf(x))`),
beta rounded once to b's dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _cuda_math as cm
from .._launch import launch
from ..launch_config import GateKnobs


@triton.jit(do_not_specialize=["num_rows"])
def _sigmoid_gate_kernel(
    o_ptr, g_ptr, out_ptr, num_rows, heads, stride_ot, stride_oh, stride_gt, stride_gh,
    N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):
    # Row r is head r % heads of token r // heads; out is [T, heads * N] contiguous, so row r starts at r * N.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_N)
    ok = (rows < num_rows)[:, None] & (cols < N)[None, :]
    t, h = rows // heads, rows % heads
    o = tl.load(o_ptr + (t * stride_ot + h * stride_oh)[:, None] + cols[None, :], mask=ok, other=0.0)
    g = tl.load(g_ptr + (t * stride_gt + h * stride_gh)[:, None] + cols[None, :], mask=ok, other=0.0)
    s = cm.sigmoid(g.to(tl.float32)).to(g.dtype).to(tl.float32)   # rounded as torch.sigmoid stores it
    out = o.to(tl.float32) * s
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["num_tokens"])
def _delta_rule_gates_kernel(
    a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, num_tokens, stride_a, stride_b,
    HV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.arange(0, BLOCK_H)
    h_ok = h < HV
    ok = (t < num_tokens)[:, None] & h_ok[None, :]
    a = tl.load(a_ptr + t[:, None] * stride_a + h[None, :], mask=ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + t[:, None] * stride_b + h[None, :], mask=ok, other=0.0)
    dt_bias = tl.load(dt_bias_ptr + h, mask=h_ok, other=0.0).to(tl.float32)
    decay = -cm.exp(tl.load(A_log_ptr + h, mask=h_ok, other=0.0).to(tl.float32))
    g = decay[None, :] * cm.softplus(a + dt_bias[None, :])
    beta = cm.sigmoid(b.to(tl.float32))
    tl.store(g_ptr + t[:, None] * HV + h[None, :], g, mask=ok)
    tl.store(beta_ptr + t[:, None] * HV + h[None, :], beta.to(beta_ptr.dtype.element_ty), mask=ok)


def sigmoid_gate_triton(o: torch.Tensor, gate: torch.Tensor, knobs: GateKnobs) -> torch.Tensor:
    """op.sigmoid_gate's Triton launch; arguments already checked."""
    T, H, D = o.shape
    out = torch.empty(T, H * D, dtype=o.dtype, device=o.device)
    if T * H == 0:
        return out
    block_n = triton.next_power_of_2(D)
    block_rows = max(1, knobs.block_elements // block_n)
    launch(_sigmoid_gate_kernel, (triton.cdiv(T * H, block_rows),),
           o, gate, out, T * H, H, o.stride(0), o.stride(1), gate.stride(0), gate.stride(1),
           N=D, BLOCK_N=block_n, BLOCK_ROWS=block_rows, num_warps=knobs.num_warps)
    return out


def delta_rule_gates_triton(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                            knobs: GateKnobs) -> tuple[torch.Tensor, torch.Tensor]:
    """op.delta_rule_gates' Triton launch; arguments already checked."""
    T, HV = a.shape
    g = torch.empty(T, HV, dtype=torch.float32, device=a.device)
    beta = torch.empty(T, HV, dtype=b.dtype, device=b.device)
    if T == 0:
        return g, beta
    launch(_delta_rule_gates_kernel, (triton.cdiv(T, knobs.delta_block_tokens),),
           a, b, A_log, dt_bias, g, beta, T, a.stride(0), b.stride(0),
           HV=HV, BLOCK_H=triton.next_power_of_2(HV), BLOCK_T=knobs.delta_block_tokens,
           num_warps=knobs.delta_num_warps)
    return g, beta
