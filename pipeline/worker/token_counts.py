"""A shard's tokens per sequence, as the batches will encode them, for planning its batches.

Where the tokenizer gives one token per residue (ESM, SaProt's amino acids, ProtT5, the demo model) the index's
residue counts give the tokens exactly (`SequenceTokenizer.tokens_for_residues`). Elsewhere they only bound them
from above: a subword tokenizer's token covers several residues (a causal LM's BPE, ProtGPT2's ~4), a k-mer one
six (Nucleotide Transformer), SaProt's structure-aware input two characters. Batches planned on that bound held
a fraction of their budget (a sixth with 6-mers), so a GPU ran several times the steps, each a fraction full.

`TokenCounter` encodes the shard's sequences in order, in a thread of its own, ahead of the batches: the batches
are planned as the counts arrive (the same batches as a plan on every count at once: a pure function of the shard's
records and the tokenizer), and take the encodings it keeps (`Encoded`) instead of encoding the same texts again.
So the tokenizer's work is done once, beside the device's rather than before it; the thread waits while the
encodings it keeps ahead of the batches fill their room (KEEP_TOKENS), unless the batches wait for its counts.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from index import InputChanged, SequenceIndex

from ..tasks.tokenization import SequenceTokenizer, Tokenized

log = logging.getLogger(__name__)

CHUNK = 2048              # sequences encoded at a time (their texts and tokens held at once)
KEEP_TOKENS = 1 << 24     # encodings kept ahead of the batches: ~5 bytes a token (80 MiB), then the counter waits
HEARTBEAT_SECONDS = 1.0   # while the batches wait for counts: `alive` this often


class Encoded:
    """Encodings made while counting, by FASTA position, each taken once by the batch that reads its record."""

    def __init__(self, room: int = KEEP_TOKENS, wanted: np.ndarray | None = None):
        """`wanted`: per sequence counted (in the order counted), whether a batch will read it (a resumed shard's
        done records are counted, not read); None: all."""
        self.room, self.wanted = room, wanted
        self.held = 0
        self.changed = threading.Condition()
        self._kept: dict[int, tuple[np.ndarray, np.ndarray, bool, int]] = {}

    def keep(self, nth: int, position: int, tok: Tokenized) -> None:
        """Keep `tok`, the `nth` sequence counted (if a batch will read it)."""
        if self.wanted is not None and not self.wanted[nth]:
            return
        with self.changed:
            self._kept[position] = (np.asarray(tok.ids, np.int32), tok.special, tok.truncated, tok.num_unknown)
            self.held += len(tok.ids)

    def full(self) -> bool:
        return self.held > self.room

    def take(self, position: int, text: str) -> Tokenized | None:
        """The record's encoding, if kept, as `encode` gave it for `text` (the same record's text, read again
        and checked against its checksum by the batch)."""
        with self.changed:
            kept = self._kept.pop(position, None)
            if kept is None:
                return None
            self.held -= len(kept[0])
            self.changed.notify_all()
        ids, special, truncated, num_unknown = kept
        return Tokenized(ids.tolist(), special, truncated, num_unknown, text)

    def __len__(self) -> int:
        return len(self._kept)


class TokenCounter:
    """The tokens of the sequences at `positions`, as `tokenizer.encode` gives them (cut to its max_tokens where
    set), counted in order by a thread of its own; `tokens[:counted]` are final. `bounds` (tokens_for_residues)
    stand where they are exact already (then nothing is counted), for empty records (nothing to encode), and for
    a chunk holding a record that no longer reads as indexed (the batch that reads it stops the shard with that
    error, as without this count). `encoded`: where to keep the encodings for the batches."""

    def __init__(self, index: SequenceIndex, positions: np.ndarray, tokenizer: SequenceTokenizer, bounds: np.ndarray,
                 encoded: Encoded | None = None, count: bool = True):
        self.index, self.positions, self.tokenizer = index, np.asarray(positions), tokenizer
        self.tokens = np.array(bounds, np.int64, copy=True)
        self.bounds_sum = int(np.sum(bounds))
        self.encoded = encoded if encoded is not None else Encoded()
        self.needed = 0                  # the batches wait for tokens[:needed]: count past a full room
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = None
        if not count or tokenizer.exact_counts or not len(self.positions):
            self.counted = len(self.positions)
            return
        self.counted = 0
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="token-counter", daemon=True)
        self._thread.start()

    def wait_for(self, end: int, alive: Callable[[int], bool] = lambda counted: True) -> bool:
        """Block until tokens[:end] are counted, calling `alive(counted)` every HEARTBEAT_SECONDS meanwhile (the
        worker's message for its parent's hang detector); False if `alive` said to stop first. Raises what the
        counter met."""
        enc = self.encoded
        with enc.changed:
            self.needed = max(self.needed, end)
            enc.changed.notify_all()
            while self.counted < end and self.error is None:
                if not enc.changed.wait(HEARTBEAT_SECONDS) and not alive(self.counted):
                    return False
        if self.error is not None:
            raise self.error
        return True

    def close(self) -> None:
        """Stop counting (a stopped or failed shard)."""
        self._stop.set()
        with self.encoded.changed:
            self.encoded.changed.notify_all()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        try:
            self._count()
        except BaseException as e:   # handed to the batches, which raise it
            self.error = e
        finally:
            with self.encoded.changed:
                self.encoded.changed.notify_all()

    def _count(self) -> None:
        index, positions, enc = self.index, self.positions, self.encoded
        keep_case = self.tokenizer.convention.keeps_case
        for a in range(0, len(positions), CHUNK):
            with enc.changed:   # wait while what is kept ahead fills its room and the batches need nothing more
                while enc.full() and self.needed <= self.counted and not self._stop.is_set():
                    enc.changed.wait()
            if self._stop.is_set():
                return
            chunk = positions[a:a + CHUNK]
            rows = np.flatnonzero(index.lengths[chunk] > 0)
            toks = []
            if len(rows):
                try:
                    texts = [index.sequence(int(chunk[r]), keep_case) for r in rows]
                except InputChanged:
                    texts = None
                if texts is not None:
                    toks = self.tokenizer.encode(texts)
            for r, tok in zip(rows, toks):
                self.tokens[a + r] = len(tok.ids)
                enc.keep(a + int(r), int(chunk[r]), tok)
            with enc.changed:
                self.counted = a + len(chunk)
                enc.changed.notify_all()
        log.info("tokens of %d sequences counted by encoding them (%.1f s, beside the batches): %d, where their "
                 "residues bound them by %d (the tokenizer is not one token per residue; batches are planned on the "
                 "counts)", len(positions), time.monotonic() - self._t0, int(self.tokens.sum()), self.bounds_sum)

