"""Building an index file with bounded memory: the FASTA files are scanned a few blocks at a time, each
record's fields appended to spill files, and then the index is assembled from them on disk.

What needs every record at once is done on disk too (spill.py): the duplicate-id check buckets the ids'
64-bit hashes by their top bits and compares ids only where hashes repeat; the length order is a counting
sort (a histogram of the lengths gives where each length starts, a running count per length the place
within it) scattered to its destinations a window at a time. Memory is a few blocks of the scan and one
window of the spill (tens of MiB to a few hundred), whatever the number of records; time is linear.
"""
from __future__ import annotations

import os
import stat
from typing import Iterator, Sequence

import numpy as np

from . import index_file, input_file
from .errors import FastaError
from . import record_checksum
from .fasta_scan import FileScan, ScanStream
from .input_file import InputFile
from .spill import WINDOW, HashBuckets, Scatter
from .spill_owner import owned_folder, release

FORMAT_VERSION = 5
_CHUNK = 4 << 20   # records per chunk when a spilled column is read back


class Column:
    """An append-only array on disk (one spill file)."""

    def __init__(self, root: str, name: str, dtype):
        self.path, self.dtype, self.count = os.path.join(root, f"{name}.bin"), np.dtype(dtype), 0
        self._fh = open(self.path, "wb")

    def append(self, values: np.ndarray) -> None:
        self._fh.write(index_file.raw(np.asarray(values, self.dtype)))
        self.count += len(values)

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()

    def discard(self) -> None:
        """Close the file whose data is being thrown away (the build ended, or failed). On a full disk the
        flush of its last buffered write fails again as it closes: that must not keep the spill folder from
        being removed, nor hide the error that ended the build."""
        try:
            self.close()
        except OSError:
            if not self._fh.closed:   # (closed now whatever the flush did: CPython closes the descriptor)
                raise

    def chunks(self, step: int = _CHUNK, dtype=None) -> Iterator[np.ndarray]:
        self.close()
        with open(self.path, "rb") as fh:
            for a in range(0, self.count, step):
                chunk = np.fromfile(fh, self.dtype, min(step, self.count - a))
                yield chunk if dtype is None else chunk.astype(dtype)

    def mapped(self) -> np.ndarray:
        """The column memory-mapped (for a few random reads: the ids of repeated hashes)."""
        self.close()
        return np.memmap(self.path, self.dtype, "r", shape=(self.count,)) if self.count else np.zeros(0, self.dtype)

    def part(self, name: str, dtype=None) -> index_file.Part:
        dtype = np.dtype(dtype or self.dtype)
        return index_file.Part(name, dtype, (self.count,), lambda: (index_file.raw(c) for c in self.chunks(dtype=dtype)))


class _Histogram:
    """Distinct values and their counts, merged piece by piece (counted densely while values are small)."""

    _DENSE = 1 << 20

    def __init__(self):
        self.dense = np.zeros(0, np.int64)
        self.sparse_values, self.sparse_counts = np.zeros(0, np.int64), np.zeros(0, np.int64)

    def add(self, values: np.ndarray) -> None:
        if len(values) == 0:
            return
        if int(values.max()) < self._DENSE:
            counts = np.bincount(values)
            if len(counts) > len(self.dense):
                self.dense = np.concatenate((self.dense, np.zeros(len(counts) - len(self.dense), np.int64)))
            self.dense[:len(counts)] += counts
            return
        v, c = np.unique(values.astype(np.int64), return_counts=True)
        allv = np.concatenate((self.sparse_values, v))
        self.sparse_values, inverse = np.unique(allv, return_inverse=True)
        self.sparse_counts = np.bincount(inverse, weights=np.concatenate((self.sparse_counts, c)),
                                         minlength=len(self.sparse_values)).astype(np.int64)

    @property
    def values(self) -> np.ndarray:
        """The distinct values, ascending (with `counts`)."""
        self._merge()
        return self.sparse_values

    @property
    def counts(self) -> np.ndarray:
        self._merge()
        return self.sparse_counts

    def _merge(self) -> None:
        if self.dense.any():
            seen = np.flatnonzero(self.dense)
            allv = np.concatenate((self.sparse_values, seen))
            allc = np.concatenate((self.sparse_counts, self.dense[seen]))
            self.sparse_values, inverse = np.unique(allv, return_inverse=True)
            self.sparse_counts = np.bincount(inverse, weights=allc, minlength=len(self.sparse_values)).astype(np.int64)
            self.dense = np.zeros(0, np.int64)


