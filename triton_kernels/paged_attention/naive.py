"""Obviously correct paged attention for tests: per sequence, dense softmax attention in float64."""
import math

import torch


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Keys (or values) of one sequence, [kv_len, Hkv, D], read page by page through its block table."""
    page_size = cache.shape[1]
    pages = [cache[int(block_table[p])] for p in range(-(-kv_len // page_size))]
    return torch.cat(pages)[:kv_len]


def t5_buckets(offsets: torch.Tensor, num_buckets: int, max_distance: int) -> torch.Tensor:
    """T5's bidirectional bucket of each key-minus-query offset, its formula in float64 as written.

    Computed on the CPU whatever the offsets' device: the quotient is an integer at some distances (16, 32,
    64 for 32 buckets and distance 128), where the floor turns a log's last bit into a whole bucket. On an
    H200, CUDA's float64 log made distance 64's quotient 5.999999999999999 (the CPU's: 6.0, transformers'
    buckets), so a reference computed there put it one bucket low (tools/gpu_numerics_probe.py)."""
    half = num_buckets // 2
    exact = half // 2
    a = offsets.abs().cpu()
    ratio = torch.log(a.clamp(min=exact).double() / exact) / math.log(max_distance / exact)
    large = (exact + torch.floor(ratio * (half - exact)).long()).clamp(max=half - 1)
    buckets = (offsets.cpu() > 0).long() * half + torch.where(a < exact, a, large)
    return buckets.to(offsets.device)


def naive_paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor, kv_lens: torch.Tensor, *, causal: bool = True, scale: float | None = None,
    rel_bias_table: torch.Tensor | None = None, rel_max_distance: int | None = None,
) -> torch.Tensor:
    """Same contract as paged_attention; returns float64 `[T_total, Hq, D]`.

    Query i of sequence s sits at position kv_lens[s] - q_len + i and, when causal, sees keys at
    positions <= its own; otherwise all kv_lens[s] keys. With rel_bias_table `[num_buckets, Hq]`, the
    score of a key at offset r from the query gains rel_bias_table[t5_buckets(r), head].
    """
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    group = num_q_heads // k_cache.shape[2]
    scale = head_dim ** -0.5 if scale is None else scale
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for s in range(block_tables.shape[0]):
        begin, end, kv_len = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1]), int(kv_lens[s])
        if end == begin:
            continue
        k = gather_kv(k_cache, block_tables[s], kv_len).double().repeat_interleave(group, dim=1)
        v = gather_kv(v_cache, block_tables[s], kv_len).double().repeat_interleave(group, dim=1)
        qs = q[begin:end].double()
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        q_pos = torch.arange(kv_len - (end - begin), kv_len, device=q.device)
        k_pos = torch.arange(kv_len, device=q.device)
        if rel_bias_table is not None:
            buckets = t5_buckets(k_pos[None, :] - q_pos[:, None], rel_bias_table.shape[0], rel_max_distance)
            scores = scores + rel_bias_table.double()[buckets].permute(2, 0, 1)
        if causal:
            scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[begin:end] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
    return out
