"""Paged attention in plain torch, for CPU engines: per sequence, gather its pages and call SDPA.

This is the path production runs on CPU (no Triton), so it avoids per-token work: one index_select of
the sequence's pages, GQA without copies of K/V per query head (enable_gqa, or heads packed as rows for
decode), and a mask only where one is needed (causal with 1 < q_len < kv_len: chunked-prefill
continuations; T5's relative-position bias, read through a strided view rather than built per query).
"""
import contextlib

import torch
import torch.nn.functional as F

from .position_bias import bias_by_offset


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """q `[q_len, Hq, D]`, k/v `[kv_len, Hkv, D]` of one sequence, its new tokens last -> `[q_len, Hq, D]`.
    bias (bidirectional only): `[Hq, 2 * kv_len - 1]` from position_bias.bias_by_offset."""
    q_len, num_q_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[0], k.shape[1]
    k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if bias is not None:
        return _attend_with_bias(q, k, v, bias, scale=scale)
    if q_len == 1:
        # Decode sees every key. The query heads of one KV head become rows of one [G, D] query (a free
        # view for the usual layouts), ~2-3x faster on CPU than SDPA's enable_gqa for a single query.
        o = F.scaled_dot_product_attention(q.reshape(1, num_kv_heads, -1, head_dim), k, v, scale=scale)
        return o.view(1, num_q_heads, head_dim)
    mask, is_causal = None, False
    if causal and q_len == kv_len:
        is_causal = True  # SDPA's top-left aligned causal mask is the right one when q covers all of kv
    elif causal:
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
        mask = torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None]
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, attn_mask=mask, is_causal=is_causal,
                                       scale=scale, enable_gqa=num_kv_heads != num_q_heads)
    return o[0].transpose(0, 1)


def _attend_with_bias(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, *,
                      scale: float) -> torch.Tensor:
    """Bidirectional attention plus a relative-position bias, without building the `[Hq, q_len, kv_len]` mask.

    The bias of query i (position p) and key j is bias[:, kv_len - 1 + j - p], constant along diagonals. With
    the queries in reverse order, row i' is position kv_len - 1 - i' and the entry is bias[:, i' + j]: a view
    of bias with unit strides on both axes, which SDPA's CPU kernel reads as it is (as fast as no mask at
    all for 400 tokens x 32 heads of 128, where the materialised mask cost 4 ms more per call)."""
    q_len, num_q_heads = q.shape[0], q.shape[1]
    kv_len = k.shape[2]
    assert bias.shape == (num_q_heads, 2 * kv_len - 1) and (bias.stride(1) == 1 or kv_len == 1), bias.stride()
    mask = bias.as_strided((1, num_q_heads, q_len, kv_len), (0, bias.stride(0), 1, 1), bias.storage_offset())
    o = F.scaled_dot_product_attention(q.flip(0).transpose(0, 1)[None], k, v, attn_mask=mask, scale=scale,
                                       enable_gqa=k.shape[1] != num_q_heads)
    return o[0].transpose(0, 1).flip(0)


def _same_length_run(starts: list[int], lens: list[int], s: int) -> int:
    """How many sequences from s on have no earlier tokens (q_len == kv_len) and s's length."""
    n = 0
    while s + n < len(lens) and lens[s + n] == lens[s] == starts[s + n + 1] - starts[s + n] > 0:
        n += 1
    return n


