"""Chunked gated delta rule forward (prefill): two Triton kernels, the state kept on chip across chunks.

1. `_chunk_prep_kernel`, one program per (chunk, value head), all in parallel. From the gate cumsum
   gamma and the (optionally l2-normalised) keys it solves the in-chunk system
   A = strict_lower(diag(beta) K K^T * exp(gamma_i - gamma_j)), T = (I + A)^-1 (forward substitution on
   four diagonal blocks, then block elimination), and writes W = T (K beta exp(gamma)), U = T (V beta),
   the in-chunk attention P = lower(scale Q K^T * exp(gamma_i - gamma_j)) and two row scales,
   q_scale = scale exp(gamma) / |q| and k_scale = exp(gamma_last - gamma) / |k| (|x| = 1 without l2norm).
2. `_chunk_walk_kernel`, one program per (sequence, value head, block of V columns), holds the state
   S [K, BV] in registers and walks the sequence's chunks, each step four matmuls:
   Vn = U - W S;  O = diag(q_scale) Q S + P Vn;  S <- exp(gamma_last) S + K^T diag(k_scale) Vn.
   Only O and the final state leave the chip; nothing per chunk is written (fla's bottleneck).

Everything elementwise (exp, masks, norms) lives in the parallel kernel: the walk is the sequential
critical path, and keeping [64, 64] temporaries out of it keeps its registers from spilling.
The math is in REFERENCE.md; the design and byte model in docs/kernels/gated_delta_rule.md.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from triton_kernels._device import target_of
from triton_kernels._launch import launch
from triton_kernels.gated_delta_rule.layout import Dims, SequenceLayout, token_rows
from triton_kernels.gated_delta_rule.split import chunk_fwd_split
from triton_kernels.gated_delta_rule.tiles import (_inv_norms, _load_rows, _load_token_rows, _load_vec, _start_state,
                                                   _store_rows, _store_state, _walk_program)
from triton_kernels.gated_delta_rule.walk_layout import LaunchTables, chain_segment_starts, launch_tables, plan_walk

TRITON_CHUNK_SIZES = (64, 128)
# "fused": the two kernels below (the default); "split": split.py's prep (two kernels), state walk and output kernel.
DESIGNS = ("fused", "split")


@triton.jit
def _prep_block(k, k_stride, g, gamma, row0, eos, i_h, i_hv, gamma_before,
                H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                USE_L2NORM: tl.constexpr):
    """Raw keys, their inverse norms (l2norm) and gamma of one BC-row block of a chunk; gamma continues
    from `gamma_before` (float64) and is stored. Returns (k, 1/|k|, gamma, gamma at the block's end, float64).

    The cumulative sum runs in float64 and each gamma is rounded to float32 once: a float32 scan adds in a
    tree on a GPU, so neighbouring gammas got independent roundings of several ulps, and with gates down to
    -1e4 (gammas near -1e5, ulp 0.008) exp(gamma_i - gamma_j) was off by percents where it mattered: 7.6e-4
    output error on an H200 against 1.2e-5 for rounding the exact sums once (tools/gpu_numerics_probe.py)."""
    b_k = _load_token_rows(k, k_stride, row0, eos, i_h, K, BC, BK)
    rows = row0 + tl.arange(0, BC).to(tl.int64)
    in_seq = rows < eos
    b_g = tl.load(g + rows * HV + i_hv, mask=in_seq, other=0.0).to(tl.float64)
    exact = tl.cumsum(b_g, axis=0) + gamma_before
    b_gamma = exact.to(tl.float32)
    tl.store(gamma + rows * HV + i_hv, b_gamma, mask=in_seq)
    # Rows past the end have g = 0, so the last entry is the gamma of the last real row.
    gamma_end = tl.sum(tl.where(tl.arange(0, BC) == BC - 1, exact, 0.0), axis=0)
    return b_k, _inv_norms(b_k, USE_L2NORM), b_gamma, gamma_end


@triton.jit
def _decayed_gram(x_i, k_j, row_scale, col_scale, gamma_i, gamma_j, DIAGONAL: tl.constexpr, BC: tl.constexpr,
                  DOT_PREC: tl.constexpr):
    """Block (i, j) of diag(row_scale) X K^T diag(col_scale) * exp(gamma_i - gamma_j), float32 [BC, BC].

    DIAGONAL: 0 for a block below the diagonal (i > j: no mask), 1 for a diagonal block kept strictly
    lower (A), 2 for a diagonal block kept lower with its diagonal (P)."""
    a = tl.dot(x_i, tl.trans(k_j), input_precision=DOT_PREC) * col_scale[None, :]
    diff = gamma_i[:, None] - gamma_j[None, :]
    if DIAGONAL == 0:
        a = a * tl.exp(diff)  # block i is later in the chunk than block j: diff <= 0 everywhere
    else:
        o = tl.arange(0, BC)
        keep = (o[:, None] > o[None, :]) if DIAGONAL == 1 else (o[:, None] >= o[None, :])
        # Mask before exp: above the diagonal gamma_i - gamma_j > 0 and exp could overflow.
        a = tl.where(keep, a * tl.exp(tl.where(keep, diff, 0.0)), 0.0)
    return a * row_scale[:, None]


@triton.jit
def _mm_f32(a, b):
    """a @ b with full fp32 products (FMA, not tensor cores)."""
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _invert_unit_lower(A, BC: tl.constexpr):
    """(I + A)^-1 for strictly lower A [BC, BC] by forward substitution, T_i = e_i - sum_j<i A_ij T_j.

    Row i is updated by a dot with A masked to its row i (no cross-row reductions in the loop). All of
    T's products are full fp32 ("ieee": FMA, not tensor cores) whatever the input dtype: (I + A)^-1 is
    the error-sensitive step, the products are only 16 x 16 x 16, and tf32x3 quadruples compile time.
    Forward substitution rather than the shorter product (I - A)(I + A^2)(I + A^4)...: that series
    cancels catastrophically when keys in a chunk are alike (its terms grow like binomial coefficients).
    """
    o = tl.arange(0, BC)
    T = (o[:, None] == o[None, :]).to(tl.float32)
    for i in tl.static_range(1, BC):
        T -= tl.dot(tl.where(o[:, None] == i, A, 0.0), T, input_precision="ieee")
    return T


@triton.jit
def _lower_row2(t0, t1, x0, x1, PREC: tl.constexpr):
    """Row block 1 of T X for block-lower-triangular T: T_10 X_0 + T_11 X_1."""
    return tl.dot(t0, x0, input_precision=PREC) + tl.dot(t1, x1, input_precision=PREC)


@triton.jit
def _lower_row3(t0, t1, t2, x0, x1, x2, PREC: tl.constexpr):
    return _lower_row2(t0, t1, x0, x1, PREC) + tl.dot(t2, x2, input_precision=PREC)


@triton.jit
def _lower_row4(t0, t1, t2, t3, x0, x1, x2, x3, PREC: tl.constexpr):
    return _lower_row3(t0, t1, t2, x0, x1, x2, PREC) + tl.dot(t3, x3, input_precision=PREC)


@triton.jit
def _store_row_scales(q_scale, k_scale, row0, eos, i_hv, rq, rk, gamma_rows, gamma_last,
                      HV: tl.constexpr, BC: tl.constexpr):
    rows = row0 + tl.arange(0, BC).to(tl.int64)
    tl.store(q_scale + rows * HV + i_hv, rq * tl.exp(gamma_rows), mask=rows < eos)
    tl.store(k_scale + rows * HV + i_hv, rk * tl.exp(gamma_last - gamma_rows), mask=rows < eos)


@triton.jit
def _row_blocks_again(chunk_bounds, i_c, BC: tl.constexpr):
    """The chunk's four row-block starts, loaded again after a barrier (which also makes this program's
    earlier stores visible to all its threads). The compiler cannot then reuse the addresses and masks
    it derived from the first load, which Triton 3.6 kept live across the triangular solve and spilled."""
    tl.debug_barrier()
    bos = tl.load(chunk_bounds + 2 * i_c).to(tl.int64)
    return bos, bos + BC, bos + 2 * BC, bos + 3 * BC


@triton.jit
def _chunk_prep_kernel(
    q, k, v, g, beta,  # inputs: q, k [tokens, H, K], v [tokens, HV, V], g and beta [tokens, HV]
    w, u, p,  # outputs in the input dtype: w [tokens, HV, K], u [tokens, HV, V], p [tokens, HV, BT]
    gamma, q_scale, k_scale,  # outputs, float32 [tokens, HV]
    chunk_bounds,  # int32 [num_chunks, 2]: first token, end token
    scale,
    q_stride, k_stride, v_stride,  # elements between consecutive tokens of q, k, v (see tiles._load_token_rows)
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BVALL: tl.constexpr,
    USE_L2NORM: tl.constexpr, DOT_PREC: tl.constexpr,
):
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    bos = tl.load(chunk_bounds + 2 * i_c).to(tl.int64)
    eos = tl.load(chunk_bounds + 2 * i_c + 1).to(tl.int64)
    BC: tl.constexpr = BT // 4
    r0, r1, r2, r3 = bos, bos + BC, bos + 2 * BC, bos + 3 * BC

    k0, rk0, gam0, end0 = _prep_block(k, k_stride, g, gamma, r0, eos, i_h, i_hv, 0.0, H, HV, K, BC, BK, USE_L2NORM)
    k1, rk1, gam1, end1 = _prep_block(k, k_stride, g, gamma, r1, eos, i_h, i_hv, end0, H, HV, K, BC, BK, USE_L2NORM)
    k2, rk2, gam2, end2 = _prep_block(k, k_stride, g, gamma, r2, eos, i_h, i_hv, end1, H, HV, K, BC, BK, USE_L2NORM)
    k3, rk3, gam3, end3 = _prep_block(k, k_stride, g, gamma, r3, eos, i_h, i_hv, end2, H, HV, K, BC, BK, USE_L2NORM)
    g_last = end3.to(tl.float32)   # the last row's gamma, rounded as it was stored

    # P = lower(diag(scale / |q|) Q K^T diag(1 / |k|) * decay), written whole (zeros above the diagonal
    # blocks) so the walk loads it as a plain [BT, BT] tile; and the walk's row scales. First, so that
    # the q blocks are dead before the triangular solve needs the registers; one row block at a time, so
    # that one q block is live, not four (Triton 3.6 spilled here).
    zero = tl.zeros([BC, BC], dtype=tl.float32)
    q0 = _load_token_rows(q, q_stride, r0, eos, i_h, K, BC, BK)
    rq0 = _inv_norms(q0, USE_L2NORM) * scale
    _store_rows(p, _decayed_gram(q0, k0, rq0, rk0, gam0, gam0, 2, BC, DOT_PREC), r0, eos, i_hv, HV, BT, BC, BC, 0)
    _store_rows(p, zero, r0, eos, i_hv, HV, BT, BC, BC, BC)
    _store_rows(p, zero, r0, eos, i_hv, HV, BT, BC, BC, 2 * BC)
    _store_rows(p, zero, r0, eos, i_hv, HV, BT, BC, BC, 3 * BC)
    _store_row_scales(q_scale, k_scale, r0, eos, i_hv, rq0, rk0, gam0, g_last, HV, BC)
    q1 = _load_token_rows(q, q_stride, r1, eos, i_h, K, BC, BK)
    rq1 = _inv_norms(q1, USE_L2NORM) * scale
    _store_rows(p, _decayed_gram(q1, k0, rq1, rk0, gam1, gam0, 0, BC, DOT_PREC), r1, eos, i_hv, HV, BT, BC, BC, 0)
    _store_rows(p, _decayed_gram(q1, k1, rq1, rk1, gam1, gam1, 2, BC, DOT_PREC), r1, eos, i_hv, HV, BT, BC, BC, BC)
    _store_rows(p, zero, r1, eos, i_hv, HV, BT, BC, BC, 2 * BC)
    _store_rows(p, zero, r1, eos, i_hv, HV, BT, BC, BC, 3 * BC)
    _store_row_scales(q_scale, k_scale, r1, eos, i_hv, rq1, rk1, gam1, g_last, HV, BC)
    q2 = _load_token_rows(q, q_stride, r2, eos, i_h, K, BC, BK)
    rq2 = _inv_norms(q2, USE_L2NORM) * scale
    _store_rows(p, _decayed_gram(q2, k0, rq2, rk0, gam2, gam0, 0, BC, DOT_PREC), r2, eos, i_hv, HV, BT, BC, BC, 0)
    _store_rows(p, _decayed_gram(q2, k1, rq2, rk1, gam2, gam1, 0, BC, DOT_PREC), r2, eos, i_hv, HV, BT, BC, BC, BC)
    _store_rows(p, _decayed_gram(q2, k2, rq2, rk2, gam2, gam2, 2, BC, DOT_PREC), r2, eos, i_hv, HV, BT, BC, BC,
                2 * BC)
    _store_rows(p, zero, r2, eos, i_hv, HV, BT, BC, BC, 3 * BC)
    _store_row_scales(q_scale, k_scale, r2, eos, i_hv, rq2, rk2, gam2, g_last, HV, BC)
    q3 = _load_token_rows(q, q_stride, r3, eos, i_h, K, BC, BK)
    rq3 = _inv_norms(q3, USE_L2NORM) * scale
    _store_rows(p, _decayed_gram(q3, k0, rq3, rk0, gam3, gam0, 0, BC, DOT_PREC), r3, eos, i_hv, HV, BT, BC, BC, 0)
    _store_rows(p, _decayed_gram(q3, k1, rq3, rk1, gam3, gam1, 0, BC, DOT_PREC), r3, eos, i_hv, HV, BT, BC, BC, BC)
    _store_rows(p, _decayed_gram(q3, k2, rq3, rk2, gam3, gam2, 0, BC, DOT_PREC), r3, eos, i_hv, HV, BT, BC, BC,
                2 * BC)
    _store_rows(p, _decayed_gram(q3, k3, rq3, rk3, gam3, gam3, 2, BC, DOT_PREC), r3, eos, i_hv, HV, BT, BC, BC,
                3 * BC)
    _store_row_scales(q_scale, k_scale, r3, eos, i_hv, rq3, rk3, gam3, g_last, HV, BC)

    # T = (I + A)^-1 block by block: invert the diagonal blocks, then T_ij = -T_ii sum_{j<=m<i} A_im T_mj
    # (full fp32 products, see _invert_unit_lower). A = diag(beta / |k|) K K^T diag(1 / |k|) * decay.
    # Every A block first, so the key tiles are dead before the solve's loops need the registers. beta is
    # loaded here, not with the keys, so that it is not live across P. The row operands (kr) are the keys
    # read again after the barrier, one row block at a time: Triton 3.6 converts a tile used as a left
    # operand in several dots to that operand layout once, where the tile is defined, so the first keys
    # as rows kept 96 registers a thread live across P and spilled 8 B on sm_80 (3.9 did not, but
    # spilled 16 B on sm_90 when the reloaded rows came in the old A00, A11, .., A30 order).
    r0, r1, r2, r3 = _row_blocks_again(chunk_bounds, i_c, BC)
    beta0 = _load_vec(beta, r0, eos, i_hv, HV, BC)
    beta1 = _load_vec(beta, r1, eos, i_hv, HV, BC)
    beta2 = _load_vec(beta, r2, eos, i_hv, HV, BC)
    beta3 = _load_vec(beta, r3, eos, i_hv, HV, BC)
    kr0 = _load_token_rows(k, k_stride, r0, eos, i_h, K, BC, BK)
    A00 = _decayed_gram(kr0, k0, beta0 * rk0, rk0, gam0, gam0, 1, BC, DOT_PREC)
    kr1 = _load_token_rows(k, k_stride, r1, eos, i_h, K, BC, BK)
    A10 = _decayed_gram(kr1, k0, beta1 * rk1, rk0, gam1, gam0, 0, BC, DOT_PREC)
    A11 = _decayed_gram(kr1, k1, beta1 * rk1, rk1, gam1, gam1, 1, BC, DOT_PREC)
    kr2 = _load_token_rows(k, k_stride, r2, eos, i_h, K, BC, BK)
    A20 = _decayed_gram(kr2, k0, beta2 * rk2, rk0, gam2, gam0, 0, BC, DOT_PREC)
    A21 = _decayed_gram(kr2, k1, beta2 * rk2, rk1, gam2, gam1, 0, BC, DOT_PREC)
    A22 = _decayed_gram(kr2, k2, beta2 * rk2, rk2, gam2, gam2, 1, BC, DOT_PREC)
    kr3 = _load_token_rows(k, k_stride, r3, eos, i_h, K, BC, BK)
    A30 = _decayed_gram(kr3, k0, beta3 * rk3, rk0, gam3, gam0, 0, BC, DOT_PREC)
    A31 = _decayed_gram(kr3, k1, beta3 * rk3, rk1, gam3, gam1, 0, BC, DOT_PREC)
    A32 = _decayed_gram(kr3, k2, beta3 * rk3, rk2, gam3, gam2, 0, BC, DOT_PREC)
    A33 = _decayed_gram(kr3, k3, beta3 * rk3, rk3, gam3, gam3, 1, BC, DOT_PREC)
    T00 = _invert_unit_lower(A00, BC)
    T11 = _invert_unit_lower(A11, BC)
    T22 = _invert_unit_lower(A22, BC)
    T33 = _invert_unit_lower(A33, BC)
    T10 = -_mm_f32(_mm_f32(T11, A10), T00)
    T21 = -_mm_f32(_mm_f32(T22, A21), T11)
    T32 = -_mm_f32(_mm_f32(T33, A32), T22)
    T20 = -_mm_f32(T22, _mm_f32(A20, T00) + _mm_f32(A21, T10))
    T31 = -_mm_f32(T33, _mm_f32(A31, T11) + _mm_f32(A32, T21))
    T30 = -_mm_f32(T33, _mm_f32(A30, T00) + _mm_f32(A31, T10) + _mm_f32(A32, T20))

    # W = T (K * beta * exp(gamma) / |k|), U = T (V * beta), one BC-row block at a time. The right-hand
    # sides stay float32 (tf32 tensor cores for 16-bit inputs); W and U are stored in the input dtype.
    # The key tiles are loaded again (from L2) rather than kept live across the solve, and so are beta
    # and gamma (this program's own stores, visible after the barrier). Half the columns at a time: four
    # [BC, BK / 2] tiles live, not four [BC, BK].
    r0, r1, r2, r3 = _row_blocks_again(chunk_bounds, i_c, BC)
    beta0 = _load_vec(beta, r0, eos, i_hv, HV, BC)
    beta1 = _load_vec(beta, r1, eos, i_hv, HV, BC)
    beta2 = _load_vec(beta, r2, eos, i_hv, HV, BC)
    beta3 = _load_vec(beta, r3, eos, i_hv, HV, BC)
    gam0 = _load_vec(gamma, r0, eos, i_hv, HV, BC)
    gam1 = _load_vec(gamma, r1, eos, i_hv, HV, BC)
    gam2 = _load_vec(gamma, r2, eos, i_hv, HV, BC)
    gam3 = _load_vec(gamma, r3, eos, i_hv, HV, BC)
    HK: tl.constexpr = BK // 2 if BK >= 32 else BK   # tl.dot takes no fewer than 16 columns
    for c0 in tl.static_range(0, BK, HK):
        x0 = (_load_token_rows(k, k_stride, r0, eos, i_h, K, BC, HK, c0).to(tl.float32)
              * (rk0 * beta0 * tl.exp(gam0))[:, None])
        x1 = (_load_token_rows(k, k_stride, r1, eos, i_h, K, BC, HK, c0).to(tl.float32)
              * (rk1 * beta1 * tl.exp(gam1))[:, None])
        x2 = (_load_token_rows(k, k_stride, r2, eos, i_h, K, BC, HK, c0).to(tl.float32)
              * (rk2 * beta2 * tl.exp(gam2))[:, None])
        x3 = (_load_token_rows(k, k_stride, r3, eos, i_h, K, BC, HK, c0).to(tl.float32)
              * (rk3 * beta3 * tl.exp(gam3))[:, None])
        _store_rows(w, tl.dot(T00, x0, input_precision=DOT_PREC), r0, eos, i_hv, HV, K, BC, HK, c0)
        _store_rows(w, _lower_row2(T10, T11, x0, x1, DOT_PREC), r1, eos, i_hv, HV, K, BC, HK, c0)
        _store_rows(w, _lower_row3(T20, T21, T22, x0, x1, x2, DOT_PREC), r2, eos, i_hv, HV, K, BC, HK, c0)
        _store_rows(w, _lower_row4(T30, T31, T32, T33, x0, x1, x2, x3, DOT_PREC), r3, eos, i_hv, HV, K, BC, HK, c0)

    HVH: tl.constexpr = BVALL // 2 if BVALL >= 32 else BVALL
    for c0 in tl.static_range(0, BVALL, HVH):
        x0 = _load_token_rows(v, v_stride, r0, eos, i_hv, V, BC, HVH, c0).to(tl.float32) * beta0[:, None]
        x1 = _load_token_rows(v, v_stride, r1, eos, i_hv, V, BC, HVH, c0).to(tl.float32) * beta1[:, None]
        x2 = _load_token_rows(v, v_stride, r2, eos, i_hv, V, BC, HVH, c0).to(tl.float32) * beta2[:, None]
        x3 = _load_token_rows(v, v_stride, r3, eos, i_hv, V, BC, HVH, c0).to(tl.float32) * beta3[:, None]
        _store_rows(u, tl.dot(T00, x0, input_precision=DOT_PREC), r0, eos, i_hv, HV, V, BC, HVH, c0)
        _store_rows(u, _lower_row2(T10, T11, x0, x1, DOT_PREC), r1, eos, i_hv, HV, V, BC, HVH, c0)
        _store_rows(u, _lower_row3(T20, T21, T22, x0, x1, x2, DOT_PREC), r2, eos, i_hv, HV, V, BC, HVH, c0)
        _store_rows(u, _lower_row4(T30, T31, T32, T33, x0, x1, x2, x3, DOT_PREC), r3, eos, i_hv, HV, V, BC, HVH, c0)


@triton.jit
def _chunk_walk_kernel(
    q, k, w, u, p,  # q, k [tokens, H, K]; w [tokens, HV, K]; u [tokens, HV, V]; p [tokens, HV, BT]
    gamma, q_scale, k_scale,  # float32 [tokens, HV]
    o,  # output [tokens, HV, V]
    h0, ht,  # initial / final states [N, HV, K, V] float32 (None when unused)
    seq_ranges, seq_order,  # int32 [N, 2] first and end token per sequence; int32 [N] sequences longest first
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, DOT_PREC: tl.constexpr,
    USE_U: tl.constexpr = True, WRITE_O: tl.constexpr = True, H0_IDENTITY: tl.constexpr = False,
    Q_STRIDE: tl.constexpr = None, K_STRIDE: tl.constexpr = None,
):
    """Q_STRIDE, K_STRIDE: elements between consecutive tokens of q and k (tiles._load_token_rows), constexprs
    here, unlike the prep kernel's: with a run-time stride the chunk loop kept the [BT, BK] offset tiles of q and k
    live across its iterations (sm_90, block_v 64: 227 -> 254 registers, 16-32 B spilled with a state; sm_80
    236 -> 255), and an engine's strides are one per model (the conv's width, or H K for gathered rows).
    USE_U=False walks with U = 0, and H0_IDENTITY starts from S = I (V = K, no h0 read): together they
    yield a segment's transition matrix (see `_segmented_walk`); WRITE_O=False only carries the state (no
    q, p or output traffic)."""
    # One flat grid, sequence-major: every head of the longest sequence is scheduled first.
    i_n, i_hv, i_h, bos, eos, v0 = _walk_program(seq_order, seq_ranges, H, HV, NV, BV)
    S = _start_state(h0, i_n, i_hv, v0, HV, K, V, BK, BV, USE_H0, H0_IDENTITY)

    for t0 in range(bos, eos, BT):
        if WRITE_O:
            b_q = _load_token_rows(q, Q_STRIDE, t0, eos, i_h, K, BT, BK)
        b_k = _load_token_rows(k, K_STRIDE, t0, eos, i_h, K, BT, BK)
        b_w = _load_rows(w, t0, eos, i_hv, HV, K, BT, BK)
        if USE_U:
            b_u = _load_rows(u, t0, eos, i_hv, HV, V, BT, BV, v0)
        if WRITE_O:
            b_p = _load_rows(p, t0, eos, i_hv, HV, BT, BT, BT)
        rows = t0 + tl.arange(0, BT).to(tl.int64)
        if WRITE_O:
            qs = tl.load(q_scale + rows * HV + i_hv, mask=rows < eos, other=0.0)
        ks = tl.load(k_scale + rows * HV + i_hv, mask=rows < eos, other=0.0)
        chunk_decay = tl.exp(tl.load(gamma + (tl.minimum(t0 + BT, eos) - 1) * HV + i_hv))

        # The state chain first (it is the loop's critical path), then the output from the old state.
        S_in = S.to(b_k.dtype)
        if USE_U:
            v_new = b_u.to(tl.float32) - tl.dot(b_w, S_in, input_precision=DOT_PREC)
        else:
            v_new = -tl.dot(b_w, S_in, input_precision=DOT_PREC)
        S = S * chunk_decay + tl.dot(tl.trans(b_k), (v_new * ks[:, None]).to(b_k.dtype), input_precision=DOT_PREC)
        if WRITE_O:
            b_o = tl.dot(b_q, S_in, input_precision=DOT_PREC) * qs[:, None]
            b_o += tl.dot(b_p, v_new.to(b_q.dtype), input_precision=DOT_PREC)
            _store_rows(o, b_o, t0, eos, i_hv, HV, V, BT, BV, v0)

    if STORE_HT:
        _store_state(ht, S, i_n, i_hv, HV, K, V, BK, BV, v0)


def _block_size(name: str, value: int) -> int:
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 16, got {value}")
    return value


def _pow2_block(dim: int) -> int:
    """Smallest power of two >= dim, at least 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(dim))


