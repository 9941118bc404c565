"""Paged attention in plain torch, for CPU engines: per sequence, gather its pages and call SDPA.

This is the path production runs on CPU (no Triton), so it avoids per-token work: one index_select of
the sequence's pages, GQA without copies of K/V per query head (enable_gqa, or heads packed as rows for
decode), and a mask only where one is needed (causal with 1 < q_len < kv_len: chunked-prefill
continuations).
"""
import torch
import torch.nn.functional as F


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float) -> torch.Tensor:
    """q `[q_len, Hq, D]`, k/v `[kv_len, Hkv, D]` of one sequence, its new tokens last -> `[q_len, Hq, D]`."""
    q_len, num_q_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[0], k.shape[1]
    k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
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


def paged_attention_sdpa(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor, kv_lens: torch.Tensor, out: torch.Tensor, *, causal: bool, scale: float,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Same contract as paged_attention on CPU tensors; fills and returns out `[T_total, Hq, D]`.

    new_kv: the step's own keys and values `[T_total, Hkv, D]`, already written to the cache. A sequence
    with no earlier tokens (kv_len == its q_len) then attends over its rows of them directly instead of
    reading its pages back: the same values, one gather fewer (all of ESM-2's steps, and every fresh
    sequence of a causal model's prefill)."""
    page_size = k_cache.shape[1]
    starts = cu_seqlens_q.tolist()
    for s, kv_len in enumerate(kv_lens.tolist()):
        begin, end = starts[s], starts[s + 1]
        if end == begin:
            continue
        if new_kv is not None and kv_len == end - begin:
            k, v = (x[begin:end].to(k_cache.dtype) for x in new_kv)
        else:
            pages = block_tables[s, : -(-kv_len // page_size)]
            k = k_cache.index_select(0, pages).flatten(0, 1)[:kv_len]
            v = v_cache.index_select(0, pages).flatten(0, 1)[:kv_len]
        out[begin:end] = _attend(q[begin:end], k, v, causal=causal, scale=scale)
    return out