def _attend_same_length(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int, *, scale: float) -> torch.Tensor:
    """Bidirectional attention of n whole sequences of one length, q `[n * L, Hq, D]`, k/v `[n * L, Hkv, D]`, as one
    SDPA call with a batch of n: the bits of n calls of one (its CPU kernel shares out (sequence, head, query
    block) items and computes each alone), without n calls' overhead: 10% of attention's time for a masked
    LM's copies of 152 tokens (ESM-2 8M), more for shorter ones."""
    length = q.shape[0] // n
    qb, kb, vb = (x.view(n, length, x.shape[1], x.shape[2]).transpose(1, 2) for x in (q, k, v))
    o = F.scaled_dot_product_attention(qb, kb, vb, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return o.transpose(1, 2).reshape(q.shape)


# Batch-invariant attention pads its products to at least this many query rows: CPU sgemm takes another
# path for fewer (see pipeline/models/layers/linear.py).
MIN_ROWS = 16


def _attend_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, block: int, scale: float) -> torch.Tensor:
    """Causal attention of one sequence's step rows q `[n, Hq, D]` (its last n positions) over k/v
    `[kv_len, Hkv, D]`, in blocks of rows that end at multiples of `block` (or at kv_len), each attending
    over the keys up to its end as two batched matmuls and a softmax in float32. A row's bits depend only
    on its block, never on n: the same whether a prefill runs whole or cut at multiples of `block`.

    The products are padded to at least MIN_ROWS rows, and callers run this on one thread
    (`_one_thread`): SDPA's CPU kernel splits the keys among threads when it has few query rows (a decode
    step, a block of one or two rows), and MKL splits a product's rows among threads in ways that change
    the last bits of some rows with their count (seen at 3 threads on [140, 32] x [32, 35]; torch 2.13,
    MKL 2024.2): either would make a row depend on torch's thread count."""
    n, num_q_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[0], k.shape[1]
    group = num_q_heads // num_kv_heads
    qh = q.float().view(n, num_kv_heads, group, head_dim).permute(1, 0, 2, 3).reshape(num_kv_heads, n * group, head_dim)
    kt = k.float().permute(1, 2, 0).contiguous()      # [Hkv, D, kv_len]: a block reads its first columns
    vh = v.float().permute(1, 0, 2).contiguous()      # [Hkv, kv_len, D]
    out = torch.empty_like(qh)
    prior = first = kv_len - n
    while first < kv_len:
        last = min(kv_len, (first // block + 1) * block)
        r0, r1 = (first - prior) * group, (last - prior) * group
        rows = r1 - r0
        qb = qh[:, r0:r1]
        if rows < MIN_ROWS:
            qb = torch.cat([qb, qb.new_zeros(num_kv_heads, MIN_ROWS - rows, head_dim)], dim=1)
        scores = torch.bmm(qb, kt[:, :, :last]).mul_(scale)                 # [Hkv, rows, last]
        if last - first > 1:   # row r is position first + r // group: later keys, all in the block, masked
            scores[:, :rows, first:].masked_fill_(_causal_tail(last - first, group, q.device), float("-inf"))
        out[:, r0:r1] = torch.bmm(torch.softmax(scores, dim=-1), vh[:, :last])[:, :rows]
        first = last
    return out.view(num_kv_heads, n, group, head_dim).permute(1, 0, 2, 3).reshape(n, num_q_heads, head_dim).to(q.dtype)


_tails: dict = {}


def _causal_tail(n: int, group: int, device) -> torch.Tensor:
    """[n * group, n]: True where key j comes after the row's position (row r is position r // group)."""
    key = (n, group, str(device))
    if key not in _tails:
        pos = torch.arange(n, device=device)
        _tails[key] = (pos[None, :] > pos[:, None]).repeat_interleave(group, dim=0)
    return _tails[key]


@contextlib.contextmanager
def _one_thread():
    threads = torch.get_num_threads()
    if threads > 1:
        torch.set_num_threads(1)   # about 1 us there and back
    try:
        yield
    finally:
        if threads > 1:
            torch.set_num_threads(threads)


def paged_attention_sdpa(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor, kv_lens: torch.Tensor, out: torch.Tensor, *, causal: bool, scale: float,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None, block: int = 0,
    rel_bias_table: torch.Tensor | None = None, rel_max_distance: int | None = None,
) -> torch.Tensor:
    """Same contract as paged_attention on CPU tensors; fills and returns out `[T_total, Hq, D]`.

    new_kv: the step's own keys and values `[T_total, Hkv, D]`, already written to the cache. A sequence
    with no earlier tokens (kv_len == its q_len) then attends over its rows of them directly instead of
    reading its pages back: the same values, one gather fewer (all of ESM-2's steps, and every fresh
    sequence of a causal model's prefill).

    block: with causal attention, a sequence's rows go in blocks that end at multiples of `block` positions
    (or at its last token), each attending over the keys up to the block's end (`_attend_blocks`). A row's
    value then depends only on its block, not on how many rows the step holds (SDPA's own blocking
    follows q_len): the same bits whether a prefill runs in one step or is cut at multiples of `block`
    over several, and for any thread count.

    rel_bias_table `[num_buckets, Hq]`, rel_max_distance: T5's relative-position bias (position_bias.py),
    bidirectional attention only; each sequence's bias by offset is built once and read through a view."""
    assert rel_bias_table is None or not causal, "the relative-position bias is for bidirectional attention"
    with _one_thread() if causal and block else contextlib.nullcontext():
        return _paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, kv_lens, out, causal=causal,
                                scale=scale, new_kv=new_kv, block=block, bias=(rel_bias_table, rel_max_distance))


def _paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, kv_lens, out, *, causal, scale, new_kv, block,
                     bias):
    page_size = k_cache.shape[1]
    table, max_distance = bias
    starts = cu_seqlens_q.tolist()
    lens = kv_lens.tolist()
    batched = new_kv is not None and not causal and table is None
    run_end = 0
    for s, kv_len in enumerate(lens):
        if s < run_end:
            continue   # attended with its run
        n = max(1, _same_length_run(starts, lens, s)) if batched else 1
        begin, end = starts[s], starts[s + n]
        if n > 1:
            k, v = (x[begin:end].to(k_cache.dtype) for x in new_kv)
            out[begin:end] = _attend_same_length(q[begin:end], k, v, n, scale=scale)
            run_end = s + n
            continue
        if end == begin:
            continue
        if new_kv is not None and kv_len == end - begin:
            k, v = (x[begin:end].to(k_cache.dtype) for x in new_kv)
        else:
            pages = block_tables[s, : -(-kv_len // page_size)]
            k = k_cache.index_select(0, pages).flatten(0, 1)[:kv_len]
            v = v_cache.index_select(0, pages).flatten(0, 1)[:kv_len]
        if causal and block:
            out[begin:end] = _attend_blocks(q[begin:end], k, v, block=block, scale=scale)
        else:
            offsets = None if table is None else bias_by_offset(table, max_distance, kv_len, q.dtype)
            out[begin:end] = _attend(q[begin:end], k, v, causal=causal, scale=scale, bias=offsets)
    return out
