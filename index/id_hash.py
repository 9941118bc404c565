"""64-bit hashes of record ids, vectorised over a blob of ids back to back: equal ids give equal hashes
(the duplicate-id check compares ids only where hashes repeat)."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

_HASH_BASE = np.uint64(0x100000001B3)         # odd, so invertible modulo 2**64
_HASH_BASE_INV = np.uint64(pow(0x100000001B3, -1, 2**64))
_HASH_LEN = np.uint64(0x9E3779B97F4A7C15)


# Build-time work on all ids runs on this many threads (numpy releases the GIL in sorts and ufuncs): on
# 2.7M ids of the 1 GiB bench file, hashing 0.12 s and the sort 0.15 s on one thread.
_ID_THREADS = min(4, os.cpu_count() or 1)


def _repeated_values(h: np.ndarray) -> np.ndarray:
    """The values that occur more than once in h (uint64), sorted: the two halves of the value range
    sorted on their own threads (a repeat lies within one half)."""
    high = h >= np.uint64(1 << 63)
    halves = [h[~high], h[high]] if len(h) > 1 << 16 and _ID_THREADS > 1 else [h]

    def repeats(part: np.ndarray) -> np.ndarray:
        part = np.sort(part)
        return np.unique(part[1:][part[1:] == part[:-1]])

    with ThreadPoolExecutor(len(halves)) as pool:
        return np.concatenate(list(pool.map(repeats, halves)))


def id_hashes(blob: np.ndarray, offsets: np.ndarray, chunk_bytes: int = 1 << 20) -> np.ndarray:
    """A 64-bit polynomial hash per id, vectorised: equal ids give equal hashes.

    h = sum_j (byte_j + 1) * B**j (mod 2**64), computed for a whole chunk of ids at once as a prefix sum
    of (byte + 1) * B**t over the chunk, rebased to each id's start by multiplying with B**-start. The
    ids are split among _ID_THREADS threads.
    """
    n = len(offsets) - 1
    out = np.empty(n, np.uint64)
    span = min(int(offsets[-1]) if n else 0, chunk_bytes) + 1
    powers, inverse = _tables(span)
    if n <= 1 << 16:   # (a thread pool costs more than a few ids: `get` hashes one at a time)
        return out if _hash_range(blob, offsets, 0, n, chunk_bytes, powers, inverse, out) \
            else _slow_hashes(blob, offsets)
    parts = np.linspace(0, n, _ID_THREADS + 1).astype(np.int64)
    with ThreadPoolExecutor(len(parts) - 1) as pool:
        done = list(pool.map(lambda ab: _hash_range(blob, offsets, ab[0], ab[1], chunk_bytes, powers, inverse, out),
                             zip(parts[:-1], parts[1:])))
    return out if all(done) else _slow_hashes(blob, offsets)


_TABLES: list = []   # [powers, inverse] of the longest span asked so far (read-only, shared by threads)


def _tables(span: int) -> tuple[np.ndarray, np.ndarray]:
    """B**t and B**-t for t < span (computed once per process, then sliced)."""
    if not _TABLES or len(_TABLES[0]) < span:
        size = max(span, 1 << 20) + 1
        powers = np.full(size, _HASH_BASE, np.uint64)
        powers[0] = 1
        np.multiply.accumulate(powers, out=powers)
        inverse = np.full(size, _HASH_BASE_INV, np.uint64)
        inverse[0] = 1
        np.multiply.accumulate(inverse, out=inverse)
        _TABLES[:] = [powers, inverse]
    return _TABLES[0][:span], _TABLES[1][:span]


def _hash_range(blob, offsets, a: int, n: int, chunk_bytes: int, powers, inverse, out) -> bool:
    """id_hashes of ids a..n-1 into out; False if an id is longer than a chunk (the caller goes slow)."""
    a, n = int(a), int(n)
    while a < n:
        # as many whole ids as fit in one chunk (at least one)
        b = max(a + 1, int(np.searchsorted(offsets, offsets[a] + chunk_bytes, "right")) - 1)
        b = min(b, n)
        lo, hi = int(offsets[a]), int(offsets[b])
        if hi - lo + 1 > len(powers):  # a single id longer than the chunk
            return False
        cs = np.zeros(hi - lo + 1, np.uint64)
        np.cumsum((blob[lo:hi].astype(np.uint64) + np.uint64(1)) * powers[:hi - lo], out=cs[1:])
        starts = offsets[a:b] - lo
        out[a:b] = (cs[offsets[a + 1:b + 1] - lo] - cs[starts]) * inverse[starts] \
            + np.diff(offsets[a:b + 1]).astype(np.uint64) * _HASH_LEN
        a = b
    return True


def _slow_hashes(blob: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    data = blob.tobytes()
    return np.array([hash(data[offsets[i]:offsets[i + 1]]) for i in range(len(offsets) - 1)],
                    np.int64).view(np.uint64)
