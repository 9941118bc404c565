"""Group a shard's sequences (already longest first) into batches under a token budget.

Batches are a pure function of the shard's sequence list and the budget, so a resumed shard computes
exactly the batches an uninterrupted run would have.
"""
from __future__ import annotations

import numpy as np


def plan_batches(tokens: np.ndarray, budget: int, max_seqs: int, padded: bool) -> list[tuple[int, int]]:
    """[start, stop) ranges over `tokens` (per sequence, non-increasing).

    Padded batches cost (sequences x longest); ragged batches cost the sum of their tokens. A sequence
    over the budget on its own gets a batch of its own (engines with chunked prefill still bound memory).
    """
    tokens = np.asarray(tokens, np.int64)
    out, start, n = [], 0, len(tokens)
    while start < n:
        if padded:
            # the first sequence is the longest, so the batch costs k * tokens[start]
            k = max(1, min(max_seqs, budget // max(1, int(tokens[start]))))
        else:
            cum = np.cumsum(tokens[start:start + max_seqs])
            k = max(1, int(np.searchsorted(cum, budget, "right")))
        stop = min(n, start + k)
        out.append((start, stop))
        start = stop
    return out
