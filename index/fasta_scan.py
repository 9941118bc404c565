"""Scan one FASTA file into per-record arrays: byte offset, byte length, residue count and id.

The file is read in fixed blocks, each with one positioned read, by a few threads (numpy releases the
GIL). Each block is scanned with a handful of vectorised passes: header starts, whitespace positions,
and byte-range checks. A record that crosses a block boundary is finished afterwards by reading exactly
that record, so the result does not depend on where blocks fall.

Residue count: bytes of the record after its header line, whitespace (space, tab, CR, LF) excluded and a
trailing '*' stop symbol dropped, which is exactly the text the model sees (see `sequence_text`).
"""
from __future__ import annotations

import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from .errors import FastaError, line_number

BLOCK_BYTES = 4 << 20
_GT, _NL, _STAR = ord(">"), ord("\n"), ord("*")
_WHITESPACE = b" \t\r\n"
_DELETE_WS = bytes(range(33))  # whitespace and control bytes; control bytes never reach here (rejected)


def sequence_text(record: bytes) -> str:
    """The sequence the model sees for one raw record (header line included).

    Whitespace removed, upper-cased (lowercase marks soft-masked residues, not different ones), a trailing
    '*' stop symbol dropped.
    """
    newline = record.find(b"\n")
    body = b"" if newline < 0 else record[newline + 1:]
    body = body.translate(None, _DELETE_WS).upper()
    if body.endswith(b"*"):
        body = body[:-1]
    return body.decode("ascii")


@dataclass
class FileScan:
    """Per-record arrays for one file, in file order."""

    offsets: np.ndarray     # int64 [N] byte offset of the record's '>'
    nbytes: np.ndarray      # int64 [N] bytes from the '>' to the next record (or end of file)
    lengths: np.ndarray     # int64 [N] residues
    id_blob: np.ndarray     # uint8 [sum of id bytes] ids back to back
    id_lengths: np.ndarray  # int64 [N]
    content_crc32: int | None = None   # whole-file checksum (see _FileScanner.scan); None after concat

    @staticmethod
    def concat(parts: list["FileScan"]) -> "FileScan":
        if not parts:
            return FileScan(*(np.zeros(0, np.int64) for _ in range(3)), np.zeros(0, np.uint8),
                            np.zeros(0, np.int64))
        return FileScan(*(np.concatenate([getattr(p, f) for p in parts])
                          for f in ("offsets", "nbytes", "lengths", "id_blob", "id_lengths")))


class _BadByte(Exception):
    def __init__(self, offset: int, value: int):
        self.offset, self.value = offset, value


class _EmptyId(Exception):
    def __init__(self, offset: int):
        self.offset = offset


@dataclass
class _BlockScan:
    records: FileScan
    first_header: int | None   # absolute offset of the first header starting in this block
    open_header: int | None    # absolute offset of a header whose record runs past this block
    nonws_before_header: int   # non-whitespace bytes owned by this block before its first header
    crc32: int = 0             # of the block's own bytes


