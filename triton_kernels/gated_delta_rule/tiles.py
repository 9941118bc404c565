"""Tile loads and stores shared by both delta-rule designs (chunk.py's fused kernels and split.py's):
token-major row tiles, [K, V] state tiles, per-row norms and per-token vectors, as Triton helpers."""
import triton
import triton.language as tl


@triton.jit
def _rows_ptrs(ptr, row0, row_end, head, NUM_HEADS: tl.constexpr, D: tl.constexpr,
               BR: tl.constexpr, BD: tl.constexpr, col0):
    """Pointers and mask of the [BR, BD] tile at rows row0.., columns col0.. of a token-major
    [tokens, NUM_HEADS, D] tensor. The 64-bit part of the offset lives in the scalar base, so the
    per-element offsets stay int32 (half the registers of an int64 tile)."""
    base = ptr + (row0 * NUM_HEADS + head) * D  # row0 is int64 in every caller
    rows = tl.arange(0, BR)
    cols = col0 + tl.arange(0, BD)
    mask = (rows < row_end - row0)[:, None]
    if BD != D:  # only padded or partial column blocks need a column mask
        mask = mask & (cols < D)[None, :]
    return base + rows[:, None] * (NUM_HEADS * D) + cols[None, :], mask


@triton.jit
def _load_rows(ptr, row0, row_end, head, NUM_HEADS: tl.constexpr, D: tl.constexpr,
               BR: tl.constexpr, BD: tl.constexpr, col0=0):
    """[BR, BD] tile of a token-major [tokens, NUM_HEADS, D] tensor, zero outside rows < row_end, cols < D."""
    ptrs, mask = _rows_ptrs(ptr, row0, row_end, head, NUM_HEADS, D, BR, BD, col0)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _load_token_rows(ptr, row_stride, row0, row_end, head, D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
                     col0=0):
    """_load_rows for an input whose tokens are `row_stride` elements apart (q, k, v: possibly column views of
    the conv's output [tokens, 2 * key_dim + value_dim]); within a token, heads then channels are contiguous
    (head h's columns at h * D..). Zero outside rows < row_end, cols < D. The 64-bit part of the offset is the
    scalar base, as in _rows_ptrs; the [BR, BD] offsets are int32 (the launchers keep BR * row_stride < 2**31)."""
    base = ptr + (row0 * row_stride + head * D)  # row0 is int64 in every caller
    rows = tl.arange(0, BR)
    cols = col0 + tl.arange(0, BD)
    mask = (rows < row_end - row0)[:, None]
    if BD != D:
        mask = mask & (cols < D)[None, :]
    return tl.load(base + rows[:, None] * row_stride + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _store_rows(ptr, value, row0, row_end, head, NUM_HEADS: tl.constexpr, D: tl.constexpr,
                BR: tl.constexpr, BD: tl.constexpr, col0=0):
    ptrs, mask = _rows_ptrs(ptr, row0, row_end, head, NUM_HEADS, D, BR, BD, col0)
    tl.store(ptrs, value.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_state(h0, i_n, i_hv, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr, v0):
    """Columns v0.. (BV of them) of state [i_n, i_hv] of a [N, HV, K, V] float32 tensor."""
    base = h0 + (i_n * HV + i_hv).to(tl.int64) * (K * V)
    o_k = tl.arange(0, BK)
    o_v = v0 + tl.arange(0, BV)
    if BK == K and V % BV == 0:
        return tl.load(base + (o_k[:, None] * V + o_v[None, :]))
    return tl.load(base + (o_k[:, None] * V + o_v[None, :]), mask=(o_k < K)[:, None] & (o_v < V)[None, :], other=0.0)


@triton.jit
def _store_state(ht, S, i_n, i_hv, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 BK: tl.constexpr, BV: tl.constexpr, v0):
    """Inverse of _load_state. Its addresses are built in another order on purpose: identical
    expressions would be merged with the load's, keeping a [BK, BV] offset tile alive in registers
    across the whole chunk loop (it made the walk kernel spill)."""
    o_k = tl.arange(0, BK)
    o_v = v0 + tl.arange(0, BV)
    rows = ht + (i_n * HV + i_hv).to(tl.int64) * (K * V) + o_k[:, None] * V
    if BK == K and V % BV == 0:
        tl.store(rows + o_v[None, :], S)
    else:
        tl.store(rows + o_v[None, :], S, mask=(o_v < V)[None, :] & (o_k < K)[:, None])


@triton.jit
def _inv_norms(x, USE_L2NORM: tl.constexpr):
    """Per-row 1 / sqrt(sum(x^2) + 1e-6) (transformers' and fla's l2norm), or ones without l2norm.

    The kernels apply l2norm as row and column scales of products (q k^T, q S, k^T Vn) instead of
    normalising tiles: no second copy of a [64, K] tile in registers, and no rounding of q / |q|."""
    if USE_L2NORM:
        xf = x.to(tl.float32)
        return tl.rsqrt(tl.sum(xf * xf, axis=1) + 1e-6)
    return tl.full([x.shape[0]], 1.0, tl.float32)


@triton.jit
def _load_vec(ptr, row0, eos, i_hv, HV: tl.constexpr, BC: tl.constexpr):
    """[BC] float32 of a [tokens, HV] tensor at rows row0.. of head i_hv, zero from eos on."""
    rows = row0 + tl.arange(0, BC).to(tl.int64)
    return tl.load(ptr + rows * HV + i_hv, mask=rows < eos, other=0.0).to(tl.float32)


@triton.jit
def _walk_program(seq_order, seq_ranges, H: tl.constexpr, HV: tl.constexpr, NV: tl.constexpr, BV: tl.constexpr):
    """What a walk program walks, from its index in the flat, sequence-major grid (every head of the longest
    sequence first): (sequence, value head, key head, first and end token, first V column)."""
    pid = tl.program_id(0)
    i_n = tl.load(seq_order + pid // (HV * NV))
    i_hv = (pid // NV) % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(seq_ranges + 2 * i_n).to(tl.int64)
    eos = tl.load(seq_ranges + 2 * i_n + 1).to(tl.int64)
    return i_n, i_hv, i_h, bos, eos, (pid % NV) * BV


@triton.jit
def _start_state(h0, i_n, i_hv, v0, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                 BV: tl.constexpr, USE_H0: tl.constexpr, H0_IDENTITY: tl.constexpr):
    """A walk's [BK, BV] float32 start state: the identity's columns v0.. (a segment's transition matrix,
    V = K), the given state's, or zeros."""
    if H0_IDENTITY:
        o_k = tl.arange(0, BK)
        S = ((o_k[:, None] == (v0 + tl.arange(0, BV))[None, :]) & (o_k < K)[:, None]).to(tl.float32)
    elif USE_H0:
        S = _load_state(h0, i_n, i_hv, HV, K, V, BK, BV, v0)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
    return S
