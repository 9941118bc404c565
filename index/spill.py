"""Bounded-memory reordering for indexes larger than memory: records spilled to disk in buckets, each
bucket small enough to sort or place in memory, read back bucket by bucket.

`Scatter` places records at known destinations 0..n-1 (a permutation: the length order, the stride-major
table of a run), bucketed by destination range. `HashBuckets` finds the 64-bit keys that occur more than
once (duplicate ids), bucketed by the keys' top bits. `KeyedPairs` sorts (key, value) pairs by key,
bucketed by key range (a run's copies, by the row they copy). Both keep at most one bucket (`window` records) and
their write buffers in memory, whatever the number of records; the spill files live in a temporary folder
(named `.rs-*`, which a run's next command removes if a killed one left it) that is removed when they are done.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import numpy as np

WINDOW = 8 << 20          # records per bucket (and per chunk of a streaming pass)
_BUFFER_BYTES = 32 << 20  # the write buffers of all buckets together; each is flushed at its share


class _Buckets:
    """Append-only spill files, one per bucket, each with a small write buffer."""

    def __init__(self, count: int, directory: str | None, prefix: str):
        self.root = tempfile.mkdtemp(prefix=prefix, dir=directory)
        self.paths = [os.path.join(self.root, f"{k}.bin") for k in range(count)]
        self.buffers: list[list[bytes]] = [[] for _ in range(count)]
        self.sizes = [0] * count
        self.flush_at = max(64 << 10, _BUFFER_BYTES // max(1, count))

    def append(self, k: int, data: bytes) -> None:
        self.buffers[k].append(data)
        self.sizes[k] += len(data)
        if self.sizes[k] >= self.flush_at:
            self.flush(k)

    def flush(self, k: int) -> None:
        if self.buffers[k]:
            try:
                with open(self.paths[k], "ab") as fh:
                    fh.write(b"".join(self.buffers[k]))
            except OSError as e:   # (a write's or close's error names no file: a full disk's message says which)
                e.filename = e.filename or self.paths[k]
                raise
            self.buffers[k], self.sizes[k] = [], 0

    def read(self, k: int, dtype) -> np.ndarray:
        """The whole of bucket k (then deleted from disk)."""
        self.flush(k)
        if not os.path.exists(self.paths[k]):
            return np.zeros(0, dtype)
        data = np.fromfile(self.paths[k], dtype)
        os.unlink(self.paths[k])
        return data

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


class Scatter:
    """Records of a fixed-width dtype, each with a destination in 0..n-1 (every destination once), read
    back in destination order, one window at a time. `blob` records may carry a variable-length byte
    string each (ids): `add(..., blobs, blob_offsets)` and `chunks` then also yields them in order."""

    def __init__(self, n: int, dtype, directory: str | None = None, window: int = WINDOW, blob: bool = False):
        self.n, self.window, self.blob = n, max(1, window), blob
        self.dtype = np.dtype(dtype)
        self.raw = np.dtype(f"V{self.dtype.itemsize}")   # records moved as bytes (no per-field copies)
        count = max(1, -(-n // self.window))
        self.records = _Buckets(count, directory, ".rs-scatter-")
        self.dests = _Buckets(count, self.records.root, "d")
        self.blobs = _Buckets(count, self.records.root, "b") if blob else None

    def add(self, dest: np.ndarray, values: np.ndarray, blobs: np.ndarray | None = None,
            blob_offsets: np.ndarray | None = None) -> None:
        """Records with destinations `dest`; with blobs, record j's bytes are blobs[blob_offsets[j]:blob_offsets[j + 1]]."""
        dest = np.asarray(dest, np.int64)
        values = np.ascontiguousarray(values, self.dtype)
        if self.blob:
            lens = np.diff(blob_offsets).astype(np.int64)
            dest_rec = np.empty(len(dest), [("dest", "<i8"), ("len", "<i8")])
            dest_rec["dest"], dest_rec["len"] = dest, lens
        else:
            dest_rec = dest
        if len(self.records.paths) == 1:
            self.records.append(0, values.tobytes())
            self.dests.append(0, dest_rec.tobytes())
            if self.blob:
                self.blobs.append(0, blobs[int(blob_offsets[0]):int(blob_offsets[-1])].tobytes())
            return
        order, bounds = _group(dest // self.window, len(self.records.paths))
        raw = values.view(self.raw)
        for k in np.flatnonzero(np.diff(bounds)):
            rows = order[bounds[k]:bounds[k + 1]]
            self.records.append(int(k), raw[rows].tobytes())
            self.dests.append(int(k), dest_rec[rows].tobytes())
            if self.blob:
                self.blobs.append(int(k), blobs[ragged_arange(blob_offsets[:-1][rows], lens[rows])].tobytes())

    def chunks(self) -> Iterator[tuple[int, np.ndarray, np.ndarray | None, np.ndarray | None]]:
        """(first destination, values in destination order, blob bytes, blob offsets) per window."""
        try:
            for k in range(len(self.records.paths)):
                lo = k * self.window
                size = min(self.window, self.n - lo)
                rec = self.records.read(k, self.raw)
                dest = self.dests.read(k, [("dest", "<i8"), ("len", "<i8")] if self.blob else np.int64)
                if len(rec) != size or len(dest) != size:
                    raise AssertionError(f"scatter window {k}: {len(rec)} records for {size} destinations")
                place = (dest["dest"] if self.blob else dest) - lo
                values = np.empty(size, self.raw)
                values[place] = rec
                values = values.view(self.dtype)
                if not self.blob:
                    yield lo, values, None, None
                    continue
                data = self.blobs.read(k, np.uint8)
                lens = dest["len"]
                starts = np.cumsum(lens) - lens
                inverse = np.empty(size, np.int64)
                inverse[place] = np.arange(size)
                out_lens = lens[inverse]
                offsets = np.zeros(size + 1, np.int64)
                np.cumsum(out_lens, out=offsets[1:])
                yield lo, values, data[ragged_arange(starts[inverse], out_lens)], offsets
        finally:
            self.close()

    def close(self) -> None:
        self.records.close()


class HashBuckets:
    """64-bit keys with their positions (and `payload` fields), bucketed by their top bits; `repeated`
    yields the positions of every key that occurs more than once, bucket by bucket."""

    def __init__(self, n: int, directory: str | None = None, window: int = WINDOW, payload: list | None = None):
        self.bits = max(0, int(np.ceil(np.log2(max(1, 2 * n / window)))))
        self.dtype = np.dtype([("key", "<u8"), ("pos", "<i8")] + list(payload or []))
        self.buckets = _Buckets(1 << self.bits, directory, ".rs-hashes-")

    def add(self, keys: np.ndarray, positions: np.ndarray, **payload: np.ndarray) -> None:
        rec = np.empty(len(keys), self.dtype)
        rec["key"], rec["pos"] = keys, positions
        for name, values in payload.items():
            rec[name] = values
        if not self.bits:
            self.buckets.append(0, rec.tobytes())
            return
        order, bounds = _group((keys >> np.uint64(64 - self.bits)).astype(np.int64), 1 << self.bits)
        for k in np.flatnonzero(np.diff(bounds)):
            self.buckets.append(int(k), rec[order[bounds[k]:bounds[k + 1]]].tobytes())

    def records(self) -> Iterator[np.ndarray]:
        """Every record, a bucket at a time (in the order added within a bucket; then removed from disk)."""
        try:
            for k in range(len(self.buckets.paths)):
                rec = self.buckets.read(k, self.dtype)
                if len(rec):
                    yield rec
        finally:
            self.buckets.close()

    def repeated(self) -> Iterator[np.ndarray]:
        """Positions (in input order within each bucket) whose key occurs more than once; the buckets are
        sorted two at a time on threads (numpy's sort releases the GIL)."""
        try:
            with ThreadPoolExecutor(2) as pool:
                yield from (p for p in pool.map(self._repeated_in, range(len(self.buckets.paths))) if len(p))
        finally:
            self.buckets.close()

    def _repeated_in(self, k: int) -> np.ndarray:
        rec = self.buckets.read(k, self.dtype)
        if len(rec) < 2:
            return np.zeros(0, np.int64)
        keys = np.sort(rec["key"])
        again = np.unique(keys[1:][keys[1:] == keys[:-1]])
        return np.sort(rec["pos"][np.isin(rec["key"], again)]) if len(again) else np.zeros(0, np.int64)


class KeyedPairs:
    """(key, value) int64 pairs with keys in 0 .. key_count - 1, read back sorted by key (the pairs of one
    key in the order they were added), bucketed on disk by key range: memory holds one bucket, about
    `window` pairs (more only where one key has that many values)."""

    DTYPE = np.dtype([("key", "<i8"), ("value", "<i8")])

    def __init__(self, key_count: int, expected: int, directory: str | None = None, window: int = WINDOW // 4):
        count = max(1, -(-max(1, expected) // window))
        self.width = max(1, -(-max(1, key_count) // count))
        self.buckets = _Buckets(count, directory, ".rs-pairs-")
        self.count = 0

    def add(self, keys: np.ndarray, values: np.ndarray) -> None:
        rec = np.empty(len(keys), self.DTYPE)
        rec["key"], rec["value"] = keys, values
        self.count += len(rec)
        order, bounds = _group(np.asarray(keys, np.int64) // self.width, len(self.buckets.paths))
        for k in np.flatnonzero(np.diff(bounds)):
            self.buckets.append(int(k), rec[order[bounds[k]:bounds[k + 1]]].tobytes())

    def chunks(self) -> Iterator[np.ndarray]:
        """The pairs sorted by key, a bucket at a time (then the spill files are removed)."""
        try:
            for k in range(len(self.buckets.paths)):
                rec = self.buckets.read(k, self.DTYPE)
                if len(rec):
                    yield rec[np.argsort(rec["key"], kind="stable")]
        finally:
            self.buckets.close()


def _group(bucket: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """A stable order of the items by bucket, and where each bucket's items start in it (count + 1)."""
    key = bucket.astype(np.uint16) if count <= 1 << 16 else bucket   # numpy sorts 16-bit keys by radix
    order = np.argsort(key, kind="stable")
    return order, np.searchsorted(key[order], np.arange(count + 1))


def ragged_arange(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + n) for each (s, n)."""
    lengths = np.asarray(lengths, np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    out_starts = np.cumsum(lengths) - lengths
    return np.repeat(np.asarray(starts, np.int64) - out_starts, lengths) + np.arange(total, dtype=np.int64)


def sorted_pairs(buckets: HashBuckets) -> Iterator[np.ndarray]:
    """Every record of `buckets`, sorted by key (ties in the order added: by pos, where positions were
    added in increasing order), a bucket at a time."""
    for rec in buckets.records():
        yield rec[np.argsort(rec["key"], kind="stable")]
