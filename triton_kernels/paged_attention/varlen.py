"""Attention of a step's tokens over the step's own keys and values, read where the QKV projection wrote them.

An encoder step (every sequence whole, no earlier tokens) never reads keys from an earlier step, so writing its
keys and values into the paged cache and gathering them back through block tables is pure traffic (8 d bytes
per token and layer, a launch per layer). `varlen_attention` runs the paged kernel in its contiguous mode
instead: sequence s's keys are the rows cu_seqlens[s]:cu_seqlens[s + 1] of k and v, which may be strided views
of the projection's output `[T, (Hq + 2 Hkv) * D]`. On CPU (no Triton) each sequence goes through SDPA.
"""
from __future__ import annotations

import torch

from .._device import kernels, target_of, use_triton
from .launch import PagedAttentionLaunch, default_launch
from .position_bias import bias_by_offset, relative_bias_arguments
from .sdpa import _attend

# The kernel forms tiles of pages_per_tile pages; in contiguous mode a "page" is this many keys.
CONTIGUOUS_PAGE = 16


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
           seq_lens: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q must be [T, Hq, D] and k, v [T, Hkv, D], got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k.shape[1]})")
    if not 1 <= q.shape[2] <= 256:
        raise ValueError(f"head dim {q.shape[2]} is not supported (1 to 256)")
    if any(x.stride(-1) != 1 for x in (q, k, v)):
        raise ValueError("q, k and v must be contiguous along the head dim")
    if q.dtype != k.dtype or k.dtype != v.dtype:
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    n = seq_lens.shape[0]
    if cu_seqlens.shape != (n + 1,) or cu_seqlens.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens must be int32 [S + 1] and seq_lens int32 [S], got {cu_seqlens.dtype} "
                         f"{tuple(cu_seqlens.shape)} and {seq_lens.dtype} {tuple(seq_lens.shape)}")


def varlen_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
                           causal: bool, scale: float, out: torch.Tensor, rel_bias_table: torch.Tensor | None = None,
                           rel_max_distance: int | None = None) -> torch.Tensor:
    starts = cu_seqlens.tolist()
    for s in range(len(starts) - 1):
        a, b = starts[s], starts[s + 1]
        if b > a:
            bias = None if rel_bias_table is None else bias_by_offset(rel_bias_table, rel_max_distance, b - a, q.dtype)
            out[a:b] = _attend(q[a:b], k[a:b], v[a:b], causal=causal, scale=scale, bias=bias)
    return out


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     seq_lens: torch.Tensor, *, causal: bool = False, scale: float | None = None,
                     out: torch.Tensor | None = None, rel_bias_table: torch.Tensor | None = None,
                     rel_max_distance: int | None = None, block_q: int | None = None,
                     pages_per_tile: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                     num_kv_splits: int | None = None) -> torch.Tensor:
    """Self-attention of each sequence of a ragged step over its own tokens -> `[T, Hq, D]` in q's dtype.

    q `[T, Hq, D]`, k and v `[T, Hkv, D]`: the step's tokens, sequence after sequence (any token and head strides,
    contiguous head dim; e.g. views of a fused QKV output). cu_seqlens int32 `[S + 1]`: where each sequence
    starts; seq_lens int32 `[S]`: its length (cu_seqlens' differences, kept on the device so nothing is read
    back). causal: a token sees the keys at or before it; else every key of its sequence. scale defaults to
    D ** -0.5. Head dims 1 to 256 (any: masked to the next power of two, at least 16). Launch knobs as paged_attention's,
    tiles of pages_per_tile x 16 keys; None takes the default rule's values for this shape.

    rel_bias_table `[num_buckets, Hq]` and rel_max_distance (both or neither; causal=False only): T5's relative-
    position bias, as paged_attention adds it (a key at offset r = key position - query position within the
    sequence adds rel_bias_table[bucket(r), head] to the score, in float32). T5 does not scale: pass scale=1.0.
    """
    _check(q, k, v, cu_seqlens, seq_lens)
    rel_bias_table = relative_bias_arguments(rel_bias_table, rel_max_distance, causal, q.shape[1], q.device)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] == 0 or seq_lens.shape[0] == 0:
        return out
    if not use_triton(q):
        return varlen_attention_torch(q, k, v, cu_seqlens, causal=causal, scale=scale, out=out,
                                      rel_bias_table=rel_bias_table, rel_max_distance=rel_max_distance)
    knobs = dict(block_q=block_q, pages_per_tile=pages_per_tile, num_warps=num_warps, num_stages=num_stages,
                 num_kv_splits=num_kv_splits)
    if any(value is None for value in knobs.values()):
        d = max(32, 1 << max(4, (q.shape[2] - 1).bit_length()))   # the rule knows the kernel head dims
        rule = default_launch(num_q_tokens=q.shape[0], num_seqs=seq_lens.shape[0], num_q_heads=q.shape[1],
                              num_kv_heads=k.shape[1], head_dim=d, page_size=CONTIGUOUS_PAGE,
                              max_kv_len=q.shape[0], target=target_of(q.device),
                              relative_bias=rel_bias_table is not None)
        knobs = {name: getattr(rule, name) if value is None else value for name, value in knobs.items()}

    # The kernel reads the keys as a one-page cache [1, T, Hkv, D] whose slot stride is the token stride.
    k4, v4 = k.unsqueeze(0), v.unsqueeze(0)
    return kernels("paged_attention.kernel").paged_attention_triton(
        q, k4, v4, seq_lens, cu_seqlens, seq_lens, out, causal=causal, scale=scale, knobs=PagedAttentionLaunch(**knobs),
        rel_bias_table=rel_bias_table, rel_max_distance=rel_max_distance, contiguous_kv=True)
