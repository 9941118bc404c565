"""`paged_attention`: checks the inputs, resolves the launch knobs and runs Triton or the torch path."""
import torch

from .._device import kernels, target_of, use_triton
from .launch import PagedAttentionLaunch, default_launch
from .position_bias import relative_bias_arguments
from .sdpa import paged_attention_sdpa

SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 128, 256)
INDEX_DTYPE = torch.int32


def _check_inputs(q, k_cache, v_cache, block_tables, cu_seqlens_q, kv_lens, out) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [T_total, Hq, D], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must both be [num_pages, page_size, Hkv, D], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"head dim of the cache ({k_cache.shape[3]}) differs from q's ({head_dim})")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim {head_dim} is not supported; use one of {SUPPORTED_HEAD_DIMS}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})")
    if page_size < 16 or page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two >= 16, got {page_size}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q, k_cache and v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, "
                         f"{v_cache.dtype}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must be contiguous along the head dim")
    num_seqs = block_tables.shape[0]
    for name, t, shape in (("block_tables", block_tables, (num_seqs, block_tables.shape[-1])),
                           ("cu_seqlens_q", cu_seqlens_q, (num_seqs + 1,)),
                           ("kv_lens", kv_lens, (num_seqs,))):
        if t.dtype != INDEX_DTYPE:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} for {num_seqs} sequences, got {tuple(t.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
                    ("cu_seqlens_q", cu_seqlens_q), ("kv_lens", kv_lens)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.device != q.device
                            or out.stride(-1) != 1):
        raise ValueError(f"out must be a {q.dtype} tensor of shape {tuple(q.shape)} on {q.device}, contiguous "
                         "along the head dim")


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    rel_bias_table: torch.Tensor | None = None,
    rel_max_distance: int | None = None,
    block_q: int | None = None,
    pages_per_tile: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    num_kv_splits: int | None = None,
) -> torch.Tensor:
    """Attention of new query tokens over a paged KV cache, for ragged batches of S sequences.

    q: `[T_total, Hq, D]`, the new tokens of all sequences concatenated. k_cache, v_cache:
    `[num_pages, page_size, Hkv, D]`, already holding the new tokens' keys and values. block_tables: int32
    `[S, max_pages_per_seq]`, the pages of each sequence in order. cu_seqlens_q: int32 `[S + 1]`, where each
    sequence's tokens start in q. kv_lens: int32 `[S]`, context length including the new tokens
    (kv_lens[s] >= q_len_s). Query i of sequence s sits at position kv_lens[s] - q_len_s + i; causal: it sees
    keys at positions <= its own; causal=False: all kv_lens[s] keys. scale defaults to D ** -0.5.
    Returns `[T_total, Hq, D]` in q's dtype (written into `out` when given; rows past cu_seqlens_q[-1] are
    left unspecified).

    rel_bias_table `[num_buckets, Hq]` and rel_max_distance (both or neither; causal=False only): T5's
    bidirectional relative-position bias. The score of a key at offset r = key position - query position
    gains rel_bias_table[bucket(r), head], with T5's buckets (position_bias.py); the table is read in its
    own dtype and added in float32. None (the default) adds nothing and costs nothing. T5 does not scale its
    scores: pass scale=1.0.

    Launch knobs (used by the Triton kernel; the CPU torch path ignores them): block_q, pages_per_tile,
    num_warps, num_stages, num_kv_splits, see PagedAttentionLaunch. A knob left as None takes the value of
    `default_launch` for this batch's shapes; an engine should compute that once and pass it explicitly.
    """
    _check_inputs(q, k_cache, v_cache, block_tables, cu_seqlens_q, kv_lens, out)
    rel_bias_table = relative_bias_arguments(rel_bias_table, rel_max_distance, causal, q.shape[1], q.device)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if q.shape[0] == 0 or block_tables.shape[0] == 0:
        return out
    if not use_triton(q):
        return paged_attention_sdpa(q, k_cache, v_cache, block_tables, cu_seqlens_q, kv_lens, out,
                                    causal=causal, scale=scale, rel_bias_table=rel_bias_table,
                                    rel_max_distance=rel_max_distance)

    knobs = dict(block_q=block_q, pages_per_tile=pages_per_tile, num_warps=num_warps, num_stages=num_stages,
                 num_kv_splits=num_kv_splits)
    if any(v is None for v in knobs.values()):
        rule = default_launch(
            num_q_tokens=q.shape[0], num_seqs=block_tables.shape[0], num_q_heads=q.shape[1],
            num_kv_heads=k_cache.shape[2], head_dim=q.shape[2], page_size=k_cache.shape[1],
            max_kv_len=block_tables.shape[1] * k_cache.shape[1], target=target_of(q.device),
            relative_bias=rel_bias_table is not None,
        )
        knobs = {name: getattr(rule, name) if v is None else v for name, v in knobs.items()}
    launch = PagedAttentionLaunch(**knobs)

    if q.stride(-1) != 1:
        q = q.contiguous()
    return kernels("paged_attention.kernel").paged_attention_triton(
        q, k_cache, v_cache, block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous(),
        cu_seqlens_q.contiguous(), kv_lens.contiguous(), out, causal=causal, scale=scale, knobs=launch,
        rel_bias_table=rel_bias_table, rel_max_distance=rel_max_distance,
    )
