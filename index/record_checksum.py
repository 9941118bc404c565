"""Per-record checksums: 8 bytes per record in the index, so that a worker can tell that the text it just
read is the text that was indexed (an input edited while a run computes).

The checksum of a record is a 64-bit weighted sum over its raw bytes, taken as little-endian 64-bit words at
their absolute position in the (uncompressed) text, the bytes outside the record counting as zero: over words
k of word_k * W(k) + (word_k >> 32) * H(k), mod 2**64, with W(k) and H(k) odd pseudo-random 64-bit weights.

Why this and not a CRC or a hash of the normalised residues: the indexer computes it for every record of a
4 MiB block at once with a few vectorised passes over the block's words (multiplies and a prefix sum), near
memory speed, where a CRC per record costs a Python call per record (2.7 s per GiB of short protein
records, slower than the whole index build). Raw bytes need no normalising in the scanner and are what a
worker reads; any edit, header and line breaks included, changes them. Both terms are sums over the bytes
(a word's bytes shifted down stay apart), so the checksums of a record's pieces add up to the record's.

What it catches: every change of one byte, and other edits with a chance of at most about 2**-33 to miss. A
byte at place j of its word counts 2**(8j) times its weight, so a sum of word times weight alone (KIND 1, the
indexes of run_shards before 2026-12-07) sees a change confined to the top bytes of two words only in its top
bits: two residues edited at byte 7 of their words went unseen about once in 256 (found by a red team: a
continued run merged a row of the record's old text). The high half brings every byte down to place 3 or
below in one of the terms. It guards against accidents, not against someone forging a file.
"""
from __future__ import annotations

import functools
import threading

import numpy as np

# The checksum an index holds (its header's `checksum_kind`): 1, word times weight (indexes of run_shards
# before 2026-12-07, read and checked as they were made); 2, with the high half of each word (KIND, new indexes).
KIND = 2
KINDS = (1, 2)
_SEGMENT_BITS = 19                   # 2**19 words = 4 MiB: the weights of one segment are one table
_SEGMENT = 1 << _SEGMENT_BITS
_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)
_HALF = np.uint64(32)
_TABLE: np.ndarray | None = None
_HIGH: np.ndarray | None = None
_scratch = threading.local()


def _splitmix64(k: np.ndarray) -> np.ndarray:
    """A well-mixed 64-bit value for each uint64 in `k` (SplitMix64's output function)."""
    z = k * np.uint64(0x9E3779B97F4A7C15) + np.uint64(0x632BE59BD9B4E019)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _table() -> np.ndarray:
    global _TABLE
    if _TABLE is None:   # 4 MiB, about 20 ms, once per process
        _TABLE = _splitmix64(np.arange(_SEGMENT, dtype=np.uint64)) | np.uint64(1)
    return _TABLE


def _high_table() -> np.ndarray:
    """H's table: the same construction on the next 2**19 integers (SplitMix64's output function is a bijection,
    so the two tables share no construction input)."""
    global _HIGH
    if _HIGH is None:
        _HIGH = _splitmix64(np.arange(_SEGMENT, 2 * _SEGMENT, dtype=np.uint64)) | np.uint64(1)
    return _HIGH


@functools.lru_cache(maxsize=1024)
def _salt(segment: int) -> np.uint64:
    """The odd factor of a segment's weights (1 for the first)."""
    if segment == 0:
        return np.uint64(1)
    return _splitmix64(np.array([segment], np.uint64))[0] | np.uint64(1)


def weights(k0: int, n: int, high: bool = False) -> np.ndarray:
    """W(k) (H(k) when `high`) for word indices k0 .. k0+n-1: the table entry of k's place in its 4 MiB segment
    times an odd factor drawn from the segment number (every weight stays odd, and segments differ). Within one
    segment the factor is common to all words, so a block scan multiplies by the tables alone and applies the
    factor once per record (`block_checksums`)."""
    table = _high_table() if high else _table()
    out = np.empty(n, np.uint64)
    k, done = k0, 0
    while done < n:
        seg, at = divmod(k, _SEGMENT)
        take = min(n - done, _SEGMENT - at)
        np.multiply(table[at:at + take], _salt(seg), out=out[done:done + take])
        k, done = k + take, done + take
    return out


