"""Scan one FASTA file into per-record arrays: byte offset, byte length, residue count and id.

The file is read in fixed blocks, each with one positioned read, by a few threads (numpy releases the
GIL). Each block is scanned with a handful of vectorised passes over the positions of its bytes below 33
(whitespace, line ends, control bytes). A record that crosses a block boundary is finished afterwards by
streaming exactly that record through block-sized reads, so the result does not depend on where blocks
fall and memory does not depend on any record's size. Each record's checksum (record_checksum.py) is taken
from the same block, while it is in cache. A BGZF file is read the same way, through its text (source.py).

What a FASTA file is here (README "Sequence text" and "Bad input"):
- A line ends at LF, CRLF or a lone CR, in any mix. A header is a '>' that starts a line.
- A header may hold any byte but NUL. The id is its first run of bytes above 32: it ends at whitespace or
  at a control byte such as NCBI's Ctrl-A (0x01), which joins the deflines of merged identical sequences
  in the non-redundant databases, as NCBI's own tools read them. The whole line stays the description.
- Sequence data: ASCII whitespace (space, tab, CR, LF, VT, FF) is removed; NUL, other control bytes,
  bytes above 126 and '>' (an indented header would join two records) are refused. A trailing '*' stop
  symbol is dropped. Residue count = that text's length.
- Lines starting with ';' (the old Pearson comment lines) are refused wherever they are: other tools
  either refuse them or read them as residues, and silently doing either would change the results.
"""
from __future__ import annotations

import os
import re
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from .errors import FastaError
from .id_hash import affinity_cpus, id_hashes
from .record_checksum import add, block_checksums, checksum
from .source import line_number, open_stream, open_text

BLOCK_BYTES = 4 << 20
_GT, _SEMI, _STAR, _LF, _CR = ord(">"), ord(";"), ord("*"), ord("\n"), ord("\r")
_WHITESPACE = b" \t\n\r\x0b\x0c"
_DELETE_WS = bytes(range(33))  # whitespace and control bytes; control bytes never reach here (refused)
_LINE_END = re.compile(rb"[\r\n]")
_ID = re.compile(rb"[^\x00-\x20]+")
NUCLEOTIDES = b"ACGTUN"


def sequence_text(record: bytes, keep_case: bool = False) -> str:
    """The sequence the model sees for one raw record (header line included).

    Whitespace removed, upper-cased (lowercase marks soft-masked residues, not different ones) unless
    `keep_case` (input whose case is meaning: SaProt's structure-aware pairs, ProstT5's 3Di states), a
    trailing '*' stop symbol dropped.
    """
    end = _LINE_END.search(record)
    body = b"" if end is None else record[end.start():]
    body = body.translate(None, _DELETE_WS)
    if not keep_case:
        body = body.upper()
    if body.endswith(b"*"):
        body = body[:-1]
    return body.decode("ascii")


def id_of_header(line: bytes) -> bytes:
    """The id of a header line (after the '>'): its first run of bytes above 32, b'' if none."""
    match = _ID.search(line)
    return match.group() if match else b""


@dataclass
class FileScan:
    """Per-record arrays for one file, in file order."""

    offsets: np.ndarray     # int64 [N] byte offset of the record's '>'
    nbytes: np.ndarray      # int64 [N] bytes from the '>' to the next record (or end of file)
    lengths: np.ndarray     # int64 [N] residues
    id_blob: np.ndarray     # uint8 [sum of id bytes] ids back to back
    id_lengths: np.ndarray  # int64 [N]
    nucleotides: np.ndarray | None = None   # int64 [N] residues that are A, C, G, T, U or N (when asked)
    checksums: np.ndarray | None = None     # uint64 [N] each record's checksum (record_checksum.py)
    table: np.ndarray | None = None         # a BGZF file's block table (bgzf.py); None for a plain file
    id_hashes: np.ndarray | None = None     # uint64 [N] each id's hash (id_hash.py), when asked (ScanStream)

    @staticmethod
    def concat(parts: list["FileScan"]) -> "FileScan":
        if not parts:
            return FileScan(*(np.zeros(0, np.int64) for _ in range(3)), np.zeros(0, np.uint8),
                            np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.uint64))
        nuc = None if any(p.nucleotides is None for p in parts) else np.concatenate([p.nucleotides for p in parts])
        sums = None if any(p.checksums is None for p in parts) else np.concatenate([p.checksums for p in parts])
        return FileScan(*(np.concatenate([getattr(p, f) for p in parts])
                          for f in ("offsets", "nbytes", "lengths", "id_blob", "id_lengths")), nucleotides=nuc,
                        checksums=sums)


