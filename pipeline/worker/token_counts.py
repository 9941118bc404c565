"""A shard's tokens per sequence, as the batches will encode them, for planning its batches.

Where the tokenizer gives one token per residue (ESM, SaProt's amino acids, ProtT5, the demo model) the index's
residue counts give the tokens exactly (`SequenceTokenizer.tokens_for_residues`). Elsewhere they only bound them
from above: a subword tokenizer's token covers several residues (a causal LM's BPE, ProtGPT2's ~4), a k-mer one
six (Nucleotide Transformer), SaProt's structure-aware input two characters. Batches planned on that bound held
a fraction of their budget (a sixth with 6-mers), so a GPU ran several times the steps, each a fraction full.
`exact_tokens` encodes the shard's sequences once, in chunks, and counts: the batches then fill their budget, the
same batches on every run of the shard (a pure function of its records and the tokenizer).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from index import InputChanged, SequenceIndex

from ..tasks.tokenization import SequenceTokenizer

log = logging.getLogger(__name__)

CHUNK = 2048   # sequences encoded at a time (their texts and tokens held at once)


def exact_tokens(index: SequenceIndex, positions: np.ndarray, tokenizer: SequenceTokenizer,
                 bounds: np.ndarray, alive: Callable[[int], bool] = lambda counted: True) -> np.ndarray:
    """Tokens of each sequence at `positions` as `tokenizer.encode` gives them (cut to its max_tokens where
    set); `bounds` (tokens_for_residues) where they are already exact, for empty records (nothing to encode),
    and for a chunk holding a record that no longer reads as indexed (the batch that reads it stops the shard
    with that error, as without this count). `alive(sequences counted)` after each chunk: the worker's message
    to its parent, whose hang detector hears from it while it counts a large shard; False stops the count (a
    worker told to stop runs no batch: the rest keep their bounds)."""
    if tokenizer.exact_counts or not len(positions):
        return bounds
    t0 = time.time()
    out = np.array(bounds, np.int64, copy=True)
    keep_case = tokenizer.convention.keeps_case
    for a in range(0, len(positions), CHUNK):
        chunk = np.asarray(positions[a:a + CHUNK])
        rows = np.flatnonzero(index.lengths[chunk] > 0)
        if not len(rows):
            continue
        try:
            texts = [index.sequence(int(chunk[r]), keep_case) for r in rows]
        except InputChanged:
            continue
        out[a + rows] = [len(t.ids) for t in tokenizer.encode(texts)]
        if not alive(a + len(chunk)):
            break
    log.info("tokens of %d sequences counted by encoding them (%.1f s): %d, where their residues bound them by %d "
             "(the tokenizer is not one token per residue; batches are planned on the counts)", len(positions),
             time.time() - t0, int(out.sum()), int(np.sum(bounds)))
    return out
