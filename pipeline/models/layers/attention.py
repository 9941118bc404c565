"""Attention over the paged KV cache: write the step's keys and values, then attend (our kernels); an encoder's
steps on the Triton path attend straight from the QKV projection instead (`from_projection`).

With Triton (CUDA; or CPU under TRITON_INTERPRET=1 when a test asks for it) the public kernels run. They take head dims 32, 64, 80, 96, 128 and 256; a model with
another head dim (the bundled demo model has 16) is zero-padded to the next one there, which leaves
scores and outputs unchanged as long as the scale is passed explicitly. On CPU the kernels' own torch
implementations are called directly: they take any head dim, so nothing is padded.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from triton_kernels import paged_attention, write_kv_cache
from triton_kernels.paged_attention import varlen_attention
from triton_kernels.paged_attention.varlen import CONTIGUOUS_PAGE
from triton_kernels.paged_attention.kv_cache import write_kv_cache_torch
from triton_kernels.paged_attention.sdpa import MIN_ROWS, paged_attention_sdpa

from ..step import StepContext

KERNEL_HEAD_DIMS = (32, 64, 80, 96, 128, 256)


def cache_head_dim(head_dim: int, triton_kernels: bool) -> int:
    """The head dim the KV cache is laid out with: padded to a kernel head dim when the kernels run."""
    if not triton_kernels:
        return head_dim
    for d in KERNEL_HEAD_DIMS:
        if d >= head_dim:
            return d
    raise ValueError(f"head dim {head_dim} is larger than the attention kernels support (256)")


class PagedAttention:
    """One attention layer's view of the KV cache; `kv` is set by the model runner when it allocates.

    relative_bias (T5): the layer's scores gain a bucketed relative-position bias, whose table and maximum
    distance each call passes as `rel_bias`; its launches take the default rule's tiles for the bias."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, causal: bool,
                 relative_bias: bool = False):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.causal, self.relative_bias = scale, causal, relative_bias
        self.kv: tuple[torch.Tensor, torch.Tensor] | None = None   # [pages, page_size, Hkv, cache head dim]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext,
                 rel_bias: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
        """q `[T, Hq, D]`, k and v `[T, Hkv, D]` of the step's new tokens -> `[T, Hq, D]`. rel_bias: (table
        `[num_buckets, Hq]`, max_distance), given exactly when the layer was built with relative_bias."""
        assert self.kv is not None, "KV cache not allocated for this layer"
        assert (rel_bias is not None) == self.relative_bias, "rel_bias goes with relative_bias layers"
        bias = dict(rel_bias_table=rel_bias[0], rel_max_distance=rel_bias[1]) if rel_bias is not None else {}
        k_cache, v_cache = self.kv
        if not ctx.triton_kernels:
            # The torch path reads a fresh sequence's keys and values from the step itself (new_kv), so an
            # encoder's pages (whole sequences only) would never be read: ESM's and T5's go unwritten, which
            # saved a quarter second per layer of a 3,858-token ProtT5-XL step (63 MB of K and V, masked
            # copies and a scatter).
            if self.causal or (ctx.prior_lens > 0).any():
                write_kv_cache_torch(k, v, k_cache, v_cache, ctx.slot_mapping)
            out = torch.empty_like(q)
            return paged_attention_sdpa(q, k_cache, v_cache, ctx.block_tables, ctx.cu_seqlens, ctx.kv_lens, out,
                                        causal=self.causal, scale=self.scale, new_kv=(k, v),
                                        block=ctx.invariant_block, **bias)
        pad = k_cache.shape[-1] - self.head_dim
        if pad:
            q, k, v = (F.pad(x, (0, pad)) for x in (q, k, v))
        write_kv_cache(k, v, k_cache, v_cache, ctx.slot_mapping)
        out = paged_attention(q, k_cache, v_cache, ctx.block_tables, ctx.cu_seqlens, ctx.kv_lens,
                              causal=self.causal, scale=self.scale, **bias, **ctx.attention_launch)
        return out[..., :self.head_dim] if pad else out

    def from_projection(self, qkv: torch.Tensor, ctx: StepContext, rel_bias: tuple[torch.Tensor, int] | None = None,
                        scale: float | None = None) -> torch.Tensor:
        """Attention from a fused projection's output `[T, (Hq + 2 Hkv) * D]` (queries, keys, values, head after
        head) -> `[T, Hq, D]`. A Triton step whose sequences have no earlier tokens and that no later step reads
        (bidirectional: an encoder's, T5's with its relative-position bias) attends straight from the
        projection, with no cache write and no page gather (varlen_attention); any other step goes through the
        cache as __call__ does. rel_bias as __call__'s; `scale`: the scores' scale where the queries come
        unscaled (a power of two, so either way the same bits: ESM-1b's, esm.kernel_scale), default the layer's."""
        T, Hq, Hkv, D = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q = qkv[:, :Hq * D].view(T, Hq, D)
        k = qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)
        v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
        if not ctx.triton_kernels or self.causal or (ctx.prior_lens > 0).any():
            assert scale is None, "unscaled queries are for the encoder steps of the Triton path (forward_fused)"
            return self(q, k, v, ctx, rel_bias)
        assert (rel_bias is not None) == self.relative_bias, "rel_bias goes with relative_bias layers"
        bias = dict(rel_bias_table=rel_bias[0], rel_max_distance=rel_bias[1]) if rel_bias is not None else {}
        knobs = dict(ctx.attention_launch)
        if knobs and self.kv is not None:   # tiles of the same number of keys as the paged walk's
            knobs["pages_per_tile"] = max(1, knobs["pages_per_tile"] * self.kv[0].shape[1] // CONTIGUOUS_PAGE)
        return varlen_attention(q, k, v, ctx.cu_seqlens, ctx.kv_lens, causal=False,
                                scale=self.scale if scale is None else scale, **bias, **knobs)

    def attend_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext,
                    q_counts: np.ndarray) -> torch.Tensor:
        """Bidirectional attention of some queries only: q `[n, Hq, D]` holds q_counts[s] queries of step sequence
        s (in step order), k and v `[T, Hkv, D]` every token of the step -> `[n, Hq, D]`. What an encoder's last
        layer needs when only some positions' outputs are read (a masked LM's masked positions)."""
        assert not self.causal and not self.relative_bias, "attend_rows is for bidirectional attention"
        cu_q = np.zeros(len(q_counts) + 1, np.int64)
        np.cumsum(q_counts, out=cu_q[1:])
        if ctx.triton_kernels:
            pad = self.kv[0].shape[-1] - self.head_dim
            if pad:
                q, k, v = (F.pad(x, (0, pad)) for x in (q, k, v))
            write_kv_cache(k, v, self.kv[0], self.kv[1], ctx.slot_mapping)
            cu = ctx.on_device("rows_cu_q", cu_q, np.int32)
            out = paged_attention(q, self.kv[0], self.kv[1], ctx.block_tables, cu, ctx.kv_lens, causal=False,
                                  scale=self.scale, **ctx.attention_launch)
            return out[..., :self.head_dim] if pad else out
        cu_kv = np.zeros(ctx.num_seqs + 1, np.int64)   # ctx.cu_seqlens as the host knows it (no read-back)
        np.cumsum(ctx.q_lens, out=cu_kv[1:])
        return _rows_over_keys(q, k, v, cu_q, cu_kv.tolist(), self.scale)


