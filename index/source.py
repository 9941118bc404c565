"""Reading an input's text by offset: a plain file through positioned reads, a BGZF file in place through
its block table (bgzf.py). Offsets are always those of the (uncompressed) text, in the index as here.
"""
from __future__ import annotations

import io
import os

import numpy as np

from .bgzf import BgzfStream, BgzfText, looks_like_bgzf


def read_into(fd: int, buf, offset: int) -> int:
    """pread into the writable buffer `buf` until it is full or the file ends (one call returns at most
    about 2 GiB); returns the bytes read."""
    view, done = memoryview(buf).cast("B"), 0
    while done < len(view):
        got = os.preadv(fd, [view[done:done + (1 << 30)]], offset + done)
        if got == 0:
            break
        done += got
    return done


class PlainText:
    """An uncompressed file."""

    table = None

    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self.fd).st_size

    def close(self) -> None:
        os.close(self.fd)

    def read_into(self, buf, offset: int) -> int:
        return read_into(self.fd, buf, offset)

    def pread(self, size: int, offset: int) -> bytes:
        return os.pread(self.fd, size, offset)


def is_bgzf(path: str | os.PathLike) -> bool:
    try:
        with open(path, "rb") as fh:
            return looks_like_bgzf(fh.read(1 << 10))
    except OSError:
        return False


def open_text(path: str | os.PathLike, table: np.ndarray | None = None,
              verify: bool = False) -> PlainText | BgzfText:
    """The text of `path`: a BGZF file when `table` (its block table) is given or its first member says
    so, else the file itself. `verify`: check each BGZF member's CRC32 (once, when indexing)."""
    path = os.fspath(path)
    if table is not None or is_bgzf(path):
        return BgzfText(path, table, verify)
    return PlainText(path)


def open_stream(path: str | os.PathLike) -> io.BufferedIOBase:
    """The text of `path` as a seekable binary file, read sequentially (error messages, line numbers)."""
    path = os.fspath(path)
    if is_bgzf(path):
        return io.BufferedReader(BgzfStream(BgzfText(path)), 1 << 20)
    return open(path, "rb")


def line_number(path: str | os.PathLike, offset: int) -> int:
    """1-based line number of byte `offset` in `path`, lines ending at LF, CRLF or a lone CR (only used to
    word error messages)."""
    count, previous = 0, b""
    with open_stream(path) as fh:
        remaining = offset
        while remaining > 0:
            chunk = fh.read(min(remaining, 1 << 24))
            if not chunk:
                break
            count += chunk.count(b"\n") + chunk.count(b"\r") - chunk.count(b"\r\n")
            if previous == b"\r" and chunk[:1] == b"\n":   # a CRLF split between two reads
                count -= 1
            previous = chunk[-1:]
            remaining -= len(chunk)
    return count + 1
