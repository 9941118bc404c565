"""The index file: a header (magic, version, JSON table of arrays) and 64-byte-aligned little-endian arrays.

Arrays are written from chunks (in memory, from spill files or from another index file), so a file of
any size is written with bounded memory, and read back memory-mapped: a reader touches only the pages of
the rows it reads. The header's `crc32` covers the index's own arrays in table order; a run's stride
table (stride.py) has its own `stride.crc32`, so the index's fingerprint does not depend on it.
"""
from __future__ import annotations

import contextlib
import json
import mmap
import os
import zlib
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import numpy as np

MAGIC = b"RSIDX\x00\r\n"
ALIGN = 64
_COPY_BYTES = 16 << 20
_CRC_SLOT = '"@crc32@"'
_STRIDE_CRC_SLOT = '"@stride_crc32@"'


class IndexCorrupt(Exception):
    """A stored index that cannot be trusted (truncated, wrong checksum, wrong version)."""


@dataclass
class Part:
    """One array to write: its dtype and shape, and its bytes as chunks (read lazily, in order)."""
    name: str
    dtype: np.dtype
    shape: tuple
    chunks: Callable[[], Iterable]
    stride: bool = False   # part of a run's stride table (its own checksum)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def in_memory(name: str, arr: np.ndarray, stride: bool = False) -> Part:
    """A part from an array (memory-mapped arrays are read a chunk at a time)."""
    arr = np.asarray(arr)
    return Part(name, arr.dtype, tuple(arr.shape), lambda: _array_chunks(arr), stride)


def _array_chunks(arr: np.ndarray) -> Iterator[memoryview]:
    flat = arr.reshape(-1)
    step = max(1, _COPY_BYTES // max(1, arr.dtype.itemsize))
    for a in range(0, len(flat), step):
        yield raw(flat[a:a + step])


def raw(arr: np.ndarray) -> memoryview:
    """The bytes of an array (of any shape, empty ones included)."""
    return memoryview(np.ascontiguousarray(arr).reshape(-1)).cast("B")


def write(path: str | os.PathLike, version: int, count: int, parts: list[Part], header: dict) -> None:
    """Write atomically (temporary name, fsync, rename); a failure leaves no partial file."""
    path = os.fspath(path)
    table, pos = {}, 0
    for p in parts:
        table[p.name] = [np.dtype(p.dtype).str, list(p.shape), pos, p.nbytes]
        pos += -(-p.nbytes // ALIGN) * ALIGN
    stride = any(p.stride for p in parts)
    info = dict(header, version=version, count=count, arrays=table, crc32="@crc32@", data_bytes=pos)
    if stride:
        info["stride"] = dict(info.get("stride", {}), crc32="@stride_crc32@")
    text = json.dumps(info).replace(_CRC_SLOT, " " * 10).replace(_STRIDE_CRC_SLOT, " " * 10)
    head = MAGIC + np.array([version, len(text)], "<u4").tobytes()
    data_start = len(head) + len(text) + (-(len(head) + len(text)) % ALIGN)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as fh:
            fh.write(b"\0" * data_start)
            crcs = {False: 0, True: 0}
            for p in parts:
                written = 0
                for chunk in p.chunks():
                    chunk = memoryview(chunk).cast("B")
                    fh.write(chunk)
                    crcs[p.stride] = zlib.crc32(chunk, crcs[p.stride])
                    written += len(chunk)
                if written != p.nbytes:
                    raise AssertionError(f"index array {p.name}: {written} bytes written, {p.nbytes} expected")
                fh.write(b"\0" * (-p.nbytes % ALIGN))
            text = json.dumps(info).replace(_CRC_SLOT, f"{crcs[False]:<10d}").replace(
                _STRIDE_CRC_SLOT, f"{crcs[True]:<10d}")
            fh.seek(0)
            fh.write(head + text.encode())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as e:   # a full disk or an interruption leaves no partial file behind
        if isinstance(e, OSError) and e.filename is None:   # (a write's or close's error names no file: the
            e.filename = path                                # message says which could not be written)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class Mapped:
    """An index file mapped read-only: its header and its arrays as views of the mapping."""

    def __init__(self, path: str | os.PathLike, readable: tuple[int, ...]):
        self.path = os.fspath(path)
        self.fd = os.open(self.path, os.O_RDONLY)   # kept: a build's temporary file is read after its unlink
        with os.fdopen(os.dup(self.fd), "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            start = fh.read(16)
            if len(start) < 16 or start[:8] != MAGIC:
                raise IndexCorrupt(f"{path}: not a run_shards index")
            version, hlen = (int(x) for x in np.frombuffer(start[8:16], "<u4"))
            if version not in readable:
                raise IndexCorrupt(f"{path}: index format {version}, this version reads {max(readable)}")
            try:
                self.header = json.loads(fh.read(hlen))
            except ValueError:
                raise IndexCorrupt(f"{path}: unreadable header") from None
            self.version = version
            self.data_start = 16 + hlen + (-(16 + hlen) % ALIGN)
            if size != self.data_start + self.header.get("data_bytes", -1):
                raise IndexCorrupt(f"{path}: truncated or padded ({size} bytes)")
            self.map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else None

    def array(self, name: str) -> np.ndarray | None:
        entry = self.header["arrays"].get(name)
        if entry is None:
            return None
        dtype, shape, pos, nbytes = entry
        start = self.data_start + pos
        if start + nbytes > len(self.map):
            raise IndexCorrupt(f"{self.path}: truncated")
        if nbytes == 0:
            return np.zeros(shape, np.dtype(dtype))
        return np.frombuffer(self.map, np.dtype(dtype), nbytes // np.dtype(dtype).itemsize, start).reshape(shape)

    def verify(self, names: Iterable[str], expected: int, what: str = "checksum mismatch") -> None:
        """CRC of the named arrays, read from the file (not the mapping, so memory stays flat)."""
        crc = 0
        for name in names:
            for chunk in self.chunks(name):
                crc = zlib.crc32(chunk, crc)
        if crc != expected:
            raise IndexCorrupt(f"{self.path}: {what}")

    def chunks(self, name: str) -> Iterator[memoryview]:
        """The bytes of one array, read from the file a chunk at a time."""
        _, _, pos, nbytes = self.header["arrays"][name]
        at, stop = self.data_start + pos, self.data_start + pos + nbytes
        while at < stop:
            data = os.pread(self.fd, min(stop - at, _COPY_BYTES), at)
            if not data:
                raise IndexCorrupt(f"{self.path}: truncated")
            at += len(data)
            yield memoryview(data)

    def read(self, name: str, start: int, stop: int) -> np.ndarray:
        """Elements [start, stop) of a 1-D array, read from the file (not through the mapping)."""
        dtype, _, pos, _ = self.header["arrays"][name]
        dtype = np.dtype(dtype)
        count = max(0, stop - start)
        data = os.pread(self.fd, count * dtype.itemsize, self.data_start + pos + start * dtype.itemsize)
        if len(data) != count * dtype.itemsize:
            raise IndexCorrupt(f"{self.path}: truncated")
        return np.frombuffer(data, dtype).copy()

    def close(self) -> None:
        if self.fd < 0:   # (closed already: the number may belong to another file by now)
            return
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.fd = -1

    def release(self) -> None:
        """Drop this process's copies of the pages read so far (the page cache keeps them)."""
        if self.map is not None:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                self.map.madvise(mmap.MADV_DONTNEED)
