"""Token-by-token gated delta rule (decode step): one Triton kernel, state slice in registers.

One program per (sequence, value head, block of V columns) loads its [K, BV] state slice once, applies
the recurrence to each of its tokens (usually one), and writes the outputs and the final slice. Decode
is bandwidth-bound: the state is read once and written once per call. With `state_indices` the states
are read from and written back to their slots of the caller's state pool, in place: no gather into a
batch-ordered copy before the call and no scatter back after it (3x the state traffic otherwise).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_kernels._launch import launch
from triton_kernels.gated_delta_rule.chunk import _block_size, _pow2_block
from triton_kernels.gated_delta_rule.layout import Dims, token_rows
from triton_kernels.gated_delta_rule.tiles import _load_state, _store_state


@triton.jit
def _recurrent_kernel(
    q, k, v, g, beta,  # q, k [tokens, H, K]; v [tokens, HV, V]; g, beta [tokens, HV]
    o,  # output [tokens, HV, V]
    h0, ht,  # initial / final states [N, HV, K, V] float32 (None when unused); with INDEXED both are the
             # state pool [slots, HV, K, V], sequence n's state in slot state_idx[n]
    seq_bounds,  # int32 or int64 [N+1]
    state_idx,  # int32 or int64 [N] with INDEXED, else None
    scale,
    q_stride, k_stride, v_stride,  # elements between consecutive tokens of q, k, v; within a token heads then
                                   # channels are contiguous (they may be column views of a wider tensor)
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
    USE_L2NORM: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr, INDEXED: tl.constexpr,
):
    pid = tl.program_id(0)
    i_n = pid // (HV * NV)
    i_hv = (pid // NV) % HV
    i_v = pid % NV
    i_h = i_hv // (HV // H)
    bos = tl.load(seq_bounds + i_n).to(tl.int64)
    eos = tl.load(seq_bounds + i_n + 1).to(tl.int64)
    if INDEXED:
        i_s = tl.load(state_idx + i_n).to(tl.int64)
    else:
        i_s = i_n

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    if USE_H0:
        S = _load_state(h0, i_s, i_hv, HV, K, V, BK, BV, i_v * BV)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)

    for t in range(bos, eos):
        b_q = tl.load(q + (t * q_stride + i_h * K) + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + (t * k_stride + i_h * K) + o_k, mask=m_k, other=0.0).to(tl.float32)
        if USE_L2NORM:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, axis=0) + 1e-6)
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, axis=0) + 1e-6)
        b_v = tl.load(v + (t * v_stride + i_hv * V) + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_g = tl.load(g + t * HV + i_hv).to(tl.float32)
        b_beta = tl.load(beta + t * HV + i_hv).to(tl.float32)
        S = S * tl.exp(b_g)
        b_u = b_beta * (b_v - tl.sum(S * b_k[:, None], axis=0))
        S = S + b_k[:, None] * b_u[None, :]
        b_o = tl.sum(S * (b_q * scale)[:, None], axis=0)
        tl.store(o + (t * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)

    if STORE_HT:
        _store_state(ht, S, i_s, i_hv, HV, K, V, BK, BV, i_v * BV)


def recurrent_fwd_triton(q, k, v, g, beta, *, scale: float, initial_state, output_final_state: bool,
                         dims: Dims, use_qk_l2norm: bool, cu_seqlens: torch.Tensor | None,
                         state_indices: torch.Tensor | None, block_v: int, num_warps: int, num_stages: int):
    """Launch the recurrent kernel; arguments already validated by op.fused_recurrent_gated_delta_rule."""
    d = dims
    H, HV, K, V = d.num_heads, d.num_v_heads, d.head_k_dim, d.head_v_dim
    tokens = d.batch * d.seq_len
    if tokens >= 2**31:
        raise ValueError(f"at most 2**31 - 1 tokens per call, got {tokens}")
    device = q.device
    # q, k, v read where they lie (the mixer's are column views of the conv's output), copied only when a token's
    # heads and channels are not contiguous (layout.token_rows); g and beta are contiguous, indexed densely.
    (q, q_stride), (k, k_stride) = (token_rows(x, tokens, H, K) for x in (q, k))
    v, v_stride = token_rows(v, tokens, HV, V)
    g, beta = (x.reshape(tokens, HV).contiguous() for x in (g, beta))
    N = d.num_sequences
    o = torch.empty(tokens, HV, V, dtype=q.dtype, device=device)
    final = torch.empty(N, HV, K, V, dtype=torch.float32, device=device) if output_final_state else None
    if state_indices is not None:   # the pool itself: read and written in place (checked by check_inputs)
        h0 = final = initial_state
        state_indices = state_indices.contiguous()
    else:
        h0 = initial_state.to(torch.float32).contiguous() if initial_state is not None else None
    BV = min(_block_size("block_v", block_v), _pow2_block(V))
    NV = triton.cdiv(V, BV)
    if cu_seqlens is None:
        seq_bounds = torch.arange(d.batch + 1, dtype=torch.int64, device=device) * d.seq_len
    else:
        seq_bounds = cu_seqlens.contiguous()
    launch(_recurrent_kernel, (N * HV * NV,),
           q, k, v, g, beta, o, h0, final, seq_bounds, state_indices, scale, q_stride, k_stride, v_stride,
           H=H, HV=HV, K=K, V=V, BK=_pow2_block(K), BV=BV, NV=NV,
           USE_L2NORM=use_qk_l2norm, USE_H0=h0 is not None, STORE_HT=final is not None,
           INDEXED=state_indices is not None, num_warps=num_warps, num_stages=num_stages)
    return o.reshape(d.batch, d.seq_len, HV, V), (None if state_indices is not None else final)