def _scan_buffer(buf: np.ndarray, base: int, owned_from: int, header_at_0: bool, final: bool) -> _BlockScan:
    """Scan the records whose header starts in `buf[owned_from:]`.

    Everything is derived from one array: the positions of bytes < 33 (whitespace and control bytes).
    Header starts are the '>' right after a newline, so rank arithmetic on that array gives each record's
    header end, body start and whitespace count without any search. `header_at_0` says that position 0
    starts a line (file start, or a buffer holding exactly one record). Unless `final`, the last record
    may continue past the buffer; it is returned as `open_header` instead.
    """
    ws = np.flatnonzero(buf < 33)
    wv = buf[ws]
    if header_at_0:  # a virtual newline before position 0
        ws = np.concatenate((np.array([-1], np.int64), ws))
        wv = np.concatenate((np.array([_NL], np.uint8), wv))
    n = len(buf)
    nl = np.flatnonzero(wv == _NL)          # ws-ranks of the newlines
    after = ws[nl] + 1                      # position just after each newline
    is_header = np.zeros(len(nl), bool)
    inside = (after < n) & (after >= owned_from)
    is_header[inside] = buf[after[inside]] == _GT
    hj = np.flatnonzero(is_header)          # indices into `nl` of the newline before each header
    hs = after[hj]

    prefix_end = int(hs[0]) if len(hs) else n
    nonws_before = (prefix_end - owned_from) - int(np.searchsorted(ws, prefix_end) - np.searchsorted(ws, owned_from))
    if len(hs) == 0:
        return _BlockScan(FileScan.concat([]), None, None, nonws_before)
    first_header = base + int(hs[0])
    if final:
        open_header = None
        ends = np.append(hs[1:], n)
        end_rank = np.append(nl[hj[1:]] + 1, len(ws))   # ws-rank of the first whitespace at/after the end
    else:
        open_header = base + int(hs[-1])
        ends = hs[1:]
        end_rank = nl[hj[1:]] + 1
        hj, hs = hj[:-1], hs[:-1]
        if len(hs) == 0:
            return _BlockScan(FileScan.concat([]), first_header, open_header, nonws_before)
    records = _records(buf, base, ws, wv, nl, hj, hs, ends, end_rank)
    return _BlockScan(records, first_header, open_header, nonws_before)


def _records(buf, base, ws, wv, nl, hj, hs, ends, end_rank) -> FileScan:
    first_rank, stop_rank = int(nl[hj[0]]) + 1, int(end_rank[-1])
    seg = wv[first_rank:stop_rank]
    bad = np.flatnonzero((seg < 32) & (seg != 9) & (seg != 10) & (seg != 13))
    if len(bad):
        pos = int(ws[first_rank + bad[0]])
        raise _BadByte(base + pos, int(buf[pos]))

    # Header end: the next newline after the one before the header (absent only for a last header
    # line with no newline at all, which has no body).
    he_i = hj + 1
    has_end = he_i < len(nl)
    he_rank = np.where(has_end, nl[np.minimum(he_i, len(nl) - 1)], end_rank)
    has_end &= he_rank < end_rank
    he_rank = np.where(has_end, he_rank, end_rank)
    header_end = np.where(has_end, ws[np.minimum(he_rank, len(ws) - 1)], ends)

    first, stop = int(hs[0]), int(ends[-1])
    if buf[first:stop].max(initial=0) > 126:
        # Non-ASCII bytes are fine in a description (UTF-8), never in sequence data.
        high = np.flatnonzero(buf[first:stop] > 126) + first
        owner = np.searchsorted(hs, high, side="right") - 1
        in_header = high < header_end[owner]
        if not in_header.all():
            pos = int(high[~in_header][0])
            raise _BadByte(base + pos, int(buf[pos]))

    # id: from after '>' to the first whitespace; a header with leading blanks is fixed up one by one.
    id_start = hs + 1
    id_rank = nl[hj] + 1
    id_end = np.where(id_rank < len(ws), ws[np.minimum(id_rank, len(ws) - 1)], ends)
    id_end = np.minimum(id_end, header_end)
    for r in np.flatnonzero(id_end <= id_start):
        line = buf[hs[r] + 1:header_end[r]].tobytes()
        tokens = line.split()
        if not tokens:
            raise _EmptyId(base + int(hs[r]))
        id_start[r] = hs[r] + 1 + line.index(tokens[0])
        id_end[r] = id_start[r] + len(tokens[0])

    body = np.minimum(header_end + 1, ends)
    lengths = (ends - body) - np.maximum(end_rank - he_rank - 1, 0)

    # Trailing '*': step back over the whitespace run that ends the record to its last residue.
    last, r = ends - 1, end_rank - 1
    while True:
        step = (last >= body) & (r > he_rank)
        step[step] = ws[r[step]] == last[step]
        if not step.any():
            break
        last = last - step
        r = r - step
    star = (last >= body) & (buf[np.clip(last, 0, len(buf) - 1)] == _STAR)
    lengths = lengths - star

    id_lengths = id_end - id_start
    starts_in_blob = np.cumsum(id_lengths) - id_lengths
    gather = np.repeat(id_start - starts_in_blob, id_lengths) + np.arange(int(id_lengths.sum()))
    return FileScan(offsets=hs + base, nbytes=ends - hs, lengths=lengths, id_blob=buf[gather], id_lengths=id_lengths)


