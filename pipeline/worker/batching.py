"""Group a shard's sequences (already longest first) into batches under a token budget.

Batches are a pure function of the shard's sequence list and the budget, so a resumed shard computes
exactly the batches an uninterrupted run would have.
"""
from __future__ import annotations

import numpy as np


def plan_batches(tokens: np.ndarray, budget: int, max_seqs: int, padded: bool) -> list[tuple[int, int]]:
    """[start, stop) ranges over `tokens` (per sequence, in the shard's order: longest residues first, which
    need not be most tokens first where a token covers several residues).

    Padded batches cost (sequences x longest); ragged batches cost the sum of their tokens. A sequence
    over the budget on its own gets a batch of its own (engines with chunked prefill still bound memory).
    """
    tokens = np.asarray(tokens, np.int64)
    out, start, n = [], 0, len(tokens)
    while start < n:
        if padded:   # k sequences cost k times the longest of them
            longest = np.maximum.accumulate(tokens[start:start + max_seqs])
            cost = longest * np.arange(1, len(longest) + 1)
            k = max(1, int(np.searchsorted(cost, budget, "right")))
        else:
            cum = np.cumsum(tokens[start:start + max_seqs])
            k = max(1, int(np.searchsorted(cum, budget, "right")))
        stop = min(n, start + k)
        out.append((start, stop))
        start = stop
    return out


# A generate call gets this many times --max-seqs sequences, so that as sequences finish others take
# their place (continuous batching) instead of the step emptying out at the end of every call.
GENERATE_QUEUE_FACTOR = 4


def plan_generate_batches(tokens: np.ndarray, max_seqs: int) -> list[tuple[int, int]]:
    """Engine calls of GENERATE_QUEUE_FACTOR x --max-seqs sequences each (prompt tokens are not the limit
    here: the engine's own step budget and KV pages bound what runs at once)."""
    return plan_batches(tokens, int(np.sum(tokens)) + 1, GENERATE_QUEUE_FACTOR * max_seqs, padded=False)