def refuse_repeated(paths: Sequence[str]) -> None:
    """FastaError naming a file given twice: by path, or by device and inode (a hard link, a bind mount), which
    gave every id twice and the advice --on-duplicate-id rename, which computes each record twice."""
    seen: dict = {}
    for k, p in enumerate(paths):
        try:
            st = os.stat(p)
            keys = [os.path.realpath(p), (st.st_dev, st.st_ino)]
        except OSError:   # (missing: refused by name when it is opened)
            keys = [os.path.realpath(p)]
        first = next((seen[key] for key in keys if key in seen), None)
        if first is not None:
            also = "" if os.path.abspath(paths[first]) == os.path.abspath(p) else f" (also as {paths[first]})"
            raise FastaError(p, f"the same file is given twice{also}", hint="Pass each FASTA file once")
        seen.update({key: k for key in keys})


def build_file(paths: Sequence[str | os.PathLike], target: str | os.PathLike, threads: int | None = None) -> None:
    """Scan `paths` (in the given order) into the index file `target`; FastaError on malformed input."""
    paths = [os.fspath(p) for p in paths]
    refuse_repeated(paths)
    if len(paths) > np.iinfo(np.uint16).max:
        raise FastaError(paths[-1], "too many input files (at most 65535)")
    # (the cache is shared by concurrent commands: the folder is locked while this build lives, and the next
    # build removes one whose build was killed)
    root = owned_folder(os.path.dirname(os.path.abspath(target)), ".rs-index-")
    try:
        cols = {name: Column(root, name, dtype) for name, dtype in (
            ("offsets", np.int64), ("nbytes", np.int64), ("lengths", np.int64), ("file_no", np.uint16),
            ("id_offsets", np.int64), ("id_blob", np.uint8), ("checksums", np.uint64))}
        cols["id_offsets"].append(np.zeros(1, np.int64))
        hashes, hist = HashBuckets(_estimate_records(paths), root), _Histogram()
        inputs, tables, n, id_end, widest = [], [], 0, 0, 0
        for k, path in enumerate(paths):
            before = _stat_or_none(path)   # (a path that cannot be read: the scan says why)
            stream = ScanStream(path, threads, hashes=True)
            for piece in stream:
                m = len(piece.offsets)
                ids = np.zeros(m + 1, np.int64)
                np.cumsum(piece.id_lengths, out=ids[1:])
                _check_utf8(piece, ids, path)
                hashes.add(piece.id_hashes, np.arange(n, n + m, dtype=np.int64))
                hist.add(piece.lengths)
                widest = max(widest, int(piece.nbytes.max()))
                for name in ("offsets", "nbytes", "lengths", "id_blob", "checksums"):
                    cols[name].append(getattr(piece, name))
                cols["file_no"].append(np.full(m, k, np.uint16))
                cols["id_offsets"].append(ids[1:] + id_end)
                n, id_end = n + m, id_end + int(ids[-1])
            inputs.append(_unchanged_while_scanned(path, before))
            tables.append(stream.table if stream.table is not None else np.zeros((0, 2), np.int64))
        groups = _duplicate_groups(hashes, cols)
        order = _length_order(cols["lengths"], hist, n, root)
        spans = np.zeros(len(tables) + 1, np.int64)
        np.cumsum([len(t) for t in tables], out=spans[1:])
        top = int(hist.values[-1]) if len(hist.values) else 0
        parts = [
            cols["offsets"].part("offsets"),
            cols["nbytes"].part("nbytes", np.uint32 if widest <= np.iinfo(np.uint32).max else np.int64),
            cols["lengths"].part("lengths", np.int32 if top <= np.iinfo(np.int32).max else np.int64),
            cols["file_no"].part("file_no"), cols["id_offsets"].part("id_offsets"), cols["id_blob"].part("id_blob"),
            order.part("order"), cols["checksums"].part("checksums"),
            index_file.in_memory("bgzf_blocks", np.concatenate(tables) if tables else np.zeros((0, 2), np.int64)),
            index_file.in_memory("bgzf_spans", spans),
            index_file.in_memory("length_values", hist.values[::-1].copy()),
            index_file.in_memory("length_counts", hist.counts[::-1].copy()),
        ]
        index_file.write(target, FORMAT_VERSION, n, parts, {
            **input_file.to_header(inputs), "meta": {"duplicate_groups": groups, "checksum_kind": record_checksum.KIND}})
    finally:
        try:
            for c in locals().get("cols", {}).values():
                c.discard()
        finally:
            release(root)


