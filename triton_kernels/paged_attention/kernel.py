"""Triton kernels of paged attention: the attention walk over the block table, the split-KV reduce, and
the KV-cache write.

Program (q block, KV head, split): rows = block_q query tokens x the Hq/Hkv query heads of one KV head
(GQA packing), walked over KV tiles of pages_per_tile pages with an online softmax in float32 (base 2),
optionally with T5's relative-position bias added to the scores.

CONTIGUOUS_KV: the keys and values are the step's own `[T, Hkv, D]` rows (any token stride), sequence s's at
its query rows: a step whose sequences have no earlier tokens (an encoder's) attends straight from the QKV
projection, with no cache write and no block-table gather (varlen.py).
"""
import torch
import triton
import triton.language as tl

from .._launch import launch
from .launch import PagedAttentionLaunch
from .position_bias import bucket_shape, bucket_table

LOG2E = 1.4426950408889634


@triton.jit
def _find_sequence(cu_seqlens_q_ptr, num_seqs, pid, BLOCK_Q: tl.constexpr):
    """Largest s with cu_seqlens_q[s] // BLOCK_Q + s <= pid: the sequence whose q blocks hold program pid.

    Sequence s owns programs [cu[s] // BLOCK_Q + s, cu[s + 1] // BLOCK_Q + s + 1), at least
    ceil(q_len / BLOCK_Q) of them, so the grid needs no host-side table and no device-to-host sync.
    """
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if start <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _relative_bias(q_pos, offs_n, head, bias_ptr, buckets_ptr, stride_bias,
                   HALF: tl.constexpr, MAX_DISTANCE: tl.constexpr):
    """T5's bidirectional relative-position bias of the tile `[BLOCK_M, TILE]`, float32: each key's offset
    from its row's query, its bucket from the lookup by distance (position_bias.bucket_table, distances past
    MAX_DISTANCE share the last entry's bucket), the upper HALF of the buckets for keys after the query,
    and the table's entry for the row's head."""
    offset = offs_n[None, :] - q_pos[:, None]
    bucket = tl.load(buckets_ptr + tl.minimum(tl.abs(offset), MAX_DISTANCE)) + tl.where(offset > 0, HALF, 0)
    return tl.load(bias_ptr + bucket * stride_bias + head[:, None]).to(tl.float32)


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, tile, bt_row_ptr, k_cache_ptr, v_cache_ptr, kv_head, kv_len, q_pos, offs_d,
    stride_kp, stride_ko, stride_kh, stride_vp, stride_vo, stride_vh, qk_scale,
    head, bias_ptr, buckets_ptr, stride_bias,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, TILE: tl.constexpr,
    CAUSAL: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr, HALF: tl.constexpr, MAX_DISTANCE: tl.constexpr, CONTIGUOUS_KV: tl.constexpr,
):
    """One online-softmax step over keys [tile * TILE, (tile + 1) * TILE) of one sequence.

    MASKED=False is for tiles every row sees whole (the bulk of the walk): no position masks at all.
    HAS_BIAS adds T5's relative-position bias (in log2 units, as the scores are).
    """
    offs_n = tile * TILE + tl.arange(0, TILE)
    key_ok = offs_n < kv_len
    if HAS_BIAS:   # before the scores exist: its integer temporaries and the scores are never live together
        bias = _relative_bias(q_pos, offs_n, head, bias_ptr, buckets_ptr, stride_bias, HALF,
                              MAX_DISTANCE) * 1.4426950408889634   # log2(e)
    if CONTIGUOUS_KV:   # bt_row_ptr is the sequence's first token; the "page" stride is the token stride
        page = bt_row_ptr + offs_n
        slot = offs_n * 0
    elif MASKED:
        page = tl.load(bt_row_ptr + offs_n // PAGE_SIZE, mask=key_ok, other=0).to(tl.int64)
        slot = offs_n % PAGE_SIZE
    else:
        page = tl.load(bt_row_ptr + offs_n // PAGE_SIZE).to(tl.int64)
        slot = offs_n % PAGE_SIZE
    k_ptrs = (k_cache_ptr + page[None, :] * stride_kp + slot[None, :] * stride_ko + kv_head * stride_kh
              + offs_d[:, None])
    v_ptrs = (v_cache_ptr + page[:, None] * stride_vp + slot[:, None] * stride_vo + kv_head * stride_vh
              + offs_d[None, :])
    if MASKED:
        k = tl.load(k_ptrs, mask=(offs_d[:, None] < HEAD_DIM) & key_ok[None, :], other=0.0)
    elif BLOCK_D != HEAD_DIM:
        k = tl.load(k_ptrs, mask=offs_d[:, None] < HEAD_DIM, other=0.0)
    else:
        k = tl.load(k_ptrs)

    s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE], log2 units
    if HAS_BIAS:
        s += bias
    if MASKED:
        visible = key_ok[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no key yet keeps m = -inf; shift by 0 so exp2 gives 0 instead of NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_shift[:, None])
    alpha = tl.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)

    if MASKED:
        v = tl.load(v_ptrs, mask=key_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    elif BLOCK_D != HEAD_DIM:
        v = tl.load(v_ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    else:
        v = tl.load(v_ptrs)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, m_new, l_i


# Batch sizes are not specialised on (Triton would compile a variant for 1 and for multiples of 16):
# only the knobs and the model's shapes pick a variant, so few ever compile during a run.
@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "num_q_programs"])
def _paged_attention_fwd(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_o_ptr, part_ml_ptr,
    block_tables_ptr, cu_seqlens_q_ptr, kv_lens_ptr, bias_ptr, buckets_ptr,
    num_seqs, num_tokens, num_q_programs, qk_scale,
    stride_qt, stride_qh, stride_kp, stride_ko, stride_kh, stride_vp, stride_vo, stride_vh,
    stride_ot, stride_oh, stride_bt, stride_bias,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, PAGE_SIZE: tl.constexpr, TILE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr, HALF: tl.constexpr, MAX_DISTANCE: tl.constexpr, CONTIGUOUS_KV: tl.constexpr,
):
    # Axis 0 is (query block, KV head) with the head fastest and the query blocks in reverse, so the
    # longest causal walks (a sequence's last blocks) start first and short ones fill the tail.
    pid_q = num_q_programs - 1 - tl.program_id(0) // NUM_KV_HEADS
    kv_head = tl.program_id(0) % NUM_KV_HEADS
    split = tl.program_id(1)

    seq = _find_sequence(cu_seqlens_q_ptr, num_seqs, pid_q, BLOCK_Q)
    q_begin = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_begin
    q_first = (pid_q - (q_begin // BLOCK_Q + seq)) * BLOCK_Q  # first query index of this block
    if q_first >= q_len:
        return
    kv_len = tl.load(kv_lens_ptr + seq)
    context = kv_len - q_len  # position of the sequence's first new token

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_first + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = context + q_idx
    token = (q_begin + q_idx).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # Tiles this program walks: causal stops after the block's last query position.
    if CAUSAL:
        kv_stop = tl.minimum(context + q_first + BLOCK_Q, kv_len)
        full_stop = (context + q_first + 1) // TILE  # tiles every row sees whole
    else:
        kv_stop = kv_len
        full_stop = kv_len // TILE
    num_tiles = tl.cdiv(kv_stop, TILE)
    per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * per_split
    tile_hi = tl.minimum(tile_lo + per_split, num_tiles)
    tile_mid = tl.maximum(tl.minimum(full_stop, tile_hi), tile_lo)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if CONTIGUOUS_KV:
        bt_row_ptr = (q_begin - context).to(tl.int64)
    else:
        bt_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_mid):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, tile, bt_row_ptr, k_cache_ptr, v_cache_ptr, kv_head, kv_len, q_pos, offs_d,
            stride_kp, stride_ko, stride_kh, stride_vp, stride_vo, stride_vh, qk_scale,
            head, bias_ptr, buckets_ptr, stride_bias,
            HEAD_DIM, BLOCK_D, PAGE_SIZE, TILE, CAUSAL, False, DOT_PRECISION,
            HAS_BIAS, HALF, MAX_DISTANCE, CONTIGUOUS_KV)
    for tile in range(tile_mid, tile_hi):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, tile, bt_row_ptr, k_cache_ptr, v_cache_ptr, kv_head, kv_len, q_pos, offs_d,
            stride_kp, stride_ko, stride_kh, stride_vp, stride_vo, stride_vh, qk_scale,
            head, bias_ptr, buckets_ptr, stride_bias,
            HEAD_DIM, BLOCK_D, PAGE_SIZE, TILE, CAUSAL, True, DOT_PRECISION,
            HAS_BIAS, HALF, MAX_DISTANCE, CONTIGUOUS_KV)

    # Rows of an empty split (l = 0) store 0 with weight 0 for the reduce.
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        # Partial results: o [NUM_SPLITS, T, Hq, HEAD_DIM] and (m, l) [NUM_SPLITS, T, Hq, 2], float32.
        part_row = (split * num_tokens + token) * NUM_Q_HEADS + head
        tl.store(part_o_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :], o,
                 mask=row_ok[:, None] & d_ok[None, :])
        tl.store(part_ml_ptr + part_row * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part_row * 2 + 1, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["num_tokens"])