_UNKNOWN = -1


class _Problem(Exception):
    """Bad input at byte `offset`, inside the record whose '>' is at `record` (None: before any header;
    _UNKNOWN: found out when the message is written)."""

    def __init__(self, kind: str, offset: int, record: int | None = None, value: int = 0):
        self.kind, self.offset, self.record, self.value = kind, offset, record, value


@dataclass
class _BlockScan:
    records: FileScan
    first_header: int | None   # absolute offset of the first header starting in this block
    open_header: int | None    # absolute offset of a header whose record runs past this block
    nonblank_before_header: int   # bytes owned by this block before its first header that are not blank


def _nucleotide_mask(a: np.ndarray) -> np.ndarray:
    folded = a | 0x20   # 'A' and 'a' both become 'a'; no other byte does
    mask = folded == NUCLEOTIDES[0] | 0x20
    for c in NUCLEOTIDES[1:]:
        mask |= folded == c | 0x20
    return mask


def _is_blank(values: np.ndarray) -> np.ndarray:
    return (values == 32) | ((values >= 9) & (values <= 13))


def _scan_buffer(buf: np.ndarray, base: int, owned_from: int, final: bool, nucleotides: bool) -> _BlockScan:
    """Scan the records whose header starts in `buf[owned_from:]` (`base`: file offset of buf[0]).

    Everything is derived from one array: the positions of bytes < 33. Line ends are the CRs and LFs
    among them (a CRLF is two line ends with an empty line between, which changes nothing); header starts
    are the '>' right after a line end, so rank arithmetic on that array gives each record's header end,
    body start and whitespace count without any search. Position 0 of the file starts a line. Unless
    `final`, the last record may continue past the buffer; it is returned as `open_header` instead.
    """
    ws = np.flatnonzero(buf < 33)
    wv = buf[ws]
    if base == 0:  # a virtual line end before the file's first byte
        ws = np.concatenate((np.array([-1], np.int64), ws))
        wv = np.concatenate((np.array([_LF], np.uint8), wv))
    n = len(buf)
    le = np.flatnonzero((wv == _LF) | (wv == _CR))   # ws-ranks of the line ends
    after = ws[le] + 1                               # position just after each line end
    starts = np.zeros(len(le), np.uint8)             # first byte of each line owned by this block
    inside = (after < n) & (after >= owned_from)
    starts[inside] = buf[after[inside]]
    comments = np.flatnonzero(starts == _SEMI)
    hj = np.flatnonzero(starts == _GT)               # indices into `le` of the line end before each header
    hs = after[hj]
    if len(comments):
        at = int(after[comments[0]])
        owner = int(np.searchsorted(hs, at, "right")) - 1   # -1: in a record from an earlier block, or none
        raise _Problem("comment", base + at, base + int(hs[owner]) if owner >= 0 else _UNKNOWN)

    prefix_end = int(hs[0]) if len(hs) else n
    r0, r1 = np.searchsorted(ws, owned_from), np.searchsorted(ws, prefix_end)
    nonblank = (prefix_end - owned_from) - int(np.count_nonzero(_is_blank(wv[r0:r1])))
    if len(hs) == 0:
        return _BlockScan(FileScan.concat([]), None, None, nonblank)
    first_header = base + int(hs[0])
    if final:
        open_header = None
        ends = np.append(hs[1:], n)
        end_rank = np.append(le[hj[1:]] + 1, len(ws))   # ws-rank of the first byte < 33 at/after the end
    else:
        open_header = base + int(hs[-1])
        ends = hs[1:]
        end_rank = le[hj[1:]] + 1
        hj, hs = hj[:-1], hs[:-1]
        if len(hs) == 0:
            return _BlockScan(FileScan.concat([]), first_header, open_header, nonblank)
    records = _records(buf, base, ws, wv, le, hj, hs, ends, end_rank, nucleotides)
    return _BlockScan(records, first_header, open_header, nonblank)


