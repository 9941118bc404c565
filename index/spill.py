"""Bounded-memory reordering for indexes larger than memory: records spilled to disk in buckets, each
bucket small enough to sort or place in memory, read back bucket by bucket.

`Scatter` places records at known destinations 0..n-1 (a permutation: the length order, the stride-major
table of a run), bucketed by destination range. `HashBuckets` finds the 64-bit keys that occur more than
once (duplicate ids), bucketed by the keys' top bits. Both keep at most one bucket (`window` records) and
their write buffers in memory, whatever the number of records; the spill files live in a temporary folder
that is removed when they are done.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Iterator

import numpy as np

WINDOW = 8 << 20          # records per bucket (and per chunk of a streaming pass)
_BUFFER_BYTES = 64 << 20  # the write buffers of all buckets together; each is flushed at its share


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
            with open(self.paths[k], "ab") as fh:
                fh.write(b"".join(self.buffers[k]))
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
    string each (ids): `add(..., blobs, blob_lengths)` and `chunks` then also yields them in order."""

    def __init__(self, n: int, dtype, directory: str | None = None, window: int = WINDOW, blob: bool = False):
        self.n, self.window, self.blob = n, max(1, window), blob
        self.dtype = np.dtype([("dest", "<i8"), ("value", np.dtype(dtype))] +
                              ([("blob_len", "<i8")] if blob else []))
        count = max(1, -(-n // self.window))
        self.records = _Buckets(count, directory, "rs-scatter-")
        self.blobs = _Buckets(count, self.records.root, "b") if blob else None

    def add(self, dest: np.ndarray, values: np.ndarray, blobs: np.ndarray | None = None,
            blob_offsets: np.ndarray | None = None) -> None:
        """Records with destinations `dest`; with blobs, record j's bytes are blobs[blob_offsets[j]:blob_offsets[j + 1]]."""
        rec = np.empty(len(dest), self.dtype)
        rec["dest"], rec["value"] = dest, values
        bucket = np.asarray(dest, np.int64) // self.window
        order = np.argsort(bucket, kind="stable")
        bounds = np.searchsorted(bucket[order], np.arange(int(bucket.max(initial=-1)) + 2))
        if self.blob:
            rec["blob_len"] = np.diff(blob_offsets)
        for k in np.flatnonzero(np.diff(bounds)):
            rows = order[bounds[k]:bounds[k + 1]]
            self.records.append(int(k), rec[rows].tobytes())
            if self.blob:
                starts = blob_offsets[:-1][rows]
                gather = _ragged(starts, rec["blob_len"][rows])
                self.blobs.append(int(k), blobs[gather].tobytes())

    def chunks(self) -> Iterator[tuple[int, np.ndarray, np.ndarray | None, np.ndarray | None]]:
        """(first destination, values in destination order, blob bytes, blob offsets) per window."""
        try:
            for k in range(len(self.records.paths)):
                rec = self.records.read(k, self.dtype)
                lo = k * self.window
                size = min(self.window, self.n - lo)
                if len(rec) != size:
                    raise AssertionError(f"scatter window {k}: {len(rec)} records for {size} destinations")
                place = rec["dest"] - lo
                values = np.empty(size, self.dtype["value"])
                values[place] = rec["value"]
                if not self.blob:
                    yield lo, values, None, None
                    continue
                data = self.blobs.read(k, np.uint8)
                lens = rec["blob_len"]
                starts = np.cumsum(lens) - lens
                inverse = np.empty(size, np.int64)
                inverse[place] = np.arange(size)
                out_lens = lens[inverse]
                offsets = np.zeros(size + 1, np.int64)
                np.cumsum(out_lens, out=offsets[1:])
                yield lo, values, data[_ragged(starts[inverse], out_lens)], offsets
        finally:
            self.close()

    def close(self) -> None:
        self.records.close()


class HashBuckets:
    """64-bit keys with their positions, bucketed by their top bits; `repeated` yields the positions of
    every key that occurs more than once, bucket by bucket."""

    def __init__(self, n: int, directory: str | None = None, window: int = WINDOW):
        self.bits = max(0, int(np.ceil(np.log2(max(1, 2 * n / window)))))
        self.dtype = np.dtype([("key", "<u8"), ("pos", "<i8")])
        self.buckets = _Buckets(1 << self.bits, directory, "rs-hashes-")

    def add(self, keys: np.ndarray, positions: np.ndarray) -> None:
        rec = np.empty(len(keys), self.dtype)
        rec["key"], rec["pos"] = keys, positions
        bucket = (keys >> np.uint64(64 - self.bits)).astype(np.int64) if self.bits else np.zeros(len(keys), np.int64)
        order = np.argsort(bucket, kind="stable")
        bounds = np.searchsorted(bucket[order], np.arange((1 << self.bits) + 1))
        for k in np.flatnonzero(np.diff(bounds)):
            self.buckets.append(int(k), rec[order[bounds[k]:bounds[k + 1]]].tobytes())

    def repeated(self) -> Iterator[np.ndarray]:
        """Positions (in input order within each bucket) whose key occurs more than once."""
        try:
            for k in range(len(self.buckets.paths)):
                rec = self.buckets.read(k, self.dtype)
                if len(rec) < 2:
                    continue
                rec = rec[np.argsort(rec["key"], kind="stable")]
                same = rec["key"][1:] == rec["key"][:-1]
                if same.any():
                    mark = np.zeros(len(rec), bool)
                    mark[1:] |= same
                    mark[:-1] |= same
                    yield np.sort(rec["pos"][mark])
        finally:
            self.buckets.close()


def _ragged(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + n) for each (s, n)."""
    lengths = np.asarray(lengths, np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    out_starts = np.cumsum(lengths) - lengths
    return np.repeat(np.asarray(starts, np.int64) - out_starts, lengths) + np.arange(total, dtype=np.int64)


def sorted_pairs(buckets: HashBuckets) -> Iterator[np.ndarray]:
    """Every (key, pos) record of `buckets`, sorted by key (ties by pos), a bucket at a time."""
    try:
        for k in range(len(buckets.buckets.paths)):
            rec = buckets.buckets.read(k, buckets.dtype)
            if len(rec):
                yield rec[np.lexsort((rec["pos"], rec["key"]))]
    finally:
        buckets.buckets.close()
