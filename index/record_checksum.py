"""Per-record checksums: 8 bytes per record in the index, so that a worker can tell that the text it just
read is the text that was indexed (an input edited while a run computes).

The checksum of a record is a 64-bit weighted sum of its raw bytes, taken as little-endian 64-bit words at
their absolute position in the (uncompressed) text: sum over words k of word_k * W(k) mod 2**64, the bytes
outside the record counting as zero, with W(k) an odd pseudo-random 64-bit weight per word index.

Why this and not a CRC or a hash of the normalised residues: the indexer computes it for every record of a
4 MiB block at once with a few vectorised passes over the block's words (a multiply and a prefix sum), at
about memory speed, where a CRC per record costs a Python call per record (2.7 s per GiB of short protein
records, slower than the whole index build). Raw bytes need no normalising in the scanner and are what a
worker reads; any edit, header and line breaks included, changes them. What it catches: every change of
one byte (the weight is odd, so a byte's change times its weight is never 0 mod 2**64), and other edits
with a chance of about 2**-56 to miss. It guards against accidents, not against someone forging a file.
"""
from __future__ import annotations

import functools
import threading

import numpy as np

_SEGMENT_BITS = 19                   # 2**19 words = 4 MiB: the weights of one segment are one table
_SEGMENT = 1 << _SEGMENT_BITS
_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)
_TABLE: np.ndarray | None = None
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


@functools.lru_cache(maxsize=1024)
def _salt(segment: int) -> np.uint64:
    """The odd factor of a segment's weights (1 for the first)."""
    if segment == 0:
        return np.uint64(1)
    return _splitmix64(np.array([segment], np.uint64))[0] | np.uint64(1)


def weights(k0: int, n: int) -> np.ndarray:
    """W(k) for word indices k0 .. k0+n-1: the table entry of k's place in its 4 MiB segment times an odd
    factor drawn from the segment number (every weight stays odd, and segments differ). Within one segment
    the factor is common to all words, so a block scan multiplies by the table alone and applies the factor
    once per record (`block_checksums`)."""
    table = _table()
    out = np.empty(n, np.uint64)
    k, done = k0, 0
    while done < n:
        seg, at = divmod(k, _SEGMENT)
        take = min(n - done, _SEGMENT - at)
        np.multiply(table[at:at + take], _salt(seg), out=out[done:done + take])
        k, done = k + take, done + take
    return out


def checksum(data, offset: int) -> int:
    """The checksum of bytes `data` that sit at `offset` in the text (a whole record, or a piece of one:
    the checksums of a record's pieces add up, mod 2**64, to the record's)."""
    raw = memoryview(data).cast("B") if not isinstance(data, bytes) else data
    if len(raw) == 0:
        return 0
    lead = offset % 8
    words = np.frombuffer(b"".join((bytes(lead), raw, bytes(-(lead + len(raw)) % 8))), "<u8")
    segment, at = divmod(offset // 8, _SEGMENT)
    if at + len(words) <= _SEGMENT:   # the common case, a few microseconds for a record
        return int(np.dot(words, _table()[at:at + len(words)])) * int(_salt(segment)) % (1 << 64)
    return int(np.sum(words * weights(offset // 8, len(words)), dtype=np.uint64))


def add(*checksums: int) -> int:
    return sum(checksums) % (1 << 64)


_BELOW = np.array([(1 << (8 * j)) - 1 for j in range(8)], np.uint64)   # a word's bytes below place j


def block_checksums(words: np.ndarray, k0: int, starts: np.ndarray, ends: np.ndarray,
                    overwrite: bool = False) -> np.ndarray:
    """Checksums of records [starts, ends) (byte positions relative to words[0], in increasing order) that
    lie in `words`, the text from word index k0 on as little-endian uint64 (zero past the end of the text),
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
    else:                             # (blocks of other sizes, as tests use)
        w, salt = weights(k0, len(words)), np.uint64(1)
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
        partial.append((words[k] & mask) * w[k])
    if overwrite:
        product = np.multiply(words, w, out=words)
    else:
        scratch = getattr(_scratch, "words", None)
        if scratch is None or len(scratch) < len(words):   # reused: a fresh 4 MiB array page-faults each time
            scratch = _scratch.words = np.empty(max(len(words), _SEGMENT), np.uint64)
        product = np.multiply(words, w, out=scratch[:len(words)])
    g = []
    for k, part in zip(places, partial):   # sum of product[:k] for each (non-decreasing) k
        idx = np.concatenate((np.zeros(1, np.int64), k))
        between = np.add.reduceat(product, idx)[:-1]
        between[idx[:-1] == idx[1:]] = 0
        g.append(np.cumsum(between) + part)
    return (np.diff(g[0]) if tiled else g[1] - g[0]) * salt
