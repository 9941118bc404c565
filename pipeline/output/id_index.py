"""The id index of a result file: every row's id hashed twice, sorted, with its row, so that a row is found
by id with one small read instead of reading every id.

    id_index/table   [N] (hash uint64, check uint64, row int64), sorted by hash: contiguous in the file
    id_index/fence   uint64 [B]   table["hash"][::BLOCK], read once when the result is opened (8 bytes per
                                  BLOCK rows: 0.8 MB at 100M rows)

`hash` and `check` are two 64-bit polynomial hashes of the UTF-8 id with different bases
(index/id_hash.py). A lookup hashes the id, finds its block in the fence and reads that block of the table
(one contiguous read of BLOCK x 24 bytes, no chunk index to walk), and takes the rows whose hash and check
both match: 128 bits tell ids apart. (Polynomial hashes modulo 2**64 can be made to collide on purpose by
ids of thousands of bytes; the reader checks the id itself for ids over 256 bytes, and `get` checks every
row's id, which it reads with the row: a damaged entry is named, never answered with another record's
row.) The merge writes it with bounded memory: the hashes are bucketed on disk by their top bits and each
bucket sorted (index/spill.py). Results written by an earlier version have `hashes` and `rows` (chunked) instead of
`table`; they are read as well, each match checked against the id stored at its row.
"""
from __future__ import annotations

import os

import h5py
import numpy as np

from index.id_hash import id_hashes
from index.spill import HashBuckets, sorted_pairs

GROUP = "id_index"
BLOCK = 1024   # table entries per fence entry (one read per lookup)
VERIFY_ABOVE = 256   # ids longer than this are also compared as text
TABLE = np.dtype([("hash", "<u8"), ("check", "<u8"), ("row", "<i8")])


def hashes_of(ids, check: bool = False) -> np.ndarray:
    """The id hash (or the check hash) of each id (str or bytes)."""
    try:
        blob = b"".join(ids)   # the merge's ids are bytes already
        raw = ids
    except TypeError:
        raw = [i.encode() if isinstance(i, str) else bytes(i) for i in ids]
        blob = b"".join(raw)
    offsets = np.zeros(len(raw) + 1, np.int64)
    np.cumsum(np.fromiter(map(len, raw), np.int64, len(raw)), out=offsets[1:])
    return id_hashes(np.frombuffer(blob, np.uint8), offsets, check=check)


class IdIndexWriter:
    """Collects (id, row) as the merge appends rows; `write` stores the sorted index in the result."""

    def __init__(self, rows_hint: int, directory: str | os.PathLike):
        self.buckets = HashBuckets(max(1, rows_hint), os.fspath(directory), window=1 << 21,   # (buckets of ~24 MB)
                                   payload=[("check", "<u8")])
        self.rows = 0

    def add(self, ids: np.ndarray) -> None:
        if len(ids):
            self.buckets.add(hashes_of(ids), np.arange(self.rows, self.rows + len(ids), dtype=np.int64),
                             check=hashes_of(ids, check=True))
            self.rows += len(ids)

    def write(self, file: h5py.File) -> None:
        n = self.rows
        group = file.create_group(GROUP)
        table = group.create_dataset("table", shape=(n,), dtype=TABLE)   # contiguous: a lookup reads no chunk index
        fence, at = [], 0
        for rec in sorted_pairs(self.buckets):
            out = np.empty(len(rec), TABLE)
            out["hash"], out["check"], out["row"] = rec["key"], rec["check"], rec["pos"]
            table[at:at + len(rec)] = out
            first = -at % BLOCK   # the fence entries that fall in this piece
            fence.append(rec["key"][first::BLOCK].copy())   # (a view would keep each whole bucket alive)
            at += len(rec)
        group.create_dataset("fence", data=np.concatenate(fence) if fence else np.zeros(0, np.uint64))
        group.attrs["block"] = BLOCK
        group.attrs["hash"] = "index.id_hash.id_hashes of the UTF-8 id (check: with check=True)"


class IdIndex:
    """Lookups in a result's id index (the file stays open in the caller's hands)."""

    def __init__(self, file: h5py.File):
        group = file[GROUP]
        self.table = group["table"] if "table" in group else None
        self.hashes, self.rows = (None, None) if self.table is not None else (group["hashes"], group["rows"])
        self.fence = group["fence"][:]
        self.block = int(group.attrs["block"])
        self.n = len(self.table if self.table is not None else self.hashes)

    @property
    def checked(self) -> bool:
        """Whether matches are told apart by the check hash (else the caller compares the ids)."""
        return self.table is not None

    def candidates(self, key: int, check: int | None = None) -> np.ndarray:
        """The rows whose id hash is `key` (and check hash `check`, where the index has them): usually one;
        none when no row has it."""
        k = max(0, int(np.searchsorted(self.fence, np.uint64(key), "left")) - 1)
        found = []
        while k * self.block < self.n:
            a, b = k * self.block, min(self.n, (k + 1) * self.block)
            if self.table is not None:
                entries = self.table[a:b]
                hashes, rows = entries["hash"], entries["row"]
            else:
                entries = None
                hashes = self.hashes[a:b]
            lo, hi = np.searchsorted(hashes, np.uint64(key), "left"), np.searchsorted(hashes, np.uint64(key), "right")
            if hi > lo:
                if entries is None:
                    found.append(self.rows[a + lo:a + hi])
                else:
                    same = entries["check"][lo:hi] == np.uint64(check)
                    found.append(rows[lo:hi][same])
            if hi < len(hashes) or b == self.n:   # the run of equal hashes ends in this block
                break
            k += 1
        return np.concatenate(found) if found else np.zeros(0, np.int64)
