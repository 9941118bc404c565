"""BGZF (what `bgzip` writes, and what samtools faidx reads in place): gzip made of independent members of
at most 64 KiB of text each, every member saying its compressed size in a 'BC' extra field. A table of
the members' (compressed, uncompressed) start offsets lets any byte range of the text be read by
inflating just the members that hold it, so a BGZF file is indexed and read where it lies, with no copy.

The table is found by walking the member headers (a few hundred bytes read per MiB of file); the index
stores it, so workers never walk the file again.
"""
from __future__ import annotations

import io
import os
import struct
import zlib

import numpy as np

from .errors import FastaError

_HEADER = struct.Struct("<4BI2BH")           # ID1 ID2 CM FLG MTIME XFL OS XLEN
_WALK_BYTES = 1 << 20
_DAMAGED = "Download or copy the file again (gzip -t FILE checks it)"


class NotBgzf(Exception):
    """A gzip file, or a part of one, that is not BGZF (read through a decompressed copy instead)."""


def looks_like_bgzf(head: bytes) -> bool:
    """Whether the first member's header (at least 18 bytes) carries BGZF's 'BC' field."""
    return _block_size(head, 0) is not None


def _block_size(buf: bytes, at: int) -> int | None:
    """Total size of the BGZF member whose header starts at buf[at], None if it is not a BGZF header
    (or the header is not whole in `buf`)."""
    if len(buf) - at < 18:
        return None
    id1, id2, cm, flg, _, _, _, xlen = _HEADER.unpack_from(buf, at)
    if (id1, id2, cm) != (31, 139, 8) or not flg & 4 or len(buf) - at < 12 + xlen:
        return None
    pos, stop = at + 12, at + 12 + xlen
    while pos + 4 <= stop:                     # extra subfields: SI1 SI2 SLEN data
        si1, si2, slen = buf[pos], buf[pos + 1], buf[pos + 2] | buf[pos + 3] << 8
        if (si1, si2, slen) == (66, 67, 2) and pos + 6 <= stop:
            return (buf[pos + 4] | buf[pos + 5] << 8) + 1
        pos += 4 + slen
    return None


_TABLES: dict[tuple, np.ndarray] = {}


def block_table(path: str) -> np.ndarray:
    """int64 [M + 1, 2]: (compressed, uncompressed) start offset of each member, then (file size, text
    size). NotBgzf when a member is not BGZF; FastaError when the file ends inside a member, or without the
    empty member that ends every BGZF file (htslib's EOF marker: only it tells a file cut at a member boundary)."""
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    if key in _TABLES:
        return _TABLES[key]
    rows, coffset, uoffset = [], 0, 0
    buf, base = b"", 0                         # buf holds the file from offset `base` on
    fd = os.open(path, os.O_RDONLY)
    try:
        while coffset < st.st_size:
            if coffset - base + (1 << 16) > len(buf):     # less than a whole header (or member) left in buf
                buf, base = os.pread(fd, _WALK_BYTES, coffset), coffset
            at = coffset - base
            size = _block_size(buf, at)
            if size is None:
                rest = buf[at:]
                if coffset + len(rest) >= st.st_size and not rest.strip(b"\0"):
                    break                                  # zero padding after the last member, as gzip allows
                if coffset + len(rest) >= st.st_size and len(rest) < 18 and rest[:2] == b"\x1f\x8b":
                    raise FastaError(path, "the gzip data ends early (the file is truncated)", hint=_DAMAGED)
                raise NotBgzf(f"{path}: the gzip member at byte {coffset:,} is not BGZF")
            if at + size > len(buf):
                raise FastaError(path, "the gzip data ends early (the file is truncated)", hint=_DAMAGED)
            rows.append((coffset, uoffset))
            isize = struct.unpack_from("<I", buf, at + size - 4)[0]   # ISIZE: the member's text bytes
            uoffset += isize
            coffset += size
    finally:
        os.close(fd)
    if rows and isize:   # BGZF ends with an empty member: a file cut at a member boundary still inflates cleanly
        raise FastaError(path, "the BGZF end-of-file marker is missing: the file was cut short at a block boundary "
                               "(which gzip -t cannot tell), and its last record may be cut",
                         hint="Download or copy the file again; a whole file written without the marker is read "
                              "as its text: gzip -dc FILE > FILE.fasta")
    rows.append((coffset, uoffset))
    table = np.array(rows, np.int64).reshape(-1, 2)
    if len(_TABLES) >= 4:                      # kept between readable_paths and the scan that follows it
        _TABLES.pop(next(iter(_TABLES)))
    _TABLES[key] = table
    return table