def chunk_fwd_triton(q, k, v, g, beta, *, scale: float, initial_state, output_final_state: bool,
                     layout: SequenceLayout, dims: Dims, use_qk_l2norm: bool, chunk_size: int,
                     block_v: int, min_block_v: int, num_warps: int, num_stages: int, prep_num_warps: int,
                     design: str = "fused", solve_num_warps: int = 4, output_block_v: int = 64,
                     output_num_warps: int = 4, batch_invariant: bool = False):
    """Launch the kernels of `design` (DESIGNS); arguments already validated by op.chunk_gated_delta_rule."""
    if chunk_size not in TRITON_CHUNK_SIZES:
        raise ValueError(f"the Triton kernels take chunk_size in {TRITON_CHUNK_SIZES}, got {chunk_size}")
    if design not in DESIGNS:
        raise ValueError(f"design must be one of {DESIGNS}, got {design!r}")
    d = dims
    H, HV, K, V = d.num_heads, d.num_v_heads, d.head_k_dim, d.head_v_dim
    tokens = d.batch * d.seq_len
    if tokens >= 2**31:
        raise ValueError(f"at most 2**31 - 1 tokens per call, got {tokens}")
    device = q.device
    # q, k, v are read where they lie (the mixer's are column views of the conv's output): a copy only when a
    # token's heads and channels are not contiguous (layout.token_rows). g and beta are the mixer's own
    # contiguous tensors; the kernels index them densely.
    (q, q_stride), (k, k_stride) = (token_rows(x, tokens, H, K) for x in (q, k))
    v, v_stride = token_rows(v, tokens, HV, V)
    g, beta = (x.reshape(tokens, HV).contiguous() for x in (g, beta))
    strides = (q_stride, k_stride, v_stride)
    N = layout.num_sequences
    o = torch.empty(tokens, HV, V, dtype=q.dtype, device=device)
    final = torch.empty(N, HV, K, V, dtype=torch.float32, device=device) if output_final_state else None
    h0 = initial_state.to(torch.float32).contiguous() if initial_state is not None else None
    # fp32 inputs keep full fp32 products (tests hold them to 1e-4); 16-bit inputs run tensor cores.
    dot_prec = "ieee" if q.dtype == torch.float32 else "tf32"
    BK = _pow2_block(K)
    _block_size("block_v", block_v)
    _block_size("min_block_v", min_block_v)
    plan = plan_walk(layout.lengths, HV, V, chunk_size, block_v=block_v, min_block_v=min_block_v,
                     num_sms=target_of(device).num_sms, batch_invariant=batch_invariant)
    tables = launch_tables(layout, chunk_size, plan.segment if plan.pieces > 1 else None, device)
    if design == "split":
        chunk_fwd_split(q, k, v, g, beta, o, final, h0, strides=strides, tables=tables, pieces=plan.pieces,
                        num_sequences=N, scale=scale, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size,
                        dot_prec=dot_prec, block_v=plan.block_v, num_warps=num_warps, num_stages=num_stages,
                        solve_num_warps=solve_num_warps, output_block_v=_block_size("output_block_v", output_block_v),
                        output_num_warps=output_num_warps)
        return o.reshape(d.batch, d.seq_len, HV, V), final

    w = torch.empty(tokens, HV, K, dtype=q.dtype, device=device)
    u = torch.empty(tokens, HV, V, dtype=q.dtype, device=device)
    p = torch.empty(tokens, HV, chunk_size, dtype=q.dtype, device=device)
    gamma, q_scale, k_scale = torch.empty(3, tokens, HV, dtype=torch.float32, device=device)
    if tables.chunks.shape[0]:
        launch(_chunk_prep_kernel, (tables.chunks.shape[0], HV),
               q, k, v, g, beta, w, u, p, gamma, q_scale, k_scale, tables.chunks, scale, *strides,
               H=H, HV=HV, K=K, V=V, BT=chunk_size, BK=BK, BVALL=_pow2_block(V),
               USE_L2NORM=use_qk_l2norm, DOT_PREC=dot_prec, num_warps=prep_num_warps)

    walk = functools.partial(_walk, q, k, w, u, p, gamma, q_scale, k_scale, q_stride=q_stride, k_stride=k_stride, H=H,
                             HV=HV, K=K, BT=chunk_size, BK=BK, BV=plan.block_v, DOT_PREC=dot_prec, num_warps=num_warps,
                             num_stages=num_stages)
    if plan.pieces == 1:
        walk(*tables.walks["all"], o, h0, final)
    else:
        _segmented_walk(walk, tables, plan.pieces, N, o, h0, final, HV=HV, K=K, V=V)
    return o.reshape(d.batch, d.seq_len, HV, V), final


