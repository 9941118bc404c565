"""Group a shard's sequences (already longest first) into batches under a token budget.

Batches are a pure function of the shard's sequence list and the budget, so a resumed shard computes
exactly the batches an uninterrupted run would have.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

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
        stop = start + batch_size(tokens[start:start + max_seqs], budget, padded)
        out.append((start, stop))
        start = stop
    return out


def batch_size(ahead: np.ndarray, budget: int, padded: bool) -> int:
    """How many of the sequences `ahead` (the next --max-seqs of them, or fewer at the end) the next batch takes:
    plan_batches one batch at a time, for a plan made as the token counts arrive (worker/token_counts.py)."""
    ahead = np.asarray(ahead, np.int64)
    if padded:   # k sequences cost k times the longest of them
        cost = np.maximum.accumulate(ahead) * np.arange(1, len(ahead) + 1)
    else:
        cost = np.cumsum(ahead)
    return min(len(ahead), max(1, int(np.searchsorted(cost, budget, "right"))))


# A generate call gets this many times --max-seqs sequences, so that as sequences finish others take
# their place (continuous batching) instead of the step emptying out at the end of every call (prompt tokens are
# not the limit there: the engine's own step budget and KV pages bound what runs at once).
GENERATE_QUEUE_FACTOR = 4


class LazyPlan:
    """plan_batches made one batch at a time as the token counts arrive: the same batches, each planned once the
    counts of the sequences it may take are known (generate: calls of GENERATE_QUEUE_FACTOR x max_seqs sequences).
    `counts`: `tokens` (per sequence) and `wait_for(end, alive)` (worker/token_counts.TokenCounter);
    `cost(tokens, start, end)`: what sequences start..end cost the budget (their windows, a pseudo-log-likelihood's
    copies); `alive(counted)`, called while the plan waits for counts, False to stop (the plan then ends early).

    Yields (batch number, start, stop, the batch's sequences' costs)."""

    def __init__(self, counts, cost: Callable[[np.ndarray, int, int], np.ndarray], budget: int, max_seqs: int,
                 padded: bool, generate: bool = False, alive: Callable[[int], bool] = lambda counted: True):
        self.counts, self.cost, self.budget, self.padded, self.generate = counts, cost, budget, padded, generate
        self.max_seqs = GENERATE_QUEUE_FACTOR * max_seqs if generate else max_seqs
        self.alive = alive

    def __iter__(self) -> Iterator[tuple[int, int, int, np.ndarray]]:
        n = len(self.counts.tokens)
        start = k = 0
        while start < n:
            end = min(n, start + self.max_seqs)
            if not self.counts.wait_for(end, self.alive):
                return
            ahead = np.asarray(self.cost(self.counts.tokens[start:end], start, end), np.int64)
            # (generate: prompt tokens are not the limit, GENERATE_QUEUE_FACTOR says why)
            size = len(ahead) if self.generate else batch_size(ahead, self.budget, self.padded)
            yield k, start, start + size, ahead[:size]
            start, k = start + size, k + 1
