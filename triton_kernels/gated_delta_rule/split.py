"""Chunked gated delta rule, the "split" design (issue 36 items 1-2): four kernels, one of them sequential.

Selected by `design="split"` (a launch knob, see launch_config.DeltaRuleChunkKnobs); the "fused" design of
chunk.py stays the default until a GPU has timed both (docs/kernels/gated_delta_rule.md).

1. The prep, two kernels, one program per (chunk, value head [, column block]), all in parallel, meant for 4
   warps. `_split_solve_kernel`: gamma (the float64 cumulative sum rounded once, as chunk.py), 1/|k|, and
   A = strict_lower(diag(beta/|k|) K K^T diag(1/|k|) * exp(gamma_i - gamma_j)) as one [BT, BT] product (KC key
   columns a step); the four diagonal blocks of T = (I + A)^-1 by forward substitution on vectors, on [4, BC, BC]
   tiles (no matrix product per row); the off-diagonal blocks by block elimination written as whole-tile
   products, one column block of T at a time. Stores T in the input dtype (the rounding the W / U products take),
   gamma, k_scale = exp(gamma_last - gamma) / |k| and W's row factor w_scale = beta exp(gamma) / |k|.
   `_split_wu_kernel`: WU_BLOCK columns of W = T (K w_scale) or of U = T (V beta) per program, operands in the
   input dtype (16-bit: full-rate tensor cores), float32 accumulation. Two kernels rather than one: together they
   held 231-255 registers (2 blocks an SM); apart, at most 123 (docs/kernels/gated_delta_rule.md).
2. `_split_state_kernel`, one program per (sequence or segment, value head, V block): per chunk it stores
   the chunk-start state S_c (input dtype, [chunks, HV, K, V]), Vn = U - W S_c (input dtype) and carries
   S <- exp(gamma_last) S + K^T diag(k_scale) Vn: two dependent products a chunk, no q loaded.
3. `_split_output_kernel`, one program per (chunk, value head, V block), all in parallel:
   O = diag(scale exp(gamma) / |q|) Q S_c + (lower(Q K^T) * scales * exp(gamma_i - gamma_j)) Vn.

Few sequences, many tokens: the state walk is cut into segments chained on the device as in chunk.py
(`_segmented_state_walk`); the output kernel then runs once over every chunk.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from triton_kernels._launch import launch
from triton_kernels.gated_delta_rule.tiles import (_inv_norms, _load_rows, _load_state, _load_token_rows, _load_vec,
                                                   _start_state, _store_rows, _store_state, _walk_program)
from triton_kernels.gated_delta_rule.walk_layout import LaunchTables, chain_segment_starts

# Columns of W or U per program of _split_wu_kernel; key columns per step of the solve kernel's K K^T.
WU_BLOCK = 64
SOLVE_KEY_BLOCK = 16


@triton.jit
def _invert_diagonal_blocks(D, NB: tl.constexpr, BC: tl.constexpr):
    """(I + D_b)^-1 of each of the NB strictly lower BC x BC blocks of D [NB, BC, BC], float32, by forward
    substitution on vectors: row r of every block at once, T_r = e_r - sum_{j<r} D_rj T_j, one reduction a row
    along the blocks' rows (axis 1), on [NB, BC, BC] tiles rather than masked [NB BC, NB BC] ones. No matrix
    product per row. The rows D_r are taken from D transposed once (E = D^T, reduced along its last axis), where
    they come out already laid along T's rows: taken from D itself they needed a second cross-warp reduction and a
    layout conversion a row (~6 barriers a row instead of ~2, in the compiled code).

    Forward substitution rather than a nilpotent series in A (I - A)(I + A^2)...: that series cancels
    catastrophically when keys in a chunk are alike (its terms grow like binomial coefficients)."""
    i = tl.arange(0, BC)
    E = tl.permute(D, (0, 2, 1))
    T = tl.broadcast_to((i[:, None] == i[None, :]).to(tl.float32)[None, :, :], [NB, BC, BC])
    for r in tl.static_range(1, BC):
        a = tl.sum(tl.where((i == r)[None, None, :], E, 0.0), axis=2)   # row r of every block: a[b, m] = D[b, r, m]
        x = tl.sum(a[:, :, None] * T, axis=1)                             # times its own block of T
        T = tl.where((i == r)[None, :, None], T - x[:, None, :], T)
    return T


@triton.jit
def _split_solve_kernel(
    k, g, beta,  # inputs: k [tokens, H, K], g and beta [tokens, HV]
    t,  # output in the input dtype: t [tokens, HV, BT], row i of its chunk's T = (I + A)^-1
    gamma, k_scale, w_scale,  # outputs, float32 [tokens, HV]
    chunk_bounds,  # int32 [num_chunks, 2]: first token, end token
    k_stride,  # elements between consecutive tokens of k (see tiles._load_token_rows)
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, KC: tl.constexpr,
    USE_L2NORM: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """gamma, k_scale, the row factor of W (w_scale = beta exp(gamma) / |k|) and T, rounded to the input dtype
    as the W / U products take it."""
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    bos = tl.load(chunk_bounds + 2 * i_c).to(tl.int64)
    eos = tl.load(chunk_bounds + 2 * i_c + 1).to(tl.int64)
    NB: tl.constexpr = 4
    BC: tl.constexpr = BT // NB
    o = tl.arange(0, BT)
    rows = bos + o.to(tl.int64)
    in_seq = rows < eos

    # gamma: the cumulative sum in float64, each value rounded to float32 once (see chunk._prep_block).
    exact = tl.cumsum(tl.load(g + rows * HV + i_hv, mask=in_seq, other=0.0).to(tl.float64), axis=0)
    b_gamma = exact.to(tl.float32)
    tl.store(gamma + rows * HV + i_hv, b_gamma, mask=in_seq)
    g_last = tl.sum(tl.where(o == BT - 1, exact, 0.0), axis=0).to(tl.float32)   # rows past the end have g = 0

    # 1/|k| from the whole key tile, which then dies; K K^T KC key columns at a time, read again (L2): a [BT, KC]
    # tile live as both operands, not [BT, K] (on sm_80 the whole tile in one product took the kernel to ~250
    # registers, 32 columns to 143 in float16).
    rk = _inv_norms(_load_token_rows(k, k_stride, bos, eos, i_h, K, BT, BK), USE_L2NORM)
    A = tl.zeros([BT, BT], dtype=tl.float32)
    for c0 in tl.static_range(0, BK, KC):
        kc = _load_token_rows(k, k_stride, bos, eos, i_h, K, BT, KC, c0)
        A = tl.dot(kc, tl.trans(kc), A, input_precision=DOT_PREC)
    b_beta = _load_vec(beta, bos, eos, i_hv, HV, BT)
    tl.store(k_scale + rows * HV + i_hv, rk * tl.exp(g_last - b_gamma), mask=in_seq)
    tl.store(w_scale + rows * HV + i_hv, rk * b_beta * tl.exp(b_gamma), mask=in_seq)

    # A = strict_lower(diag(beta/|k|) K K^T diag(1/|k|) * exp(gamma_i - gamma_j)), masked before the exp (above the
    # diagonal gamma_i - gamma_j > 0 could overflow); then seen as [NB, BC, NB, BC] blocks.
    A = A * ((b_beta * rk)[:, None] * rk[None, :])
    lower = o[:, None] > o[None, :]
    A = tl.where(lower, A * tl.exp(tl.where(lower, b_gamma[:, None] - b_gamma[None, :], 0.0)), 0.0)
    blk = tl.arange(0, NB)
    same = (blk[:, None] == blk[None, :])[:, None, :, None]
    A4 = tl.reshape(A, [NB, BC, NB, BC])
    # The diagonal blocks' inverses Td, on [NB, BC, BC] tiles; then, with L = A below the diagonal blocks,
    # I + A = (I + D)(I + N), N = Td L (strictly block lower, N^4 = 0), so (I + A)^-1 = (I - N + N^2 - N^3) Td =
    # Td - N (Td - N (Td - N Td)): the block elimination T_ij = -T_ii sum_m A_im T_mj as whole-tile products (the
    # same terms, no longer series). N by block rows (Td_b times L's rows of block b: one batched product), T one
    # column block at a time ([BT, BC] tiles live beside N, not [BT, BT] ones).
    Td = _invert_diagonal_blocks(tl.sum(tl.where(same, A4, 0.0), axis=2), NB, BC)
    N = tl.reshape(tl.dot(Td, tl.reshape(tl.where(same, 0.0, A4), [NB, BC, BT]), input_precision=DOT_PREC), [BT, BT])
    for j in tl.static_range(NB):
        Tj = tl.reshape(tl.where((blk == j)[:, None, None], Td, 0.0), [BT, BC])   # column block j of Td
        Y = Tj - tl.dot(N, Tj, input_precision=DOT_PREC)
        Y = Tj - tl.dot(N, Y, input_precision=DOT_PREC)
        Y = Tj - tl.dot(N, Y, input_precision=DOT_PREC)
        _store_rows(t, Y, bos, eos, i_hv, HV, BT, BT, BC, j * BC)


@triton.jit
def _split_wu_kernel(
    k, v, beta,  # inputs: k [tokens, H, K], v [tokens, HV, V], beta [tokens, HV]
    t, w_scale,  # the solve kernel's T [tokens, HV, BT] (input dtype) and W's row factor, float32 [tokens, HV]
    w, u,  # outputs in the input dtype: w [tokens, HV, K], u [tokens, HV, V]
    chunk_bounds, k_stride, v_stride,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BW: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """BW columns of W = T (K beta exp(gamma) / |k|) (program i_b < BK / BW) or of U = T (V beta) (the rest):
    operands in the input dtype (T and the scaled rows rounded once), float32 accumulation."""
    i_c, i_hv, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    bos = tl.load(chunk_bounds + 2 * i_c).to(tl.int64)
    eos = tl.load(chunk_bounds + 2 * i_c + 1).to(tl.int64)
    T = _load_rows(t, bos, eos, i_hv, HV, BT, BT, BT)
    NW: tl.constexpr = BK // BW
    if i_b < NW:
        x = _load_token_rows(k, k_stride, bos, eos, i_h, K, BT, BW, i_b * BW).to(tl.float32) * \
            _load_vec(w_scale, bos, eos, i_hv, HV, BT)[:, None]
        _store_rows(w, tl.dot(T, x.to(T.dtype), input_precision=DOT_PREC), bos, eos, i_hv, HV, K, BT, BW, i_b * BW)
    else:
        c0 = (i_b - NW) * BW
        x = _load_token_rows(v, v_stride, bos, eos, i_hv, V, BT, BW, c0).to(tl.float32) * \
            _load_vec(beta, bos, eos, i_hv, HV, BT)[:, None]
        _store_rows(u, tl.dot(T, x.to(T.dtype), input_precision=DOT_PREC), bos, eos, i_hv, HV, V, BT, BW, c0)


@triton.jit
def _split_state_kernel(
    k, w, u, gamma, k_scale,  # k [tokens, H, K]; w [tokens, HV, K]; u [tokens, HV, V]; float32 [tokens, HV]
    states, vn,  # outputs in the input dtype: chunk-start states [chunks, HV, K, V], Vn [tokens, HV, V]
    h0, ht,  # initial / final states [rows, HV, K, V] float32 (None when unused)
    seq_ranges, seq_order, first_chunk,  # int32 [rows, 2], [rows] longest first, [rows] index of the first chunk
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, DOT_PREC: tl.constexpr,
    USE_U: tl.constexpr = True, STORE_CHUNKS: tl.constexpr = True, H0_IDENTITY: tl.constexpr = False,
    K_STRIDE: tl.constexpr = None,
):
    """The sequential part: per chunk, S_c and Vn out, the state carried. K_STRIDE: elements between consecutive
    tokens of k, a constexpr as in chunk._chunk_walk_kernel (a run-time one keeps the loop's offsets live).
    USE_U=False with H0_IDENTITY yields a segment's transition matrix, STORE_CHUNKS=False only carries the state
    (the segmented path's first walks)."""
    i_n, i_hv, i_h, bos, eos, v0 = _walk_program(seq_order, seq_ranges, H, HV, NV, BV)
    S = _start_state(h0, i_n, i_hv, v0, HV, K, V, BK, BV, USE_H0, H0_IDENTITY)
    if STORE_CHUNKS:
        i_chunk = tl.load(first_chunk + i_n).to(tl.int64)

    for t0 in range(bos, eos, BT):
        b_k = _load_token_rows(k, K_STRIDE, t0, eos, i_h, K, BT, BK)
        b_w = _load_rows(w, t0, eos, i_hv, HV, K, BT, BK)
        rows = t0 + tl.arange(0, BT).to(tl.int64)
        ks = tl.load(k_scale + rows * HV + i_hv, mask=rows < eos, other=0.0)
        chunk_decay = tl.exp(tl.load(gamma + (tl.minimum(t0 + BT, eos) - 1) * HV + i_hv))
        S_in = S.to(b_k.dtype)
        if STORE_CHUNKS:
            _store_state(states, S_in, i_chunk, i_hv, HV, K, V, BK, BV, v0)
            i_chunk += 1
        if USE_U:
            v_new = _load_rows(u, t0, eos, i_hv, HV, V, BT, BV, v0).to(tl.float32) \
                - tl.dot(b_w, S_in, input_precision=DOT_PREC)
        else:
            v_new = -tl.dot(b_w, S_in, input_precision=DOT_PREC)
        if STORE_CHUNKS:
            _store_rows(vn, v_new, t0, eos, i_hv, HV, V, BT, BV, v0)
        S = S * chunk_decay + tl.dot(tl.trans(b_k), (v_new * ks[:, None]).to(b_k.dtype), input_precision=DOT_PREC)

    if STORE_HT:
        _store_state(ht, S, i_n, i_hv, HV, K, V, BK, BV, v0)


@triton.jit
def _split_output_kernel(
    q, k, gamma, states, vn,  # q, k [tokens, H, K]; gamma float32 [tokens, HV]; S_c [chunks, HV, K, V]; Vn
    o,  # output [tokens, HV, V]
    chunk_bounds, scale,
    q_stride, k_stride,  # elements between consecutive tokens of q, k (see tiles._load_token_rows)
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_L2NORM: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """O = diag(scale exp(gamma) / |q|) Q S_c + P Vn, P = lower(diag(scale / |q|) Q K^T diag(1 / |k|) *
    exp(gamma_i - gamma_j)) formed here, where it is used (rounded to the input dtype for its product)."""
    i_c, i_hv, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    bos = tl.load(chunk_bounds + 2 * i_c).to(tl.int64)
    eos = tl.load(chunk_bounds + 2 * i_c + 1).to(tl.int64)
    v0 = i_v * BV
    b_q = _load_token_rows(q, q_stride, bos, eos, i_h, K, BT, BK)
    b_k = _load_token_rows(k, k_stride, bos, eos, i_h, K, BT, BK)
    rq = _inv_norms(b_q, USE_L2NORM) * scale
    rk = _inv_norms(b_k, USE_L2NORM)
    b_gamma = _load_vec(gamma, bos, eos, i_hv, HV, BT)
    t = tl.arange(0, BT)
    # Rows past the chunk's end read gamma = 0: masked too, so that exp never sees a positive argument.
    keep = (t[:, None] >= t[None, :]) & (t < eos - bos)[:, None]
    p = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC) * (rq[:, None] * rk[None, :])
    p = tl.where(keep, p * tl.exp(tl.where(keep, b_gamma[:, None] - b_gamma[None, :], 0.0)), 0.0)
    S_c = _load_state(states, i_c, i_hv, HV, K, V, BK, BV, v0)
    b_v = _load_rows(vn, bos, eos, i_hv, HV, V, BT, BV, v0)
    b_o = tl.dot(b_q, S_c, input_precision=DOT_PREC) * (rq * tl.exp(b_gamma))[:, None]
    b_o += tl.dot(p.to(b_v.dtype), b_v, input_precision=DOT_PREC)
    _store_rows(o, b_o, bos, eos, i_hv, HV, V, BT, BV, v0)


def chunk_fwd_split(q, k, v, g, beta, o, final, h0, *, strides: tuple[int, int, int], tables: LaunchTables,
                    pieces: int, num_sequences: int, scale: float, use_qk_l2norm: bool, chunk_size: int, dot_prec: str,
                    block_v: int, num_warps: int, num_stages: int, solve_num_warps: int, output_block_v: int,
                    output_num_warps: int) -> None:
    """Launch the split design's kernels on token-major inputs (q, k [tokens, H, K], v [tokens, HV, V], their
    tokens `strides` elements apart (layout.token_rows); g and beta [tokens, HV], contiguous) into o
    [tokens, HV, V] and final ([N, HV, K, V] float32, or None); h0 the float32 initial states or None. `tables`
    and `pieces` (segments per sequence) as chunk_fwd_triton planned them."""
    tokens, H, K = q.shape
    q_stride, k_stride, v_stride = strides
    HV, V = v.shape[1], v.shape[2]
    BK, BVALL = _pow2(K), _pow2(V)
    device, dtype = q.device, q.dtype
    num_chunks = tables.chunks.shape[0]
    w = torch.empty(tokens, HV, K, dtype=dtype, device=device)
    u = torch.empty(tokens, HV, V, dtype=dtype, device=device)
    vn = torch.empty(tokens, HV, V, dtype=dtype, device=device)
    states = torch.empty(num_chunks, HV, K, V, dtype=dtype, device=device)
    gamma, k_scale, w_scale = torch.empty(3, tokens, HV, dtype=torch.float32, device=device)
    if num_chunks:
        t = torch.empty(tokens, HV, chunk_size, dtype=dtype, device=device)
        launch(_split_solve_kernel, (num_chunks, HV), k, g, beta, t, gamma, k_scale, w_scale, tables.chunks, k_stride,
               H=H, HV=HV, K=K, BT=chunk_size, BK=BK, KC=_solve_key_block(dtype, BK), USE_L2NORM=use_qk_l2norm,
               DOT_PREC=dot_prec, num_warps=solve_num_warps)
        BW = min(WU_BLOCK, BK, BVALL)
        launch(_split_wu_kernel, (num_chunks, HV, BK // BW + BVALL // BW), k, v, beta, t, w_scale, w, u, tables.chunks,
               k_stride, v_stride, H=H, HV=HV, K=K, V=V, BT=chunk_size, BK=BK, BW=BW, DOT_PREC=dot_prec,
               num_warps=solve_num_warps)
    walk = functools.partial(_state_walk, k, w, u, gamma, k_scale, states, vn, k_stride=k_stride, H=H, HV=HV, K=K,
                             V=V, BT=chunk_size, BK=BK, BV=block_v, DOT_PREC=dot_prec, num_warps=num_warps,
                             num_stages=num_stages)
    if pieces == 1:
        walk(tables.walks["all"], tables.first_chunks["all"], h0, final)
    else:
        _segmented_state_walk(walk, tables, pieces, num_sequences, h0, final, HV=HV, K=K, V=V)
    if num_chunks:
        BVO = min(output_block_v, BVALL)
        launch(_split_output_kernel, (num_chunks, HV, triton.cdiv(V, BVO)), q, k, gamma, states, vn, o,
               tables.chunks, scale, q_stride, k_stride, H=H, HV=HV, K=K, V=V, BT=chunk_size, BK=BK, BV=BVO,
               USE_L2NORM=use_qk_l2norm, DOT_PREC=dot_prec, num_warps=output_num_warps)


def _solve_key_block(dtype: torch.dtype, BK: int) -> int:
    """Key columns per step of the solve kernel's K K^T: SOLVE_KEY_BLOCK for 16-bit inputs (the registers), all of
    them for float32 (tests only, the engine refuses float32 on a GPU): one product, so its results keep the bits
    of the one-kernel prep this replaced."""
    return BK if dtype == torch.float32 else min(SOLVE_KEY_BLOCK, BK)


def _pow2(dim: int) -> int:
    return max(16, triton.next_power_of_2(dim))


def _state_walk(k, w, u, gamma, k_scale, states, vn, walk_rows, first_chunk, h0, ht, *, k_stride, H, HV, K, V, BT,
                BK, BV, DOT_PREC, num_warps, num_stages, use_u=True, store_chunks=True, from_identity=False):
    """One launch of the state walk over the rows (sequences or segments) of walk_rows = (ranges, order)."""
    ranges, order = walk_rows
    NV = triton.cdiv(V, BV)
    launch(_split_state_kernel, (order.shape[0] * HV * NV,), k, w, u, gamma, k_scale, states, vn, h0, ht,
           ranges, order, first_chunk, K_STRIDE=k_stride, H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BV, NV=NV,
           USE_H0=h0 is not None, STORE_HT=ht is not None, DOT_PREC=DOT_PREC, USE_U=use_u, STORE_CHUNKS=store_chunks,
           H0_IDENTITY=from_identity, num_warps=num_warps, num_stages=num_stages)


def _segmented_state_walk(walk, tables: LaunchTables, pieces: int, num_sequences: int, h0, final, *,
                          HV: int, K: int, V: int) -> None:
    """chunk._segmented_walk for the state walk: the segments' local end states A (from zero, the first from the
    initial state) and transitions M (from the identity with U = 0), state only; their start states chained on
    the device (walk_layout.chain_segment_starts); then every segment walked from its true start, storing its
    chunk-start states and Vn (the output kernel reads those) and the final states."""
    N = num_sequences
    f32 = dict(dtype=torch.float32, device=tables.chunks.device)
    a_h0 = None
    if h0 is not None:
        a_h0 = torch.zeros((pieces - 1) * N, HV, K, V, **f32)
        a_h0[:N] = h0
    local = torch.empty((pieces - 1) * N, HV, K, V, **f32)
    walk(tables.walks["local"], tables.first_chunks["local"], a_h0, local, store_chunks=False)
    transition = torch.empty((pieces - 1) * N, HV, K, K, **f32)
    walk(tables.walks["transition"], tables.first_chunks["transition"], None, transition, V=K, use_u=False,
         store_chunks=False, from_identity=True)
    start = chain_segment_starts(local, transition, h0, pieces, N)
    ht = None if final is None else torch.empty(pieces * N, HV, K, V, **f32)
    walk(tables.walks["all"], tables.first_chunks["all"], start, ht)
    if final is not None:
        final.copy_(ht[(pieces - 1) * N:])