def _records(buf, base, ws, wv, le, hj, hs, ends, end_rank, nucleotides: bool) -> FileScan:
    # Header end: the next line end after the one before the header (absent only for a last header
    # line with no line end at all, which has no body).
    he_i = hj + 1
    has_end = he_i < len(le)
    he_rank = np.where(has_end, le[np.minimum(he_i, len(le) - 1)], end_rank)
    has_end &= he_rank < end_rank
    he_rank = np.where(has_end, he_rank, end_rank)
    header_end = np.where(has_end, ws[np.minimum(he_rank, len(ws) - 1)], ends)

    # Control bytes: a header may hold any but NUL (NCBI's Ctrl-A), sequence data none.
    first_rank, stop_rank = int(le[hj[0]]) + 1, int(end_rank[-1])
    seg = wv[first_rank:stop_rank]
    suspect = np.flatnonzero((seg < 9) | ((seg > 13) & (seg < 32)))
    if len(suspect):
        pos = ws[first_rank + suspect]
        owner = np.searchsorted(hs, pos, side="right") - 1
        bad = (pos >= header_end[owner]) | (seg[suspect] == 0)
        if bad.any():
            k = int(np.argmax(bad))
            kind = "byte" if pos[k] >= header_end[owner[k]] else "header_nul"
            raise _Problem(kind, base + int(pos[k]), base + int(hs[owner[k]]), int(seg[suspect[k]]))
    first, stop = int(hs[0]), int(ends[-1])
    if buf[first:stop].max(initial=0) > 126:
        # Bytes above 126 are fine in a description (UTF-8), never in sequence data.
        high = np.flatnonzero(buf[first:stop] > 126) + first
        owner = np.searchsorted(hs, high, side="right") - 1
        in_seq = high >= header_end[owner]
        if in_seq.any():
            k = int(np.argmax(in_seq))
            raise _Problem("byte", base + int(high[k]), base + int(hs[owner[k]]), int(buf[high[k]]))
    # '>' is never a residue: in sequence data it is a header that does not start its line (indented), which
    # would join two records into one, or text glued to a sequence. (A description may hold it.)
    gt = buf[first:stop] == _GT
    if np.count_nonzero(gt) > len(hs):   # (each header start is one; their positions only where there are more)
        gts = np.flatnonzero(gt) + first
        owner = np.searchsorted(hs, gts, side="right") - 1
        in_seq = gts >= header_end[owner]
        if in_seq.any():
            k = int(np.argmax(in_seq))
            raise _Problem("gt", base + int(gts[k]), base + int(hs[owner[k]]))

    # id: from after '>' to the first byte < 33; a header with leading blanks is fixed up one by one.
    id_start = hs + 1
    id_rank = le[hj] + 1
    id_end = np.where(id_rank < len(ws), ws[np.minimum(id_rank, len(ws) - 1)], ends)
    id_end = np.minimum(id_end, header_end)
    for r in np.flatnonzero(id_end <= id_start):
        line = buf[hs[r] + 1:header_end[r]].tobytes()
        match = _ID.search(line)
        if match is None:
            raise _Problem("empty_id", base + int(hs[r]), base + int(hs[r]))
        id_start[r] = hs[r] + 1 + match.start()
        id_end[r] = hs[r] + 1 + match.end()

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

    nuc = None
    if nucleotides:
        mask = np.append(_nucleotide_mask(buf[first:stop]), False).view(np.uint8)   # a 0 to end the last body
        bounds = np.stack((body - first, ends - first), axis=1).ravel()
        nuc = np.where(body < ends, np.add.reduceat(mask, bounds, dtype=np.int32)[::2], 0).astype(np.int64)

    id_lengths = id_end - id_start
    starts_in_blob = np.cumsum(id_lengths) - id_lengths
    gather = np.repeat(id_start - starts_in_blob, id_lengths) + np.arange(int(id_lengths.sum()))
    return FileScan(offsets=hs + base, nbytes=ends - hs, lengths=lengths, id_blob=buf[gather],
                    id_lengths=id_lengths, nucleotides=nuc)


