"""T5's bucketed relative-position bias (bidirectional, for encoders): which bucket a key at offset
`key position - query position` falls in, as integer thresholds that the kernel and the torch path share.

T5 gives offsets of magnitude below `max_exact = num_buckets // 4` a bucket each, and larger ones
`max_exact + floor(log(|r| / max_exact) / log(max_distance / max_exact) * (num_buckets // 2 - max_exact))`,
capped at `num_buckets // 2 - 1`; positive offsets (keys after the query) take the upper half of the
buckets. The logarithm's value is an integer exactly at some offsets (16, 32 and 64 for ProtT5's 32 buckets
and distance 128), where a float log's last bit would decide the bucket; so the log buckets are counted
against thresholds computed once in float64 here, which the kernel gets as compile-time constants (on
CPU, transformers' float32 formula gives the same buckets: tests/kernels/test_position_bias.py).
"""
from __future__ import annotations

import functools
import math

import torch


def check_relative_bias(table: torch.Tensor, max_distance: int, num_q_heads: int, device: torch.device) -> None:
    """ValueError naming what is wrong with a bias table `[num_buckets, Hq]` and its max_distance."""
    if table.dim() != 2 or table.shape[1] != num_q_heads:
        raise ValueError(f"rel_bias_table must be [num_buckets, Hq={num_q_heads}], got shape {tuple(table.shape)}")
    if not table.is_floating_point():
        raise ValueError(f"rel_bias_table must be a floating-point tensor, got {table.dtype}")
    if table.device != device:
        raise ValueError(f"rel_bias_table is on {table.device} but q is on {device}")
    num_buckets = table.shape[0]
    if num_buckets < 4:
        raise ValueError(f"rel_bias_table needs at least 4 buckets (2 per direction, 1 exact), got {num_buckets}")
    if not isinstance(max_distance, int) or max_distance <= num_buckets // 4:
        raise ValueError(f"rel_max_distance must be an int above num_buckets // 4 = {num_buckets // 4} (the last "
                         f"exact offset), got {max_distance!r}")


def bucket_shape(num_buckets: int) -> tuple[int, int]:
    """(buckets per direction, offsets below which each magnitude has its own bucket)."""
    half = num_buckets // 2
    return half, half // 2


@functools.lru_cache(maxsize=None)
def log_bucket_thresholds(num_buckets: int, max_distance: int) -> tuple[int, ...]:
    """t_1 < ... < t_n: an offset of magnitude a >= max_exact has bucket max_exact + #{j : a >= t_j}
    (n = half - max_exact - 1, so the count stops at the last bucket, as T5's cap does)."""
    half, exact = bucket_shape(num_buckets)
    thresholds, a = [], exact
    for j in range(1, half - exact):   # T5's formula, in its order of operations
        while math.floor(math.log(a / exact) / math.log(max_distance / exact) * (half - exact)) < j:
            a += 1   # reaches j by a = max_distance at the latest
        thresholds.append(a)
    return tuple(thresholds)


def relative_buckets(offsets: torch.Tensor, num_buckets: int, max_distance: int) -> torch.Tensor:
    """The bucket (int64) of each key-minus-query offset in `offsets` (any integer tensor)."""
    half, exact = bucket_shape(num_buckets)
    dist = offsets.abs()
    thresholds = torch.tensor(log_bucket_thresholds(num_buckets, max_distance), dtype=dist.dtype, device=dist.device)
    # Every threshold exceeds max_exact, so below it the count adds nothing: min(dist, max_exact) + count.
    count = torch.searchsorted(thresholds, dist, right=True)
    return (dist.clamp(max=exact) + count).long() + (offsets > 0).long() * half


def bias_by_offset(table: torch.Tensor, max_distance: int, kv_len: int, dtype: torch.dtype) -> torch.Tensor:
    """`[Hq, 2 * kv_len - 1]` in `dtype`: column kv_len - 1 + r holds each head's bias for offset r."""
    offsets = torch.arange(1 - kv_len, kv_len, device=table.device)
    return table.to(dtype)[relative_buckets(offsets, table.shape[0], max_distance)].t().contiguous()