def _combine_splits(
    part_o_ptr, part_ml_ptr, out_ptr, num_tokens, stride_ot, stride_oh,
    NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """out[t, h] = sum_s w_s o_s / sum_s w_s with w_s = l_s * 2^(m_s - max m): the split walks merged."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NUM_SPLITS
    part_row = (offs_s * num_tokens + token) * NUM_Q_HEADS + head
    m = tl.load(part_ml_ptr + part_row * 2, mask=s_ok, other=float("-inf"))
    l = tl.load(part_ml_ptr + part_row * 2 + 1, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    w = l * tl.exp2(m - m_max)
    o = tl.load(part_o_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :],
                mask=s_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    o = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def paged_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor, kv_lens: torch.Tensor, out: torch.Tensor, *, causal: bool, scale: float,
    knobs: PagedAttentionLaunch, rel_bias_table: torch.Tensor | None = None, rel_max_distance: int | None = None,
    contiguous_kv: bool = False,
) -> torch.Tensor:
    """Launch the attention kernel (and the reduce when knobs.num_kv_splits > 1); fills and returns out.

    Expects validated inputs with a unit stride on the head dim (see attention.paged_attention), and a
    relative-position bias table `[num_buckets, Hq]` with a unit stride on heads when one is given.
    contiguous_kv (varlen.py): k_cache and v_cache are the step's keys and values viewed as `[1, T, Hkv, D]`
    (page stride unused, "slot" stride the token stride), block_tables unused, tiles of knobs.pages_per_tile x 16
    keys.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = (16 if contiguous_kv else k_cache.shape[1]), k_cache.shape[2]
    num_seqs = block_tables.shape[0]
    group = num_q_heads // num_kv_heads
    block_m = max(16, triton.next_power_of_2(knobs.block_q * group))
    block_d = max(16, triton.next_power_of_2(head_dim))   # tl.dot's least K; a smaller head dim is masked
    splits = knobs.num_kv_splits
    if splits > 1:
        part_o = torch.empty((splits, num_tokens, num_q_heads, head_dim), device=q.device, dtype=torch.float32)
        part_ml = torch.empty((splits, num_tokens, num_q_heads, 2), device=q.device, dtype=torch.float32)
    else:
        part_o = part_ml = out  # unused by the kernel when NUM_SPLITS == 1
    # float32 inputs ask for true float32 products, not TF32 (which would cost ~1e-3 relative error).
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    # Sequence s owns q programs [cu[s] // block_q + s, cu[s + 1] // block_q + s + 1) (see _find_sequence).
    num_q_programs = num_tokens // knobs.block_q + num_seqs
    grid = (num_q_programs * num_kv_heads, splits)
    if rel_bias_table is None:
        bias = buckets = kv_lens   # unused by the kernel without HAS_BIAS
        half = max_distance = 0
    else:
        bias, half, max_distance = rel_bias_table, bucket_shape(rel_bias_table.shape[0])[0], rel_max_distance
        buckets = bucket_table(rel_bias_table.shape[0], rel_max_distance, q.device)
    # Contiguous keys: the kernel's page stride is the token stride (its slot offset is always 0).
    kv_strides = ((k_cache.stride(1), 0, k_cache.stride(2), v_cache.stride(1), 0, v_cache.stride(2)) if contiguous_kv
                  else (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)))
    launch(_paged_attention_fwd, grid,
           q, k_cache, v_cache, out, part_o, part_ml, block_tables, cu_seqlens_q, kv_lens, bias, buckets,
           num_seqs, num_tokens, num_q_programs, scale * LOG2E,
           q.stride(0), q.stride(1), *kv_strides, out.stride(0), out.stride(1),
           block_tables.stride(0), bias.stride(0),
           NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, GROUP=group,
           BLOCK_Q=knobs.block_q, BLOCK_M=block_m, PAGE_SIZE=page_size, TILE=knobs.pages_per_tile * page_size,
           NUM_SPLITS=splits, CAUSAL=causal, DOT_PRECISION=precision,
           HAS_BIAS=rel_bias_table is not None, HALF=half, MAX_DISTANCE=max_distance, CONTIGUOUS_KV=contiguous_kv,
           num_warps=knobs.num_warps, num_stages=knobs.num_stages)
    if splits > 1:
        launch(_combine_splits, (num_tokens, num_q_heads),
               part_o, part_ml, out, num_tokens, out.stride(0), out.stride(1),
               NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
               NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits),
               num_warps=4 if head_dim >= 128 else 2)
    return out


