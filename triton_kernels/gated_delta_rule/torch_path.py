"""Vectorised torch implementations of the gated delta rule, for CPU tensors when Triton is not used.

This is what the native engine runs on CPU, so it is chunked and batched rather than per-token.
Sequences are taken in cache-sized groups; within a group the in-chunk algebra runs once over every
chunk and head, and the walk over chunks advances all sequences that have chunks left in one batched
step. Math in float32.
"""
from __future__ import annotations

import torch

from triton_kernels import pointwise
from triton_kernels.gated_delta_rule.layout import Dims, SequenceLayout


def _flat_inputs(q, k, v, g, beta, d: Dims):
    """Token-major float32 views (no copy for float32 inputs): q, k [tokens, H, K], v [tokens, HV, V],
    g, beta [tokens, HV]."""
    f32 = torch.float32
    q, k = (x.reshape(-1, d.num_heads, d.head_k_dim).to(f32) for x in (q, k))
    v = v.reshape(-1, d.num_v_heads, d.head_v_dim).to(f32)
    g, beta = (x.reshape(-1, d.num_v_heads).to(f32) for x in (g, beta))
    return q, k, v, g, beta


def _row_factors(q, k, scale: float, use_qk_l2norm: bool):
    """What each row of q and k [tokens, H, K] is multiplied by: q's scale, and with use_qk_l2norm the
    l2 normalisation x * rsqrt(sum(x^2) + 1e-6), the formula and eps of transformers' l2norm (and
    fla's). [tokens, H] each; the rows are scaled where they are next copied, not in a pass of their own."""
    if not use_qk_l2norm:
        return torch.full(q.shape[:2], scale, device=q.device), torch.ones(k.shape[:2], device=k.device)
    rq, rk = (torch.linalg.vector_norm(x, dim=-1).square_().add_(1e-6).rsqrt_() for x in (q, k))
    return rq.mul_(scale), rk


def _start_states(initial_state, layout: SequenceLayout, d: Dims, order: list[int], device) -> torch.Tensor:
    """[N, HV, K, V] float32 states in `order` (a copy: the caller's tensor is never written)."""
    shape = (layout.num_sequences, d.num_v_heads, d.head_k_dim, d.head_v_dim)
    if initial_state is None:
        return torch.zeros(shape, dtype=torch.float32, device=device)
    return initial_state.to(torch.float32)[order]


def invert_unit_lower(A: torch.Tensor) -> torch.Tensor:
    """(I + strict_lower(A))^-1 for A [..., C, C] (A's diagonal and upper part are not read).

    LAPACK's triangular solve against I, batched. At 1 thread it beat the blocked nilpotent series of
    batched matmuls this path used before 2.1-3.8x: 141 vs 400 us for 88 x 32^2, 888 vs 1875 for
    4096 x 8^2, 3.6 vs 7.7 ms for 528 x 64^2 (bench/cpu_op_costs.py). An earlier note saw the solve slow
    down 100-fold on a contended machine; checked ad hoc on this VM, both forms slowed down sharply only
    when processes asked for more threads than there were cores (the series more), which workers do not
    by default (the cores are divided among them).
    """
    C = A.shape[-1]
    return torch.linalg.solve_triangular(A, torch.eye(C, dtype=A.dtype, device=A.device), upper=False,
                                         unitriangular=True)


# torch's vectorised float32 exp leaves its fast path for arguments whose result is denormal or
# underflows (below about -87.3): 14-36 ns an element against 0.3 ns (bench/cpu_op_costs.py), enough to
# make the decays the slowest part of a chunk. The decays span that range whenever gates are strongly
# negative, so arguments are clamped first. exp(-87) = 1.6e-38, just above the smallest normal float32,
# changes nothing an output can see; the upper clamp only touches entries that are masked or inf.
EXP_RANGE = (-87.0, 88.0)


def _exp_(x: torch.Tensor) -> torch.Tensor:
    """exp of x, in place, with x clamped to EXP_RANGE (position-independent under pointwise.batch_invariant)."""
    return pointwise.exp_(x.clamp_(*EXP_RANGE))


