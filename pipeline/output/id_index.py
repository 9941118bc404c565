"""The id index of a result file: every row's id hash, sorted, with its row, so that a row is found by id
with two small reads instead of reading every id.

    id_index/hashes  uint64 [N]   the 64-bit hash of each row's id (index.id_hash), ascending
    id_index/rows    int64  [N]   the row of each hash
    id_index/fence   uint64 [B]   hashes[::BLOCK], read once when the result is opened (8 bytes per BLOCK rows)

A lookup hashes the id, finds its block in the fence, reads that block of `hashes` and `rows` (one HDF5
chunk each) and then checks the id stored at the row (hashes may collide). The merge writes it with bounded
memory: the hashes are bucketed on disk by their top bits and each bucket sorted (index/spill.py).
"""
from __future__ import annotations

import os

import h5py
import numpy as np

from index.id_hash import id_hashes
from index.spill import HashBuckets, sorted_pairs

GROUP = "id_index"
BLOCK = 4096   # rows of hashes per block and per HDF5 chunk


def hashes_of(ids) -> np.ndarray:
    """The id hash of each id (str or bytes)."""
    try:
        blob = b"".join(ids)   # the merge's ids are bytes already
        raw = ids
    except TypeError:
        raw = [i.encode() if isinstance(i, str) else bytes(i) for i in ids]
        blob = b"".join(raw)
    offsets = np.zeros(len(raw) + 1, np.int64)
    np.cumsum(np.fromiter(map(len, raw), np.int64, len(raw)), out=offsets[1:])
    return id_hashes(np.frombuffer(blob, np.uint8), offsets)


class IdIndexWriter:
    """Collects (id, row) as the merge appends rows; `write` stores the sorted index in the result."""

    def __init__(self, rows_hint: int, directory: str | os.PathLike):
        self.buckets = HashBuckets(max(1, rows_hint), os.fspath(directory))
        self.rows = 0

    def add(self, ids: np.ndarray) -> None:
        if len(ids):
            self.buckets.add(hashes_of(ids), np.arange(self.rows, self.rows + len(ids), dtype=np.int64))
            self.rows += len(ids)

    def write(self, file: h5py.File) -> None:
        n = self.rows
        group = file.create_group(GROUP)
        chunk = (max(1, min(BLOCK, n)),)
        hashes = group.create_dataset("hashes", shape=(n,), dtype="<u8", chunks=chunk)
        rows = group.create_dataset("rows", shape=(n,), dtype="<i8", chunks=chunk)
        fence, at = [], 0
        for rec in sorted_pairs(self.buckets):
            hashes[at:at + len(rec)] = rec["key"]
            rows[at:at + len(rec)] = rec["pos"]
            first = -at % BLOCK   # the fence entries that fall in this piece
            fence.append(rec["key"][first::BLOCK])
            at += len(rec)
        group.create_dataset("fence", data=np.concatenate(fence) if fence else np.zeros(0, np.uint64))
        group.attrs["block"] = BLOCK
        group.attrs["hash"] = "index.id_hash.id_hashes of the UTF-8 id"


class IdIndex:
    """Lookups in a result's id index (the file stays open in the caller's hands)."""

    def __init__(self, file: h5py.File):
        group = file[GROUP]
        self.hashes, self.rows = group["hashes"], group["rows"]
        self.fence = group["fence"][:]
        self.block = int(group.attrs["block"])

    def candidates(self, key: int) -> np.ndarray:
        """The rows whose id hash is `key` (usually one; none when no row has it)."""
        k = max(0, int(np.searchsorted(self.fence, np.uint64(key), "left")) - 1)
        found, n = [], len(self.hashes)
        while k * self.block < n:
            a, b = k * self.block, min(n, (k + 1) * self.block)
            block = self.hashes[a:b]
            lo, hi = np.searchsorted(block, np.uint64(key), "left"), np.searchsorted(block, np.uint64(key), "right")
            if hi > lo:
                found.append(self.rows[a + lo:a + hi])
            if hi < len(block) or b == n:   # the run of equal hashes ends in this block
                break
            k += 1
        return np.concatenate(found) if found else np.zeros(0, np.int64)