@dataclass
class _RecordStream:
    """One record read block by block: its header line, then its sequence lines (bounded memory)."""

    start: int
    in_header: bool = True
    id_parts: list = field(default_factory=list)
    id_state: int = 0            # 0: blanks before the id, 1: inside it, 2: done
    residues: int = 0
    nucleotides: int = 0
    last: int = -1               # last non-blank byte of the sequence data so far
    checksum: int = 0            # of the bytes fed so far (the '>' is added by `result`)

    def feed(self, c: np.ndarray, at: int, count_nucleotides: bool) -> None:
        """Take the next piece `c` of the record, which starts at file offset `at`."""
        self.checksum = add(self.checksum, checksum(c, at))
        if self.in_header:
            ends = np.flatnonzero((c == _LF) | (c == _CR))
            head = c if len(ends) == 0 else c[:int(ends[0])]
            if len(head) and head.min() == 0:
                raise _Problem("header_nul", at + int(np.argmax(head == 0)), self.start)
            self._take_id(head)
            if len(ends) == 0:
                return
            self.in_header = False
            if self.id_state == 0:
                raise _Problem("empty_id", self.start, self.start)
            at += int(ends[0])
            c = c[int(ends[0]):]
        low = c < 33
        lowv = c[low]
        bad = (lowv < 9) | ((lowv > 13) & (lowv < 32))
        if bad.any():
            raise _Problem("byte", at + int(np.flatnonzero(low)[np.argmax(bad)]), self.start, int(lowv[np.argmax(bad)]))
        if len(c) and c.max() > 126:
            k = int(np.argmax(c > 126))
            raise _Problem("byte", at + k, self.start, int(c[k]))
        gt = np.flatnonzero(c == _GT)
        if len(gt):
            raise _Problem("gt", at + int(gt[0]), self.start)
        blanks = len(lowv)
        if blanks < len(c):
            self.residues += len(c) - blanks
            tail = low[-256:]
            k = len(c) - len(tail) + int(np.flatnonzero(~tail)[-1]) if not tail.all() else \
                int(np.flatnonzero(~low)[-1])
            self.last = int(c[k])
            if count_nucleotides:
                self.nucleotides += int(np.count_nonzero(_nucleotide_mask(c)))

    def _take_id(self, head: np.ndarray) -> None:
        if self.id_state == 0:
            visible = np.flatnonzero(head > 32)
            if len(visible) == 0:
                return
            head, self.id_state = head[int(visible[0]):], 1
        if self.id_state == 1:
            stop = np.flatnonzero(head < 33)
            self.id_parts.append((head[:int(stop[0])] if len(stop) else head).copy())   # buf is reused
            if len(stop):
                self.id_state = 2

    def result(self, stop: int) -> FileScan:
        if self.id_state == 0:
            raise _Problem("empty_id", self.start, self.start)
        ident = np.concatenate(self.id_parts)
        residues = self.residues - (self.last == _STAR)
        return FileScan(np.array([self.start], np.int64), np.array([stop - self.start], np.int64),
                        np.array([residues], np.int64), ident.astype(np.uint8, copy=False),
                        np.array([len(ident)], np.int64), np.array([self.nucleotides], np.int64),
                        np.array([add(self.checksum, checksum(b">", self.start))], np.uint64))