# Sequences are processed in groups: enough chunks to batch the matmuls, few enough that the in-chunk
# tensors and the group's states stay in cache. A group closes at GROUP_BYTES per [chunks, HV, C, C]
# float32 tensor (one group for everything is ~1.7x slower at 64 sequences x 8 heads x 128^2), or
# earlier, at MIN_GROUP_BYTES, once each walk step already has STEP_MACS multiply-adds per matmul
# (sequences x HV x C x K x V) to carry its per-call overhead. ms of delta rule per layer, 1 thread
# (bench/profile_cpu_layers.py [--model demo] [--batch longest|shortest] [--delta-min-group-bytes 1e12]),
# closing at GROUP_BYTES only /
# also early: the 1/8 Qwen3.5 (HV 8, K = V = 64, chunk 32) 59.0 / 52.4 on 12 sequences of ~330 tokens
# (one sequence a group), 121.8 / 117.5 on the 4 longest, 67.2 / 58.6 on the shortest 4k tokens; the
# demo model (HV 4, K = V = 16, chunk 8: tiny walk steps, never closed early) unchanged.
GROUP_BYTES = 2 << 20
MIN_GROUP_BYTES = 256 << 10
STEP_MACS = 1 << 20


def _sequence_groups(lengths: list[int], order: list[int], C: int, d: Dims) -> list[tuple[int, int]]:
    """Cut `order` (longest first) into [start, stop) position ranges (see GROUP_BYTES)."""
    groups, start, chunks = [], 0, 0
    step_macs = d.num_v_heads * C * d.head_k_dim * d.head_v_dim   # per sequence in a walk step
    for i, n in enumerate(order):
        chunks += -(-lengths[n] // C)
        size = chunks * d.num_v_heads * C * C * 4
        if (size >= GROUP_BYTES or (size >= MIN_GROUP_BYTES and (i + 1 - start) * step_macs >= STEP_MACS)
                or i == len(order) - 1):
            groups.append((start, i + 1))
            start, chunks = i + 1, 0
    return groups


def chunk_fwd_torch(q, k, v, g, beta, *, scale: float, initial_state, output_final_state: bool,
                    layout: SequenceLayout, dims: Dims, use_qk_l2norm: bool, chunk_size: int,
                    batch_invariant: bool = False):
    """Chunked form (see REFERENCE.md); returns o [B, T, HV, V] in q's dtype and the final states or None.
    batch_invariant: chunks of exactly chunk_size (see chunk_gated_delta_rule)."""
    with pointwise.batch_invariant(batch_invariant or pointwise.enabled()):
        return _chunk_fwd(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                          output_final_state=output_final_state, layout=layout, dims=dims,
                          use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size, batch_invariant=batch_invariant)


def _chunk_fwd(q, k, v, g, beta, *, scale, initial_state, output_final_state, layout, dims, use_qk_l2norm,
               chunk_size, batch_invariant):
    d = dims
    out_dtype, device = q.dtype, q.device
    q, k, v, g, beta = _flat_inputs(q, k, v, g, beta, d)
    rq, rk = _row_factors(q, k, scale, use_qk_l2norm)
    tokens = q.shape[0]
    o = q.new_empty(tokens + 1, d.num_v_heads, d.head_v_dim)   # row `tokens` takes chunk padding's rows
    order = layout.longest_first()
    S = _start_states(initial_state, layout, d, order, device)
    lengths = layout.lengths
    for start, stop in _sequence_groups(lengths, order, chunk_size, d):
        members = order[start:stop]
        # The result does not depend on the chunk size (up to rounding): groups of short sequences use a
        # smaller one, unless the rounding must not depend on the group.
        C = chunk_size if batch_invariant else min(chunk_size, lengths[members[0]])
        if lengths[members[0]] > 0:
            _chunk_group(q, k, v, g, beta, rq, rk, o, S[start:stop], layout, members, C, d)
    o = o[:tokens].reshape(d.batch, d.seq_len, d.num_v_heads, d.head_v_dim).to(out_dtype)
    return o, (_unsort(S, order) if output_final_state else None)


def _chunk_group(q, k, v, g, beta, rq, rk, o, S, layout: SequenceLayout, members: list[int], C: int, d: Dims):
    """Run the sequences `members` (longest first) from states S (updated in place), writing rows of o.
    q and k are raw; rq, rk [tokens, H] are their row factors (see _row_factors)."""
    H, HV, G = d.num_heads, d.num_v_heads, d.num_v_heads // d.num_heads
    device = q.device
    # Chunks laid out step-major: every member's first chunk, then every second chunk, ... so step i is
    # one contiguous slice of chunks whose sequences are a prefix of `members` (and of S).
    lengths = layout.lengths
    bounds, steps = [], []
    for i in range(-(-lengths[members[0]] // C)):
        first = len(bounds)
        for n in members:
            if lengths[n] <= i * C:
                break  # longest first: no later member has an i-th chunk either
            bos = layout.bounds[n] + i * C
            bounds.append((bos, min(bos + C, layout.bounds[n + 1])))
        steps.append((first, len(bounds)))
    bounds_t = torch.tensor(bounds, dtype=torch.long, device=device)
    pos = bounds_t[:, :1] + torch.arange(C, device=device)
    pad = pos >= bounds_t[:, 1:]                      # [chunks, C]: rows past a sequence's end
    NC, tokens = pos.shape[0], q.shape[0]
    # Padding rows read their chunk's last real row; their k rows and g are zeroed, so they add nothing
    # to the state or to gamma_last, and causality keeps them out of real rows. Their outputs go to o's
    # spare last row.
    read_pos = torch.minimum(pos, bounds_t[:, 1:] - 1)
    any_pad = bool(pad.any())

    rows = read_pos.flatten()

    def pack(x):  # [tokens, ...] -> [chunks, C, ...]: whole rows gathered
        return x.index_select(0, rows).view(NC, C, *x.shape[1:])

    def pack_scaled(x, factor):
        """x [tokens, heads, D] times factor [chunks, C, heads] -> [chunks, heads, C, D]: the gathered
        rows are scaled as they are written transposed, one pass for both."""
        out = x.new_empty(NC, x.shape[1], C, x.shape[2])
        torch.mul(pack(x), factor[..., None], out=out.transpose(1, 2))
        return out

    def grouped(x):  # [chunks, HV, ...] -> [chunks, H, G, ...]: value head j = (key head j // G, j % G)
        return x.view(NC, H, G, *x.shape[2:])

    gc, bc = (pack(x).transpose(1, 2).contiguous() for x in (g, beta))  # [chunks, HV, C]
    fk = pack(rk)
    if any_pad:
        fk.masked_fill_(pad[..., None], 0.0)
        gc.masked_fill_(pad[:, None, :], 0.0)
    qc, kc = pack_scaled(q, pack(rq)), pack_scaled(k, fk)
    vb = pack_scaled(v, pack(beta))                                    # v * beta
    gamma = gc.cumsum(-1)
    gamma_last = gamma[..., -1:]  # padded rows have g = 0, so this is the last real row's gamma
    # exp(gamma_i - gamma_j) where i >= j, zero above the diagonal.
    decay = _exp_(gamma[..., :, None] - gamma[..., None, :]).tril_()   # tril_, not a masked_fill_ with a broadcast mask: cheaper

    # A = diag(beta) K K^T * decay (its strict lower part is the system), T = (I + A)^-1. beta scales
    # the keys on the left of K K^T, which is cheaper than scaling the C x C product.
    kb = kc[:, :, None] * grouped(bc[..., None])                      # [chunks, H, G, C, K]
    A = (kb @ kc[:, :, None].mT).mul_(grouped(decay)).view(NC, HV, C, C)
    P = ((qc @ kc.mT)[:, :, None] * grouped(decay)).view(NC, HV, C, C)  # q already carries scale
    T = invert_unit_lower(A)
    decay_in = _exp_(gamma.clone())[..., None]                         # decay from the chunk start
    W = T @ (kb * grouped(decay_in)).view(NC, HV, C, -1)
    U = T @ vb
    q_decayed = (qc[:, :, None] * grouped(decay_in)).view(NC, HV, C, -1)
    k_decayed = (kc[:, :, None] * grouped(_exp_(gamma_last - gamma)[..., None])).view(NC, HV, C, -1)
    chunk_decay = _exp_(gamma_last.clone())                              # [chunks, HV, 1]
    out = _walk(S, steps, W, U, P, q_decayed, k_decayed, chunk_decay)
    write_pos = pos.masked_fill(pad, tokens) if any_pad else pos
    # Indexed by [chunks, C] with the transposed view as the value: one strided pass, where reshaping the
    # transpose first would copy it.
    o[write_pos] = out.transpose(1, 2)


def _walk(S, steps, W, U, P, q_decayed, k_decayed, chunk_decay):
    """The chunk walk, one step per chunk index: each step advances every member with a chunk there.
    Four batched matmuls and one scaling a step, in place (a step's tensors are small: overhead counts)."""
    HV, K, V = W.shape[1], W.shape[3], U.shape[3]
    out = torch.empty_like(U)
    W3, U3, P3, Q3, O3 = (x.flatten(0, 1) for x in (W, U, P, q_decayed, out))   # [chunks * HV, ., .]
    Kt3, decay3, S3 = k_decayed.flatten(0, 1).mT, chunk_decay.reshape(-1, 1, 1), S.view(-1, K, V)
    for first, end in steps:
        a, b = first * HV, end * HV
        S_a = S3[: b - a]
        v_new = torch.baddbmm(U3[a:b], W3[a:b], S_a, alpha=-1)          # U - W S
        torch.bmm(Q3[a:b], S_a, out=O3[a:b]).baddbmm_(P3[a:b], v_new)  # q_d S + P v_new
        S_a.mul_(decay3[a:b]).baddbmm_(Kt3[a:b], v_new)                 # decay S + K_d^T v_new
    return out


def recurrent_fwd_torch(q, k, v, g, beta, *, scale: float, initial_state, output_final_state: bool,
                        layout: SequenceLayout, dims: Dims, use_qk_l2norm: bool, state_indices=None):
    """Token-by-token form, batched over sequences and heads (decode is one step for all sequences).
    With state_indices [N], initial_state is the state pool: read from and written back to those slots."""
    d = dims
    group = d.num_v_heads // d.num_heads
    out_dtype, device = q.dtype, q.device
    q, k, v, g, beta = _flat_inputs(q, k, v, g, beta, d)
    rq, rk = _row_factors(q, k, scale, use_qk_l2norm)
    q, k = q * rq[..., None], k * rk[..., None]
    if group > 1:
        q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    order = layout.longest_first()
    if state_indices is not None:
        slots = state_indices.to(device=device, dtype=torch.long)[order]
        S = initial_state[slots]
    else:
        S = _start_states(initial_state, layout, d, order, device)
    o = torch.zeros_like(v)
    all_lengths = layout.lengths   # a list built per access: once, not once per sequence
    lengths = [all_lengths[n] for n in order]
    starts = torch.tensor([layout.bounds[n] for n in order], dtype=torch.long, device=device)
    for t in range(max(lengths, default=0)):
        active = sum(1 for n in lengths if n > t)
        tok = starts[:active] + t
        S_a = S[:active] * _exp_(g[tok])[..., None, None]
        kt = k[tok]
        u = beta[tok][..., None] * (v[tok] - torch.einsum("nhkv,nhk->nhv", S_a, kt))
        S_a = S_a + kt[..., :, None] * u[..., None, :]
        o[tok] = torch.einsum("nhkv,nhk->nhv", S_a, q[tok])
        S[:active] = S_a
    o = o.reshape(d.batch, d.seq_len, d.num_v_heads, d.head_v_dim).to(out_dtype)
    if state_indices is not None:
        initial_state[slots] = S
        return o, None
    return o, (_unsort(S, order) if output_final_state else None)


def _unsort(S: torch.Tensor, order: list[int]) -> torch.Tensor:
    out = torch.empty_like(S)
    out[order] = S
    return out
