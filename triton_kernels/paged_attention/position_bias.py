"""T5's bucketed relative-position bias (bidirectional, for encoders): which bucket a key at offset
`key position - query position` falls in, as one lookup table by distance that the kernel and the torch
path share.

T5 gives offsets of magnitude below `max_exact = num_buckets // 4` a bucket each, and larger ones
`max_exact + floor(log(|r| / max_exact) / log(max_distance / max_exact) * (num_buckets // 2 - max_exact))`,
capped at `num_buckets // 2 - 1` (reached by max_distance); positive offsets (keys after the query) take
the upper half of the buckets. The logarithm's value is an integer exactly at some distances (16, 32 and
64 for ProtT5's 32 buckets and distance 128), where a float log's last bit would decide the bucket; so the
buckets of distances 0..max_distance are computed once, in float64 on the host, and looked up (on CPU,
transformers' float32 formula gives the same buckets: tests/kernels/test_position_bias.py).
"""
from __future__ import annotations

import functools
import math

import torch


def relative_bias_arguments(table: torch.Tensor | None, max_distance: int | None, causal: bool, num_q_heads: int,
                            device: torch.device) -> torch.Tensor | None:
    """An attention call's rel_bias_table checked with its rel_max_distance (both or neither; bidirectional
    attention only), with a unit stride on heads as the kernel reads it; None without a bias."""
    if (table is None) != (max_distance is None):
        raise ValueError("rel_bias_table and rel_max_distance go together: give both or neither")
    if table is None:
        return None
    if causal:
        raise ValueError("the relative-position bias is implemented for bidirectional attention (causal=False) only")
    check_relative_bias(table, max_distance, num_q_heads, device)
    return table if table.stride(1) == 1 else table.contiguous()


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
        raise ValueError(f"rel_max_distance must be an int above num_buckets // 4 = {num_buckets // 4} (where T5's "
                         f"logarithmic buckets start), got {max_distance!r}")


def bucket_shape(num_buckets: int) -> tuple[int, int]:
    """(buckets per direction, distances below which each has its own bucket)."""
    half = num_buckets // 2
    return half, half // 2


@functools.lru_cache(maxsize=None)
def distance_buckets(num_buckets: int, max_distance: int) -> tuple[int, ...]:
    """The bucket of a key at distance a = 0..max_distance before its query (T5's formula in float64, in
    its order of operations); keys farther away share the last, keys after the query add num_buckets // 2."""
    half, exact = bucket_shape(num_buckets)
    return tuple(a if a < exact else
                 min(half - 1, exact + math.floor(math.log(a / exact) / math.log(max_distance / exact) * (half - exact)))
                 for a in range(max_distance + 1))


_tables: dict = {}


def bucket_table(num_buckets: int, max_distance: int, device: torch.device) -> torch.Tensor:
    """distance_buckets as an int32 tensor on `device`, built once per device (no copy per call)."""
    key = (num_buckets, max_distance, str(device))
    if key not in _tables:
        _tables[key] = torch.tensor(distance_buckets(num_buckets, max_distance), dtype=torch.int32, device=device)
    return _tables[key]


def relative_buckets(offsets: torch.Tensor, num_buckets: int, max_distance: int) -> torch.Tensor:
    """The bucket (int64) of each key-minus-query offset in `offsets` (any integer tensor)."""
    table = bucket_table(num_buckets, max_distance, offsets.device)
    return table[offsets.abs().clamp(max=max_distance)].long() + (offsets > 0).long() * bucket_shape(num_buckets)[0]


def bias_by_offset(table: torch.Tensor, max_distance: int, kv_len: int, dtype: torch.dtype) -> torch.Tensor:
    """`[Hq, 2 * kv_len - 1]` in `dtype`: column kv_len - 1 + r holds each head's bias for offset r."""
    offsets = torch.arange(1 - kv_len, kv_len, device=table.device)
    return table.to(dtype)[relative_buckets(offsets, table.shape[0], max_distance)].t().contiguous()