class _FileScanner:
    def __init__(self, path: str, threads: int, nucleotides: bool, hashes: bool = False):
        self.path, self.hashes = path, hashes
        self.threads = threads
        self.nucleotides = nucleotides
        self.text = open_text(path, verify=True)
        self.size = self.text.size
        self._local = threading.local()

    def close(self) -> None:
        self.text.close()

    def _read(self, start: int, stop: int) -> np.ndarray:
        """Bytes [start, stop) into this thread's buffer (fresh large allocations would page-fault on every
        block); stop - start is at most BLOCK_BYTES + 8."""
        return self._read_aligned(start, stop, start)[0]

    def _read_aligned(self, start: int, stop: int, aligned: int) -> tuple[np.ndarray, np.ndarray]:
        """`_read`, placing the byte at file offset `aligned` at an 8-byte boundary; also returns the bytes
        from there on as little-endian 64-bit words (the last one padded with zeros), as the checksums
        read them."""
        n = stop - start
        lead = -(aligned - start) % 8
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < lead + n + 8:
            buf = self._local.buf = np.empty(max(n, BLOCK_BYTES + 8) + 16, np.uint8)
        buf[lead + n:lead + n + 8] = 0
        data = buf[lead:lead + n]
        if self.text.read_into(data, start) != n:
            raise FastaError(self.path, "file changed while it was being read; run again once it is complete")
        first = lead + aligned - start
        return data, buf[first:first + -(-(stop - aligned) // 8) * 8].view("<u8")

    def block(self, k: int) -> _BlockScan:
        start = k * BLOCK_BYTES
        stop = min(self.size, start + BLOCK_BYTES)
        lo = max(0, start - 1)  # one byte of look-behind tells whether a '>' starts a line
        grid = start - start % 8   # checksum words sit at multiples of 8 in the file (only tests' blocks are odd)
        data, words = self._read_aligned(min(lo, grid), stop, grid)
        buf = data[lo - min(lo, grid):]
        scan = _scan_buffer(buf, lo, owned_from=start - lo, final=stop == self.size, nucleotides=self.nucleotides)
        records = scan.records
        if len(records.offsets):   # while the block is in cache (the buffer is scratch space after this)
            rel = records.offsets - grid
            records.checksums = block_checksums(words, grid // 8, rel, rel + records.nbytes, overwrite=True)
            if self.hashes:   # on the scan's threads, beside the scan of the next blocks
                records.id_hashes = _hashes_of(records)
        return scan

    def record(self, start: int, stop: int) -> FileScan:
        """Exactly one record that crossed a block boundary, streamed through block-sized reads."""
        stream = _RecordStream(start)
        for at in range(start + 1, stop, BLOCK_BYTES):   # from after the '>'
            stream.feed(self._read(at, min(stop, at + BLOCK_BYTES)), at, self.nucleotides)
        scan = stream.result(stop)
        if self.hashes:
            scan.id_hashes = _hashes_of(scan)
        return scan

    def pieces(self) -> Iterator[FileScan]:
        """The records in file order, a window of blocks at a time (memory bounded by two windows): the
        threads scan the next window while the caller takes this one's records."""
        _sniff(self.path, self.text.pread(1 << 16, 0))
        nblocks = max(1, -(-self.size // BLOCK_BYTES))
        window = 4 * self.threads
        starts = list(range(0, nblocks, window))
        pending, seen_header = None, False
        with ThreadPoolExecutor(self.threads) as pool:
            ahead = [pool.submit(self.block, k) for k in range(0, min(nblocks, window))]
            for w0 in starts:
                blocks = [f.result() for f in ahead]
                nxt = w0 + window
                ahead = [pool.submit(self.block, k) for k in range(nxt, min(nblocks, nxt + window))]
                seen_header = seen_header or self._check_prefix(blocks)
                pieces = []
                # A record that crosses a block boundary runs from a block's last header to the next header
                # (read here, on this thread: one or none per block).
                for b in blocks:
                    if b.first_header is not None and pending is not None:
                        pieces.append(self.record(pending, b.first_header))
                        pending = None
                    pieces.append(b.records)
                    if b.open_header is not None:
                        pending = b.open_header
                yield from (p for p in pieces if len(p.offsets))
            if not seen_header:
                raise FastaError(self.path, "no FASTA records: the file is empty" if self.size == 0 else
                                 "no FASTA records: the file holds no '>' header",
                                 hint="A record is a '>' header line followed by sequence lines")
            if pending is not None:
                yield self.record(pending, self.size)

    def _check_prefix(self, blocks: list[_BlockScan]) -> bool:
        """Everything before the first header must be blank; say so precisely when it is not. True once a
        header was found in `blocks` (the caller passes the blocks up to the first header)."""
        for b in blocks:
            if b.nonblank_before_header:
                raise FastaError(self.path, "sequence data before the first header",
                                 line=line_number(self.path, _first_nonblank(self.path)),
                                 hint="Every record must start with a '>' header line; add one or remove the "
                                      "stray lines")
            if b.first_header is not None:
                return True
        return False


def legacy_content_crc32(path: str | os.PathLike) -> int:
    """The whole-file checksum that indexes of format 2 recorded (crc32 of each block's crc32), to compare
    a file with a run started before records had their own checksums."""
    crcs = []
    with open_stream(path) as fh:
        while block := fh.read(BLOCK_BYTES):
            crcs.append(zlib.crc32(block))
    return zlib.crc32(np.array(crcs or [0], "<u4").tobytes())


def _sniff(path: str, head: bytes) -> None:
    """Refuse, by name, files that are not FASTA text: compressed, UTF-16/32, FASTQ, HTML, binary."""
    if head[:2] == b"\x1f\x8b":
        raise FastaError(path, "file is gzip-compressed",
                         hint="Pass it to `run_shards run` or `run_shards index`, which decompress it into the cache")
    if head[:3] == b"\xef\xbb\xbf":
        raise FastaError(path, "file starts with a UTF-8 byte-order mark (BOM)", line=1,
                         hint="Save it without the BOM, e.g. sed -i '1s/^\\xEF\\xBB\\xBF//' TEXT")
    encoding = _wide_encoding(head)
    if encoding:
        name, source = encoding
        raise FastaError(path, f"file is {name} text, not ASCII or UTF-8",
                         hint=f"Convert it: iconv -f {source} -t UTF-8 TEXT > TEXT.utf8.fasta")
    text = head.lstrip(_WHITESPACE)
    if not text or text[:1] == b">":
        return
    lines = re.split(rb"\r\n|\r|\n", text, maxsplit=4)
    if text[:1] == b"@" and len(lines) > 3 and lines[2][:1] == b"+":
        raise FastaError(path, "this is a FASTQ file (reads with quality lines), not FASTA", line=1,
                         hint="Convert it, e.g. sed -n '1~4s/^@/>/p;2~4p' TEXT > TEXT.fasta "
                              "(or seqtk seq -a TEXT > TEXT.fasta)")
    if text[:1] == b"<" and re.search(rb"<!doctype html|<html", text[:4096], re.IGNORECASE):
        raise FastaError(path, "this is an HTML page, not a FASTA file", line=1,
                         hint="A download probably saved a web page (an error, login or redirect page): download "
                              "the FASTA itself (e.g. curl -fL -o FILE URL) and check that it starts with '>'")
    if any(c > 126 or (c < 32 and c not in _WHITESPACE) for c in head[:4096]):
        raise FastaError(path, "binary data, not a FASTA text file", line=1,
                         hint="Pass an uncompressed protein/nucleotide FASTA text file")


def _wide_encoding(head: bytes) -> tuple[str, str] | None:
    """(name, iconv source encoding) for UTF-16/32 text, told by its byte-order mark or, without one, by
    the zero bytes that sit beside every ASCII character."""
    for bom, name, source in ((b"\xff\xfe\x00\x00", "UTF-32 (little-endian)", "UTF-32"),
                              (b"\x00\x00\xfe\xff", "UTF-32 (big-endian)", "UTF-32"),
                              (b"\xff\xfe", "UTF-16 (little-endian)", "UTF-16"),
                              (b"\xfe\xff", "UTF-16 (big-endian)", "UTF-16")):
        if head.startswith(bom):
            return name, source
    sample = head[:64 - len(head[:64]) % 4]
    if len(sample) < 8:
        return None
    lanes = [sample[k::4] for k in range(4)]
    zero = [not lane.strip(b"\0") for lane in lanes]
    if zero == [False, True, True, True]:
        return "UTF-32 (little-endian)", "UTF-32LE"
    if zero == [True, True, True, False]:
        return "UTF-32 (big-endian)", "UTF-32BE"
    if zero[1] and zero[3] and not zero[0]:
        return "UTF-16 (little-endian)", "UTF-16LE"
    if zero[0] and zero[2] and not zero[1]:
        return "UTF-16 (big-endian)", "UTF-16BE"
    return None


def scan_fasta(path: str | os.PathLike, threads: int | None = None, nucleotides: bool = False) -> FileScan:
    """Scan one FASTA file; raise FastaError naming file, line and id for malformed input.

    `nucleotides`: also count, per record, the residues that are A, C, G, T, U or N (`FileScan.nucleotides`).
    """
    stream = ScanStream(path, threads, nucleotides)
    scan = FileScan.concat(list(stream))
    scan.table = stream.table
    return scan


class ScanStream:
    """The records of one FASTA file as FileScan pieces in file order, a few blocks at a time, so that
    memory does not grow with the file; `table` (a BGZF file's block table, else None) once iterated.
    `hashes`: each piece's `id_hashes` too."""

    def __init__(self, path: str | os.PathLike, threads: int | None = None, nucleotides: bool = False,
                 hashes: bool = False):
        self.path, self.nucleotides, self.hashes = os.fspath(path), nucleotides, hashes
        self.threads = threads or min(8, affinity_cpus())
        self.table: np.ndarray | None = None

    def __iter__(self) -> Iterator[FileScan]:
        scanner = _open_scanner(self.path, self.threads, self.nucleotides, self.hashes)
        try:
            yield from scanner.pieces()
            self.table = scanner.text.table
        except _Problem as p:
            raise _explain(self.path, p) from None
        finally:
            scanner.close()


def _hashes_of(scan: FileScan) -> np.ndarray:
    offsets = np.zeros(len(scan.id_lengths) + 1, np.int64)
    np.cumsum(scan.id_lengths, out=offsets[1:])
    return id_hashes(scan.id_blob, offsets)


def _open_scanner(path: str, threads: int, nucleotides: bool, hashes: bool = False) -> "_FileScanner":
    if os.path.isdir(path):
        raise FastaError(path, "is a directory, not a FASTA file")
    try:
        return _FileScanner(path, threads, nucleotides, hashes)
    except FileNotFoundError:
        if os.path.basename(path) == "-":
            raise FastaError(path, "no such file, and standard input ('-') is not read", hint="The index needs a "
                             "file it can read again: save the FASTA to a file and pass its path") from None
        raise FastaError(path, "file not found", hint="Check the path") from None
    except PermissionError:
        raise FastaError(path, "permission denied: cannot read the file") from None
    except OSError as e:
        raise FastaError(path, f"cannot open: {e.strerror or e}") from None


def _explain(path: str, p: _Problem) -> FastaError:
    line = line_number(path, p.offset)
    if p.record == _UNKNOWN:
        p.record = _record_before(path, p.offset)
    seq_id = None if p.record is None else _id_at(path, p.record)
    if p.kind == "comment":
        where = "before the first header" if p.record is None else "among the sequence lines"
        return FastaError(path, f"comment line (starting with ';') {where}", line=line, seq_id=seq_id,
                          hint="FASTA comment lines are not supported (they would be read as residues); remove "
                               "them, e.g. sed '/^;/d' TEXT > TEXT.nocomments.fasta")
    if p.kind == "empty_id":
        return FastaError(path, "header has no id (no word right after '>')", line=line,
                          hint="Give every record an id: '>my_id optional description'")
    if p.kind == "gt":
        return FastaError(path, "'>' in the sequence data: a header starts at the beginning of its line", line=line,
                          seq_id=seq_id, hint="A '>' after spaces (an indented header) would be read as residues, "
                                              "joining two records into one: remove what comes before it on its line, "
                                              "or the stray '>'")
    if p.kind == "header_nul":
        return FastaError(path, "NUL byte (0x00) in the header", line=line, seq_id=seq_id or None,
                          hint="A header may hold any text but NUL; the file is corrupt or not a FASTA text file")
    if p.value > 127:
        return FastaError(path, f"non-ASCII byte 0x{p.value:02x} in the sequence data", line=line, seq_id=seq_id,
                          hint="Residues are ASCII letters; fix or remove that character")
    return FastaError(path, f"binary or control byte 0x{p.value:02x} in the sequence data", line=line,
                      seq_id=seq_id, hint="Sequence lines hold residues and whitespace only; the file is corrupt or "
                                          "not a FASTA text file")


def _id_at(path: str, offset: int) -> str:
    """Id of the record whose '>' is at `offset`, for error messages."""
    with open_stream(path) as fh:
        fh.seek(offset + 1)
        head = fh.read(1 << 16)
    end = _LINE_END.search(head)
    return id_of_header(head[:end.start() if end else len(head)].replace(b"\0", b" ")).decode("utf-8", "replace")


def _first_nonblank(path: str) -> int:
    """Offset of the first byte that is not whitespace (the file size if there is none)."""
    at = 0
    with open_stream(path) as fh:
        while chunk := fh.read(1 << 20):
            rest = chunk.lstrip(_WHITESPACE)
            if rest:
                return at + len(chunk) - len(rest)
            at += len(chunk)
    return at


def _record_before(path: str, offset: int) -> int | None:
    """Offset of the last header that starts before `offset` (None: there is none), read backwards."""
    header = re.compile(rb"[\r\n]>")
    with open_stream(path) as fh:
        stop = offset
        while stop > 0:
            start = max(0, stop - (1 << 20))
            fh.seek(start)
            chunk = fh.read(stop - start + 1)   # one byte more: a line end just before `stop`
            hits = [m.start() for m in header.finditer(chunk) if start + m.start() + 1 < offset]
            if hits:
                return start + hits[-1] + 1
            stop = start
        fh.seek(0)
        return 0 if fh.read(1) == b">" else None