def _walk(q, k, w, u, p, gamma, q_scale, k_scale, seq_ranges, seq_order, o, h0, ht, *, q_stride, k_stride, H, HV, K,
          BT, BK, BV, DOT_PREC, num_warps, num_stages, V=None, use_u=True, write_o=True, from_identity=False):
    """One launch of the walk over the sequences (or segments) of seq_ranges; V defaults to o's width."""
    V = o.shape[-1] if V is None else V
    NV = triton.cdiv(V, BV)
    launch(_chunk_walk_kernel, (seq_order.shape[0] * HV * NV,),
           q, k, w, u, p, gamma, q_scale, k_scale, o, h0, ht, seq_ranges, seq_order,
           Q_STRIDE=q_stride, K_STRIDE=k_stride, H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BV, NV=NV,
           USE_H0=h0 is not None, STORE_HT=ht is not None, DOT_PREC=DOT_PREC, USE_U=use_u, WRITE_O=write_o,
           H0_IDENTITY=from_identity, num_warps=num_warps, num_stages=num_stages)


def _segmented_walk(walk, tables: LaunchTables, pieces: int, num_sequences: int, o, h0, final, *,
                    HV: int, K: int, V: int):
    """The walk with each sequence cut into `pieces` segments (rows segment-major, see LaunchTables), walked in
    parallel, without the host reading or indexing anything on the device.

    Over a segment the state evolves affinely, S_end = M S_start + A, where A is the end state of the
    segment walked from S_start = 0 (or from the sequence's initial state for its first segment) and the
    transition M [K, K] is the end state of a walk from S = I with U = 0 (Vn = -W S). Three launches: A for
    every segment but each sequence's last, M for every segment but its first (both state only, no output),
    then, with the start states chained on the device (walk_layout.chain_segment_starts), the usual walk of
    every segment from its true start, which writes the outputs and the final states. A sequence shorter
    than the others has empty segments at its end: A = S_start, M = I, so they pass its state on.
    """
    N = num_sequences
    f32 = dict(dtype=torch.float32, device=o.device)
    a_h0 = None
    if h0 is not None:   # only the first segments start from a state; the others' A are from zero
        a_h0 = torch.zeros((pieces - 1) * N, HV, K, V, **f32)
        a_h0[:N] = h0
    local = torch.empty((pieces - 1) * N, HV, K, V, **f32)
    walk(*tables.walks["local"], o, a_h0, local, write_o=False)
    transition = torch.empty((pieces - 1) * N, HV, K, K, **f32)
    walk(*tables.walks["transition"], o, None, transition, V=K, use_u=False, write_o=False, from_identity=True)
    start = chain_segment_starts(local, transition, h0, pieces, N)
    ht = None if final is None else torch.empty(pieces * N, HV, K, V, **f32)
    walk(*tables.walks["all"], o, start, ht)
    if final is not None:   # every sequence's last segment (possibly empty: then its carried state)
        final.copy_(ht[(pieces - 1) * N:])