def check_regular(paths: Sequence[str | os.PathLike]) -> None:
    """FastaError for a path that is not a file that can be read again: a pipe (`<(zcat x.gz)`, standard input
    from a pipe), a terminal, a socket. The index records where each record lies, and workers read them there
    later, by offset; a pipe's text is gone once read. (A missing path or a directory: the scan says so.)"""
    for path in paths:
        try:
            mode = os.stat(path).st_mode
        except OSError:
            continue
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            what = "a pipe" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
            raise FastaError(path, f"is {what}, not a file: run_shards indexes the FASTA and its workers read the "
                             "records from it later, by offset, so it must be a file that can be read again",
                             hint="Save the FASTA to a file and pass its path; a gzip or bgzip file can be passed as "
                                  "it is (instead of `<(zcat x.gz)`)")


def _stat_or_none(path: str) -> InputFile | None:
    try:
        return InputFile.stat(path)
    except OSError:
        return None


def _unchanged_while_scanned(path: str, before: InputFile | None) -> InputFile:
    """The file as it was indexed (stat before the scan), after checking that the scan saw it still: a file
    appended to, or written, while it was scanned would leave an index that looks current (the stat after)
    but misses records or holds a record cut short."""
    after = InputFile.stat(path)
    if before is not None and after.state != before.state:
        raise FastaError(path, f"the file changed while it was being indexed ({before.change(after)})",
                         hint="Something is still writing it: wait until it has finished (or index a finished "
                              "copy of it), then run the command again")
    return after


def _estimate_records(paths: Sequence[str]) -> int:
    """About how many records at most (for the number of hash buckets): one per 40 bytes of text, and a
    compressed file's text taken as 4 times its size."""
    total = 0
    for p in paths:
        try:
            total += os.path.getsize(p) * (4 if p.endswith((".gz", ".bgz")) else 1) // 40 + 1
        except OSError:
            total += 1   # (the scan says what is wrong with it)
    return total


def _check_utf8(piece: FileScan, ids: np.ndarray, path: str) -> None:
    blob = piece.id_blob
    if len(blob) == 0 or blob.max() <= 127:
        return
    from .source import line_number
    for i in np.unique(np.searchsorted(ids, np.flatnonzero(blob > 127), "right") - 1):
        try:
            blob[ids[i]:ids[i + 1]].tobytes().decode("utf-8")
        except UnicodeDecodeError:
            raise FastaError(path, "record id is not valid UTF-8", line=line_number(path, int(piece.offsets[i])),
                             hint="Fix the header's encoding") from None


def _duplicate_groups(hashes: HashBuckets, cols: dict) -> list[list[int]]:
    """Groups of positions sharing an id, each in input order, ordered by their first position."""
    found: dict[bytes, list[int]] = {}
    offsets, blob = None, None
    for positions in hashes.repeated():
        if offsets is None:
            offsets, blob = cols["id_offsets"].mapped(), cols["id_blob"].mapped()
        for p, a, b in zip(positions.tolist(), offsets[positions].tolist(), offsets[positions + 1].tolist()):
            found.setdefault(bytes(blob[a:b]), []).append(p)
    del offsets, blob
    groups = [sorted(g) for g in found.values() if len(g) > 1]
    return sorted(groups, key=lambda g: g[0])


def _length_order(lengths: Column, hist: _Histogram, n: int, root: str) -> Column:
    """Positions sorted by length, longest first, ties in input order: a counting sort on disk."""
    desc_values = hist.values[::-1]
    starts = np.concatenate(([0], np.cumsum(hist.counts[::-1])[:-1])).astype(np.int64)
    seen = np.zeros(len(desc_values), np.int64)
    dtype = np.uint32 if n < 2**32 else np.uint64
    scatter = Scatter(n, dtype, root, window=WINDOW)
    pos = 0
    for chunk in lengths.chunks():
        slot = len(desc_values) - 1 - np.searchsorted(hist.values, chunk)   # place of each length, longest first
        if len(desc_values) <= 1 << 16:
            slot = slot.astype(np.uint16)   # numpy sorts 16-bit keys by radix
        by = np.argsort(slot, kind="stable")
        s = slot[by]
        first = np.ones(len(s), bool)
        first[1:] = s[1:] != s[:-1]
        run_start = np.maximum.accumulate(np.where(first, np.arange(len(s)), 0))
        dest = np.empty(len(s), np.int64)
        s = s.astype(np.int64)
        dest[by] = starts[s] + seen[s] + (np.arange(len(s)) - run_start)
        np.add.at(seen, s[first], np.diff(np.append(np.flatnonzero(first), len(s))))
        scatter.add(dest, np.arange(pos, pos + len(chunk), dtype=np.int64).astype(dtype))
        pos += len(chunk)
    order = Column(root, "order", dtype)
    for _, values, _, _ in scatter.chunks():
        order.append(values)
    order.close()
    return order
