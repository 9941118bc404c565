"""Every record's sequence digest, BLAKE2b-128 of its residues as the index reads them (whitespace removed,
upper-cased unless the run's input keeps its case, a trailing '*' dropped: `fasta_scan.sequence_text`),
computed straight from the FASTA text a block of whole records at a time, in FASTA order, with bounded memory.

A block is read with one positioned read and its records' checksums are checked (record_checksum.py), so
a digest is never taken of text other than the index describes; the residues of the whole block are
picked out and upper-cased with a few vectorised passes, so only the hash itself is a call per record. A
record longer than a block is read piece by piece (`SequenceIndex.sequence`). These are the digests the
workers store in each row's `sequence_digest` (pipeline/output/sequence_digest.py), byte for byte.
"""
from __future__ import annotations

import hashlib
from typing import Iterator

import numpy as np

from .record_checksum import block_checksums
from .spill import ragged_arange

SIZE = 16
BLOCK_BYTES = 4 << 20
_STEP = 1 << 16                                   # records whose fields are read at once
_UPPER = np.arange(256, dtype=np.uint8)
_UPPER[ord("a"):ord("z") + 1] -= 32


def digest(text: bytes | str) -> bytes:
    """The digest of one sequence's residues (as `sequence_text` gives them)."""
    return hashlib.blake2b(text.encode("ascii") if isinstance(text, str) else text, digest_size=SIZE).digest()


def record_digests(index, start: int = 0, stop: int | None = None, keep_case: bool = False) -> Iterator[np.ndarray]:
    """[k, 16] uint8 digests of records start .. stop - 1, in order, a few thousand at a time (of the text as
    written, not upper-cased, with `keep_case`). The text read is checked against each record's checksum
    (InputChanged when the file changed since it was indexed)."""
    stop = len(index) if stop is None else stop
    for a in range(start, stop, _STEP):
        b = min(stop, a + _STEP)
        out = np.empty((b - a, SIZE), np.uint8)
        rec = _Fields(index, a, b)
        i = 0
        while i < b - a:
            if rec.nbytes[i] > BLOCK_BYTES:   # a long record, alone, piece by piece
                out[i] = np.frombuffer(digest(index.sequence(a + i, keep_case)), np.uint8)
                i += 1
                continue
            j = rec.block_end(i)
            _block(index, rec, a, i, j, out, keep_case)
            i = j
        index.release()
        yield out


class _Fields:
    """The index fields of records a .. b - 1."""

    def __init__(self, index, a: int, b: int):
        self.offsets = np.asarray(index.offsets[a:b], np.int64)
        self.nbytes = np.asarray(index.nbytes[a:b], np.int64)
        self.file_no = np.asarray(index.file_no[a:b], np.int64)
        self.lengths = np.asarray(index.lengths[a:b], np.int64)
        self.checksums = None if index.checksums is None else np.asarray(index.checksums[a:b], np.uint64)
        ends = self.offsets + self.nbytes
        # where a run of records that follow each other in one file is broken
        self.breaks = np.flatnonzero((self.file_no[1:] != self.file_no[:-1]) | (self.offsets[1:] != ends[:-1])
                                     | (self.nbytes[1:] > BLOCK_BYTES)) + 1
        self.ends = ends

    def block_end(self, i: int) -> int:
        """The end of the block of records from i: same file, back to back, at most BLOCK_BYTES in all."""
        run_end = int(self.breaks[np.searchsorted(self.breaks, i, "right")]) if len(self.breaks) and \
            self.breaks[-1] > i else len(self.offsets)
        j = int(np.searchsorted(self.ends, self.offsets[i] + BLOCK_BYTES, "right"))
        return max(i + 1, min(j, run_end))


def _block(index, rec: _Fields, a: int, i: int, j: int, out: np.ndarray, keep_case: bool) -> None:
    """Digests of records a + i .. a + j - 1, which lie back to back in one file, read in one piece."""
    start, stop = int(rec.offsets[i]), int(rec.ends[j - 1])
    grid = start - start % 8   # checksum words sit at multiples of 8 in the text
    raw = bytearray(-(-(stop - grid) // 8) * 8)
    with index._reading(a + i) as text:
        got = text.read_into(memoryview(raw)[:stop - grid], grid)
    words = np.frombuffer(raw, "<u8")
    buf = np.frombuffer(raw, np.uint8)[start - grid:stop - grid]
    rel = rec.offsets[i:j] - start
    if got != stop - grid:
        index.read_record(a + i + int(np.searchsorted(rec.ends[i:j], got + grid, "right")))  # raises InputChanged
    if rec.checksums is not None:
        found = block_checksums(words.copy(), grid // 8, rel + start - grid, rel + start - grid + rec.nbytes[i:j],
                                kind=index.checksum_kind)
        bad = np.flatnonzero(found != rec.checksums[i:j])
        if len(bad):
            index._verify(a + i + int(bad[0]), int(found[bad[0]]))   # raises InputChanged, naming the record
    _digests_of(buf, rel, rec.nbytes[i:j], rec.lengths[i:j], out[i:j], index, a + i, keep_case)


def _digests_of(buf: np.ndarray, rel: np.ndarray, nbytes: np.ndarray, lengths: np.ndarray, out: np.ndarray,
                index, first: int, keep_case: bool = False) -> None:
    """Digests of the records at `rel` (each `nbytes` long, header included) in `buf`."""
    ends = rel + nbytes
    line_ends = np.flatnonzero((buf == 10) | (buf == 13))
    k = np.searchsorted(line_ends, rel)
    header_end = np.where(k < len(line_ends), line_ends[np.minimum(k, max(len(line_ends) - 1, 0))]
                          if len(line_ends) else ends, ends)
    header_end = np.minimum(header_end, ends)
    keep = buf > 32
    keep[ragged_arange(rel, header_end - rel)] = False   # the header lines
    where = np.flatnonzero(keep)
    starts = np.searchsorted(where, rel)
    kept = np.searchsorted(where, ends) - starts
    residues = (buf[where] if keep_case else _UPPER[buf[where]]).tobytes()
    view = memoryview(residues)
    blake = hashlib.blake2b
    raw = bytearray()
    odd = np.flatnonzero((kept != lengths) & (kept != lengths + 1))
    for s, n in zip(starts.tolist(), lengths.tolist()):
        raw += blake(view[s:s + n], digest_size=SIZE).digest()
    out[:] = np.frombuffer(bytes(raw), np.uint8).reshape(-1, SIZE)
    for i in odd.tolist():   # (never for text the scanner accepted; kept as a safe path)
        out[i] = np.frombuffer(digest(index.sequence(first + i, keep_case)), np.uint8)