def checksum(data, offset: int, kind: int = KIND) -> int:
    """The checksum of bytes `data` that sit at `offset` in the text (a whole record, or a piece of one:
    the checksums of a record's pieces add up, mod 2**64, to the record's), of `kind` (KINDS)."""
    raw = memoryview(data).cast("B") if not isinstance(data, bytes) else data
    if len(raw) == 0:
        return 0
    lead = offset % 8
    words = np.frombuffer(b"".join((bytes(lead), raw, bytes(-(lead + len(raw)) % 8))), "<u8")
    segment, at = divmod(offset // 8, _SEGMENT)
    if at + len(words) <= _SEGMENT:   # the common case, a few microseconds for a record
        total = int(np.dot(words, _table()[at:at + len(words)]))
        if kind == 2:
            total += int(np.dot(words >> _HALF, _high_table()[at:at + len(words)]))
        return total * int(_salt(segment)) % (1 << 64)
    total = int(np.sum(words * weights(offset // 8, len(words)), dtype=np.uint64))
    if kind == 2:
        total += int(np.sum((words >> _HALF) * weights(offset // 8, len(words), high=True), dtype=np.uint64))
    return total % (1 << 64)


def add(*checksums: int) -> int:
    return sum(checksums) % (1 << 64)


_BELOW = np.array([(1 << (8 * j)) - 1 for j in range(8)], np.uint64)   # a word's bytes below place j


def block_checksums(words: np.ndarray, k0: int, starts: np.ndarray, ends: np.ndarray,
                    overwrite: bool = False, kind: int = KIND) -> np.ndarray:
    """Checksums of `kind` of records [starts, ends) (byte positions relative to words[0], in increasing order)
    that lie in `words`, the text from word index k0 on as little-endian uint64 (zero past the end of the text),
    best within one 4 MiB segment (a scan block). `overwrite`: `words` may be used as scratch space.

    With G(t) the checksum of the bytes before position t (whole words from a prefix sum of words times
    weights, plus t's own word masked to the bytes below t), a record's checksum is G(end) - G(start); when
    records tile the range (the scan's do), one G per boundary serves two records.
    """
    if len(starts) == 0:
        return np.zeros(0, np.uint64)
    segment, at = divmod(k0, _SEGMENT)
    if at + len(words) <= _SEGMENT:   # a scan block: the segment's factor is applied once per record
        w, salt = _table()[at:at + len(words)], _salt(segment)
        h = _high_table()[at:at + len(words)] if kind == 2 else None
    else:                             # (blocks of other sizes, as tests use)
        w, salt = weights(k0, len(words)), np.uint64(1)
        h = weights(k0, len(words), high=True) if kind == 2 else None
    tiled = np.array_equal(starts[1:], ends[:-1])
    points = [np.append(starts, ends[-1])] if tiled else [starts, ends]
    places, partial = [], []
    for t in points:                  # each word holding a boundary, masked, before `words` is overwritten
        t = t.astype(np.int64)
        k = t >> 3
        mask = _BELOW[t & 7]
        over = k >= len(words)        # a boundary at the very end: all of the last word is below it
        if over.any():
            k, mask = np.where(over, len(words) - 1, k), np.where(over, _ALL, mask)
        places.append(k)
        below = words[k] & mask
        partial.append(below * w[k] if h is None else below * w[k] + (below >> _HALF) * h[k])
    high = None
    if h is not None:   # (before `words` may be overwritten)
        high = np.right_shift(words, _HALF, out=_scratch_array("high", len(words)))
        np.multiply(high, h, out=high)
    product = np.multiply(words, w, out=words if overwrite else _scratch_array("product", len(words)))
    if high is not None:
        np.add(product, high, out=product)
    g = []
    for k, part in zip(places, partial):   # sum of product[:k] for each (non-decreasing) k
        idx = np.concatenate((np.zeros(1, np.int64), k))
        between = np.add.reduceat(product, idx)[:-1]
        between[idx[:-1] == idx[1:]] = 0
        g.append(np.cumsum(between) + part)
    return (np.diff(g[0]) if tiled else g[1] - g[0]) * salt


def _scratch_array(name: str, n: int) -> np.ndarray:
    """This thread's uint64 scratch array `name`, n long: reused, since a fresh 4 MiB array page-faults each time."""
    found = getattr(_scratch, name, None)
    if found is None or len(found) < n:
        found = np.empty(max(n, _SEGMENT), np.uint64)
        setattr(_scratch, name, found)
    return found[:n]