def _rows_over_keys(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: np.ndarray, cu_kv: list[int],
                    scale: float) -> torch.Tensor:
    """CPU: per sequence, its queries over its keys as two matmuls and a float32 softmax, the queries padded to
    MIN_ROWS rows and on one thread, so that a row's bits depend on its own sequence only (not on how many
    queries or sequences the step holds, nor on the thread count: pipeline/models/layers/linear.py)."""
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for s in range(len(cu_q) - 1):
            a, b = int(cu_q[s]), int(cu_q[s + 1])
            if a == b:
                continue
            ks = k[cu_kv[s]:cu_kv[s + 1]].float().repeat_interleave(group, dim=1).permute(1, 2, 0)  # [Hq, D, T]
            vs = v[cu_kv[s]:cu_kv[s + 1]].float().repeat_interleave(group, dim=1).transpose(0, 1)   # [Hq, T, D]
            qs = q[a:b].float().transpose(0, 1)                                                       # [Hq, n, D]
            if b - a < MIN_ROWS:
                qs = torch.cat([qs, qs.new_zeros(qs.shape[0], MIN_ROWS - (b - a), qs.shape[2])], dim=1)
            weights = torch.softmax(torch.bmm(qs, ks).mul_(scale), dim=-1)
            out[a:b] = torch.bmm(weights, vs)[:, :b - a].transpose(0, 1).to(q.dtype)
    finally:
        torch.set_num_threads(threads)
    return out