@triton.jit
def _write_kv_cache(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcp, stride_kco, stride_kch, stride_vcp, stride_vco, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr,
):
    """Program (token, chunk): copies BLOCK elements of the token's [Hkv, D] row; negative slots skip."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = e < NUM_KV_HEADS * HEAD_DIM
    head = e // HEAD_DIM
    d = e % HEAD_DIM
    k = tl.load(k_ptr + token * stride_kt + head * stride_kh + d, mask=ok)
    v = tl.load(v_ptr + token * stride_vt + head * stride_vh + d, mask=ok)
    tl.store(k_cache_ptr + page * stride_kcp + offset * stride_kco + head * stride_kch + d,
             k.to(k_cache_ptr.dtype.element_ty), mask=ok)
    tl.store(v_cache_ptr + page * stride_vcp + offset * stride_vco + head * stride_vch + d,
             v.to(v_cache_ptr.dtype.element_ty), mask=ok)


def write_kv_cache_triton(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    *, block: int,
) -> None:
    """Launch the cache write; expects validated inputs (see kv_cache.write_kv_cache)."""
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    num_tokens, num_kv_heads, head_dim = k.shape
    block = min(block, triton.next_power_of_2(num_kv_heads * head_dim))
    grid = (num_tokens, triton.cdiv(num_kv_heads * head_dim, block))
    launch(_write_kv_cache, grid,
           k, v, k_cache, v_cache, slot_mapping.contiguous(),
           k.stride(0), k.stride(1), v.stride(0), v.stride(1),
           k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
           v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
           NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=k_cache.shape[1], BLOCK=block,
           num_warps=4)