class BgzfText:
    """The text of a BGZF file, read by offset through its block table (`block_table`)."""

    def __init__(self, path: str, table: np.ndarray | None = None, verify: bool = False):
        self.path = path
        self.table = block_table(path) if table is None else table
        self.size = int(self.table[-1, 1])
        self.verify = verify                   # check each member's CRC32 (the indexer does; workers rely
        self.fd = os.open(path, os.O_RDONLY)   # on the records' own checksums)
        self._last: tuple[int, bytes] = (-1, b"")

    def close(self) -> None:
        os.close(self.fd)

    def _members(self, start: int, stop: int) -> tuple[int, int]:
        """Rows of the members holding text bytes [start, stop)."""
        u = self.table[:, 1]
        first = int(np.searchsorted(u, start, "right")) - 1
        last = int(np.searchsorted(u, stop, "left"))
        return max(first, 0), min(max(last, first + 1), len(self.table) - 1)

    def _inflate(self, raw: bytes, at: int, row: int, need: int) -> bytes:
        """The text of the member at raw[at:] (row `row` of the table), or at least its first `need` bytes:
        a record's read stops inflating where the record ends (on average half a member), unless `verify`
        asks for each whole member and its CRC32."""
        size = _block_size(raw, at)
        if size is None or at + size > len(raw):
            raise FastaError(self.path, f"the gzip data is damaged (no BGZF member at byte "
                             f"{int(self.table[row, 0]):,})", hint=_DAMAGED)
        xlen = struct.unpack_from("<H", raw, at + 10)[0]
        crc, isize = struct.unpack_from("<II", raw, at + size - 8)
        whole = self.verify or need >= isize
        try:
            deflated = raw[at + 12 + xlen:at + size - 8]
            text = zlib.decompress(deflated, -15) if whole else zlib.decompressobj(-15).decompress(deflated, need)
        except zlib.error as e:
            raise FastaError(self.path, f"the gzip data is damaged ({e})", hint=_DAMAGED) from None
        if len(text) != (isize if whole else need) or (self.verify and zlib.crc32(text) != crc):
            raise FastaError(self.path, f"the gzip data is damaged (member at byte {int(self.table[row, 0]):,} "
                             "does not match its checksum)", hint=_DAMAGED)
        return text

    def read_into(self, buf, offset: int) -> int:
        """Text bytes from `offset` into the writable buffer `buf` until it is full or the text ends;
        returns the bytes written."""
        view = memoryview(buf).cast("B")
        stop = min(offset + len(view), self.size)
        if stop <= offset:
            return 0
        first, last = self._members(offset, stop)
        done = 0
        row = first
        while row < last:                      # a few MiB of compressed data at a time
            end = min(last, row + 64)
            c0, c1 = int(self.table[row, 0]), int(self.table[end, 0])
            raw = os.pread(self.fd, c1 - c0, c0)
            if len(raw) != c1 - c0:
                raise FastaError(self.path, "the file changed while it was being read; run again once it is "
                                 "complete")
            for r in range(row, end):
                u0 = int(self.table[r, 1])
                need = min(stop, int(self.table[r + 1, 1])) - u0
                cached = self._last            # (one read: the scan's threads share this object)
                if cached[0] == r and len(cached[1]) >= need:
                    text = cached[1]
                else:
                    text = self._inflate(raw, int(self.table[r, 0]) - c0, r, need)
                    self._last = (r, text)
                lo, hi = max(offset, u0) - u0, min(stop, u0 + len(text)) - u0
                if hi > lo:
                    view[done:done + hi - lo] = text[lo:hi]
                    done += hi - lo
            row = end
        return done

    def pread(self, size: int, offset: int) -> bytes:
        buf = bytearray(max(0, min(size, self.size - offset)))
        got = self.read_into(buf, offset)
        return bytes(buf[:got])


class BgzfStream(io.RawIOBase):
    """A BGZF file's text as a seekable binary file (for the few places that read text sequentially)."""

    def __init__(self, text: BgzfText):
        super().__init__()
        self.text, self.position = text, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        got = self.text.read_into(buf, self.position)
        self.position += got
        return got

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.text.size}[whence]
        self.position = max(0, base + offset)
        return self.position

    def tell(self) -> int:
        return self.position

    def close(self) -> None:
        if not self.closed:
            self.text.close()
        super().close()
