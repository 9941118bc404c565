"""A shard's tokens per sequence, as the batches will encode them, for planning its batches.

Where the tokenizer gives one token per residue (ESM, SaProt's amino acids, ProtT5, the demo model) the index's
residue counts give the tokens exactly (`SequenceTokenizer.tokens_for_residues`). Elsewhere they only bound them
from above: a subword tokenizer's token covers several residues (a causal LM's BPE, ProtGPT2's ~4), a k-mer one
six (Nucleotide Transformer), SaProt's structure-aware input two characters. Batches planned on that bound held
a fraction of their budget (a sixth with 6-mers), so a GPU ran several times the steps, each a fraction full.
`exact_tokens` encodes the shard's sequences once, in chunks, and counts: the batches then fill their budget, the
same batches on every run of the shard (a pure function of its records and the tokenizer). The encodings are kept
(`Encoded`, up to KEEP_TOKENS tokens, compactly) for the batches to take instead of encoding the same texts again:
a Python tokenizer (Nucleotide Transformer's, ~0.6 us a nucleotide) is the worker's largest host cost.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from index import InputChanged, SequenceIndex

from ..tasks.tokenization import SequenceTokenizer, Tokenized

log = logging.getLogger(__name__)

CHUNK = 2048              # sequences encoded at a time (their texts and tokens held at once)
KEEP_TOKENS = 1 << 24     # encodings kept for the batches: ~5 bytes a token (80 MiB at most), in shard order


class Encoded:
    """Encodings made while counting, by FASTA position, each taken once by the batch that reads its record."""

    def __init__(self, room: int = KEEP_TOKENS, wanted: np.ndarray | None = None):
        """`wanted`: per sequence counted (in the order counted), whether a batch will read it (a resumed shard's
        done records are counted, not read); None: all."""
        self.room, self.wanted = room, wanted
        self._kept: dict[int, tuple[np.ndarray, np.ndarray, bool, int]] = {}

    def keep(self, nth: int, position: int, tok: Tokenized) -> bool:
        """Keep `tok`, the `nth` sequence counted, while there is room (False once there is none: the rest are
        encoded again by their batches)."""
        if self.wanted is not None and not self.wanted[nth]:
            return True
        if len(tok.ids) > self.room:
            self.room = 0
            return False
        self.room -= len(tok.ids)
        self._kept[position] = (np.asarray(tok.ids, np.int32), tok.special, tok.truncated, tok.num_unknown)
        return True

    def take(self, position: int, text: str) -> Tokenized | None:
        """The record's encoding, if kept, as `encode` gave it for `text` (the same record's text, read again
        and checked against its checksum by the batch)."""
        kept = self._kept.pop(position, None)
        if kept is None:
            return None
        ids, special, truncated, num_unknown = kept
        return Tokenized(ids.tolist(), special, truncated, num_unknown, text)

    def __len__(self) -> int:
        return len(self._kept)


def exact_tokens(index: SequenceIndex, positions: np.ndarray, tokenizer: SequenceTokenizer,
                 bounds: np.ndarray, alive: Callable[[int], bool] = lambda counted: True,
                 encoded: Encoded | None = None) -> np.ndarray:
    """Tokens of each sequence at `positions` as `tokenizer.encode` gives them (cut to its max_tokens where
    set); `bounds` (tokens_for_residues) where they are already exact, for empty records (nothing to encode),
    and for a chunk holding a record that no longer reads as indexed (the batch that reads it stops the shard
    with that error, as without this count). `alive(sequences counted)` after each chunk: the worker's message
    to its parent, whose hang detector hears from it while it counts a large shard; False stops the count (a
    worker told to stop runs no batch: the rest keep their bounds). `encoded`: where to keep the encodings for
    the batches, while it has room."""
    if tokenizer.exact_counts or not len(positions):
        return bounds
    t0 = time.time()
    out = np.array(bounds, np.int64, copy=True)
    keep_case = tokenizer.convention.keeps_case
    room = encoded is not None
    for a in range(0, len(positions), CHUNK):
        chunk = np.asarray(positions[a:a + CHUNK])
        rows = np.flatnonzero(index.lengths[chunk] > 0)
        if not len(rows):
            continue
        try:
            texts = [index.sequence(int(chunk[r]), keep_case) for r in rows]
        except InputChanged:
            continue
        toks = tokenizer.encode(texts)
        out[a + rows] = [len(t.ids) for t in toks]
        for r, tok in zip(rows, toks):
            room = room and encoded.keep(a + int(r), int(chunk[r]), tok)
        if not alive(a + len(chunk)):
            break
    log.info("tokens of %d sequences counted by encoding them (%.1f s): %d, where their residues bound them by %d "
             "(the tokenizer is not one token per residue; batches are planned on the counts%s)", len(positions),
             time.time() - t0, int(out.sum()), int(np.sum(bounds)),
             "" if encoded is None else f"; {len(encoded)} encodings kept for them")
    return out