class _FileScanner:
    def __init__(self, path: str, threads: int):
        self.path = path
        self.threads = threads
        self.fd = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self.fd).st_size
        self._local = threading.local()

    def close(self) -> None:
        os.close(self.fd)

    def _read(self, start: int, stop: int, reuse: bool) -> np.ndarray:
        n = stop - start
        if reuse:  # one buffer per thread: fresh large allocations would page-fault on every block
            buf = getattr(self._local, "buf", None)
            if buf is None or len(buf) < n:
                buf = self._local.buf = np.empty(max(n, BLOCK_BYTES + 1), np.uint8)
            buf = buf[:n]
        else:
            buf = np.empty(n, np.uint8)
        got = os.preadv(self.fd, [memoryview(buf)], start)
        if got != n:
            raise FastaError(self.path, "file changed while it was being read; run again once it is complete")
        return buf

    def block(self, k: int) -> _BlockScan:
        start = k * BLOCK_BYTES
        stop = min(self.size, start + BLOCK_BYTES)
        lo = max(0, start - 1)  # one byte of look-behind tells whether a '>' starts a line
        buf = self._read(lo, stop, reuse=True)
        scan = _scan_buffer(buf, lo, owned_from=start - lo, header_at_0=start == 0, final=stop == self.size)
        scan.crc32 = zlib.crc32(buf[start - lo:])   # while the block is in cache; zlib releases the GIL
        return scan

    def record(self, start: int, stop: int) -> FileScan:
        """Exactly one record that crossed a block boundary."""
        buf = self._read(start, stop, reuse=False)
        scan = _scan_buffer(buf, start, owned_from=0, header_at_0=True, final=True)
        assert len(scan.records.offsets) == 1 and scan.records.offsets[0] == start
        return scan.records

    def scan(self) -> FileScan:
        head = os.pread(self.fd, 1 << 16, 0)
        if head[:2] == b"\x1f\x8b":
            raise FastaError(self.path, "file is gzip-compressed",
                             hint="Decompress it first (gunzip -k FILE) and pass the .fasta")
        if head[:3] == b"\xef\xbb\xbf":
            raise FastaError(self.path, "file starts with a UTF-8 byte-order mark (BOM)", line=1,
                             hint="Save it without the BOM, e.g. sed -i '1s/^\\xEF\\xBB\\xBF//' FILE")
        if b"\r" in head and b"\n" not in head:
            raise FastaError(self.path, "lines end with a carriage return only (classic Mac line endings)",
                             hint="Convert them, e.g. tr '\\r' '\\n' < FILE > FILE.unix.fasta")
        nblocks = max(1, -(-self.size // BLOCK_BYTES))
        with ThreadPoolExecutor(self.threads) as pool:
            blocks = list(pool.map(self.block, range(nblocks)))
            self._check_prefix(blocks)
            # Records that cross a block boundary run from a block's last header to the next header.
            spans, slots, pending = [], [], None
            pieces: list[FileScan | None] = []
            for b in blocks:
                if b.first_header is not None and pending is not None:
                    spans.append((pending, b.first_header))
                    slots.append(len(pieces))
                    pieces.append(None)
                    pending = None
                pieces.append(b.records)
                if b.open_header is not None:
                    pending = b.open_header
            if pending is not None:
                spans.append((pending, self.size))
                slots.append(len(pieces))
                pieces.append(None)
            for slot, rec in zip(slots, pool.map(lambda s: self.record(*s), spans)):
                pieces[slot] = rec
        scan = FileScan.concat(pieces)
        # The file's content checksum: crc32 of the blocks' crc32s. It tells a rerun whether residues
        # were edited in place (same lengths, same offsets), which the record layout alone cannot.
        scan.content_crc32 = zlib.crc32(np.array([b.crc32 for b in blocks], "<u4").tobytes())
        return scan

    def _check_prefix(self, blocks: list[_BlockScan]) -> None:
        """Everything before the first header must be blank; say so precisely when it is not."""
        nonws = 0
        for b in blocks:
            nonws += b.nonws_before_header
            if b.first_header is not None:
                break
        else:
            if nonws == 0:
                raise FastaError(self.path, "file is empty: no FASTA records",
                                 hint="A record is a '>' header line followed by sequence lines")
        if nonws:
            with open(self.path, "rb") as fh:
                data = fh.read(1 << 16)
            pos = next(i for i, c in enumerate(data) if c > 32) if data.strip() else 0
            if any(c > 126 or (c < 32 and c not in (9, 10, 13)) for c in data[:4096]):
                raise FastaError(self.path, "binary data, not a FASTA text file", line=1,
                                 hint="Pass an uncompressed protein/nucleotide FASTA file")
            raise FastaError(self.path, "sequence data before the first header", line=line_number(self.path, pos),
                             hint="Every record must start with a '>' header line; add one or remove the stray lines")


def scan_fasta(path: str | os.PathLike, threads: int | None = None) -> FileScan:
    """Scan one FASTA file; raise FastaError naming file, line and id for malformed input."""
    path = os.fspath(path)
    threads = threads or min(8, os.cpu_count() or 1)
    if os.path.isdir(path):
        raise FastaError(path, "is a directory, not a FASTA file")
    try:
        scanner = _FileScanner(path, threads)
    except FileNotFoundError:
        if os.path.basename(path) == "-":
            raise FastaError(path, "file not found", hint="Standard input is not read ('-'): the index needs a "
                             "file it can read again; save the FASTA to a file and pass its path") from None
        raise FastaError(path, "file not found", hint="Check the path") from None
    except PermissionError:
        raise FastaError(path, "permission denied: cannot read the file") from None
    except OSError as e:
        raise FastaError(path, f"cannot open: {e.strerror or e}") from None
    try:
        return scanner.scan()
    except _BadByte as e:
        seq_id = _id_before(path, e.offset)
        if e.value > 127:
            raise FastaError(path, f"non-ASCII byte 0x{e.value:02x} in the sequence data",
                             line=line_number(path, e.offset), seq_id=seq_id,
                             hint="Residues are ASCII letters; fix or remove that character") from None
        raise FastaError(path, f"binary or control byte 0x{e.value:02x} in the sequence data",
                         line=line_number(path, e.offset), seq_id=seq_id,
                         hint="The file is corrupt or not a FASTA text file") from None
    except _EmptyId as e:
        raise FastaError(path, "header has no id (nothing after '>')", line=line_number(path, e.offset),
                         hint="Give every record an id: '>my_id optional description'") from None
    finally:
        scanner.close()


def _id_before(path: str, offset: int) -> str | None:
    """Id of the record containing byte `offset`, for error messages."""
    with open(path, "rb") as fh:
        start = max(0, offset - (1 << 20))
        fh.seek(start)
        data = fh.read(offset - start)
    at = data.rfind(b"\n>")
    if at < 0 and start == 0 and data.startswith(b">"):
        at = -1
    elif at < 0:
        return None
    line = data[at + 2:].split(b"\n", 1)[0].split()
    return line[0].decode("utf-8", "replace") if line else None
