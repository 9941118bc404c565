"""64-bit hashes of record ids, vectorised over a blob of ids back to back: equal ids give equal hashes
(the duplicate-id check compares ids only where hashes repeat)."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

_HASH_BASE = np.uint64(0x100000001B3)         # odd, so invertible modulo 2**64
_HASH_LEN = np.uint64(0x9E3779B97F4A7C15)
# A second hash of the same ids with another base (`check=True`): a result's id index keeps it beside the
# first, so a lookup tells ids apart by 128 bits without reading the id itself.
_CHECK_BASE = np.uint64(0xC2B2AE3D27D4EB4F)
_CHECK_LEN = np.uint64(0x165667B19E3779F9)


def affinity_cpus() -> int:
    """The CPUs this process may run on (its affinity: a SLURM task's cpuset, `taskset`), where the system says;
    the machine's count elsewhere. The index's threads are sized on it, not on every core of the node."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# Build-time work on all ids runs on this many threads (numpy releases the GIL in sorts and ufuncs): on
# 2.7M ids of the 1 GiB bench file, hashing 0.12 s and the sort 0.15 s on one thread.
_ID_THREADS = min(4, affinity_cpus())


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


def id_hashes(blob: np.ndarray, offsets: np.ndarray, chunk_bytes: int = 1 << 20, check: bool = False) -> np.ndarray:
    """A 64-bit polynomial hash per id, vectorised: equal ids give equal hashes.

    h = sum_j (byte_j + 1) * B**j (mod 2**64), computed for a whole chunk of ids at once as a prefix sum
    of (byte + 1) * B**t over the chunk, rebased to each id's start by multiplying with B**-start. The
    ids are split among _ID_THREADS threads. `check`: the second hash, with another base B.
    """
    n = len(offsets) - 1
    out = np.empty(n, np.uint64)
    span = min(int(offsets[-1]) if n else 0, chunk_bytes) + 1
    base, length = (_CHECK_BASE, _CHECK_LEN) if check else (_HASH_BASE, _HASH_LEN)
    powers, inverse = _tables(span, base)
    if n <= 1 << 16:   # (a thread pool costs more than a few ids: `get` hashes one at a time)
        _hash_range(blob, offsets, 0, n, chunk_bytes, powers, inverse, base, length, out)
        return out
    parts = np.linspace(0, n, _ID_THREADS + 1).astype(np.int64)
    with ThreadPoolExecutor(len(parts) - 1) as pool:
        list(pool.map(lambda ab: _hash_range(blob, offsets, ab[0], ab[1], chunk_bytes, powers, inverse, base,
                                             length, out), zip(parts[:-1], parts[1:])))
    return out


_TABLES: dict = {}   # base -> [powers, inverse] of the longest span asked so far (read-only, shared by threads)


def _tables(span: int, base: np.uint64 = _HASH_BASE) -> tuple[np.ndarray, np.ndarray]:
    """B**t and B**-t for t < span (computed once per process, then sliced; grown by doubling, so that
    `get`'s one short id costs no 1 MiB tables: those took 60 ms of a cold lookup's 61)."""
    tables = _TABLES.get(int(base))
    if tables is None or len(tables[0]) < span:
        size = max(span, 2 * len(tables[0]) if tables else 1 << 10) + 1
        powers = np.full(size, base, np.uint64)
        powers[0] = 1
        np.multiply.accumulate(powers, out=powers)
        inverse = np.full(size, np.uint64(pow(int(base), -1, 2**64)), np.uint64)   # (B is odd: invertible)
        inverse[0] = 1
        np.multiply.accumulate(inverse, out=inverse)
        tables = _TABLES[int(base)] = [powers, inverse]
    return tables[0][:span], tables[1][:span]


def _hash_range(blob, offsets, a: int, n: int, chunk_bytes: int, powers, inverse, base, length, out) -> None:
    """id_hashes of ids a..n-1 into out."""
    a, n = int(a), int(n)
    while a < n:
        # as many whole ids as fit in one chunk (at least one)
        b = max(a + 1, int(np.searchsorted(offsets, offsets[a] + chunk_bytes, "right")) - 1)
        b = min(b, n)
        lo, hi = int(offsets[a]), int(offsets[b])
        if hi - lo + 1 > len(powers):  # a single id longer than the chunk
            out[a] = _long_hash(blob[lo:hi], len(powers) - 1, base, length)
            a += 1
            continue
        cs = np.zeros(hi - lo + 1, np.uint64)
        np.cumsum((blob[lo:hi].astype(np.uint64) + np.uint64(1)) * powers[:hi - lo], out=cs[1:])
        starts = offsets[a:b] - lo
        out[a:b] = (cs[offsets[a + 1:b + 1] - lo] - cs[starts]) * inverse[starts] \
            + np.diff(offsets[a:b + 1]).astype(np.uint64) * length
        a = b


def _long_hash(ident: np.ndarray, step: int, base, length) -> np.uint64:
    """The same hash of one id longer than a chunk, a piece at a time (sum over pieces of the piece's own
    hash times B to the piece's start)."""
    powers, _ = _tables(step + 1, base)
    total, scale = np.zeros(1, np.uint64), np.ones(1, np.uint64)
    for a in range(0, len(ident), step):
        piece = ident[a:a + step]
        total += np.sum((piece.astype(np.uint64) + np.uint64(1)) * powers[:len(piece)], dtype=np.uint64) * scale
        scale *= powers[len(piece)]
    return (total + np.array([len(ident)], np.uint64) * length)[0]
