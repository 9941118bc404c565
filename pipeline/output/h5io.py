"""Reading and writing the columnar HDF5 layout (the same in part files, shard files and the merged file).

Writers append blocks of rows, keep a crc32 per dataset in write order, and only on `finish` record the
row count, the checksums and `complete = True`, flush, close and fsync. Files are always written under a
temporary name and renamed into place by the caller, so an existing file is a finished file; readers
still verify counts and checksums, so a truncated or altered file is never trusted.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import zlib
from pathlib import Path

import h5py
import numpy as np

from .schema import STR, Column, RowBlock, Schema, group_attrs
from ..rundir.layout import fsync_path

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20


# errnos of an open that failed for a reason outside the file: too many files open (this process's limit, the
# system's table), no permission. Calling such a file corrupt would send `rerun` to compute it again.
NOT_THE_FILES_FAULT = (errno.EMFILE, errno.ENFILE, errno.EACCES, errno.EPERM)


class CorruptFile(Exception):
    """An output file that cannot be trusted: unreadable, incomplete, or failing its checksums; `paths` are
    the files at fault."""

    def __init__(self, message: str, paths: list | tuple = ()):
        super().__init__(message)
        self.paths = [Path(p) for p in paths]


def _h5_dtype(c: Column):
    return h5py.string_dtype("utf-8") if c.dtype == STR else np.dtype(c.dtype)


def _chunk_rows(c: Column, rows_hint: int | None) -> int:
    """About 1 MiB per chunk, but no bigger than the data expected (HDF5 allocates whole chunks)."""
    rows = max(64, min(65536, CHUNK_BYTES // c.value_bytes()))
    return int(max(1, min(rows, rows_hint))) if rows_hint else int(rows)


def _crc(arr: np.ndarray, dtype: str, crc: int) -> int:
    if arr.size == 0:
        return crc
    if dtype == STR:
        return zlib.crc32(b"\0".join(x if isinstance(x, bytes) else x.encode() for x in arr.ravel()) + b"\0", crc)
    return zlib.crc32(memoryview(np.ascontiguousarray(arr)).cast("B"), crc)


def _dataset_crc(ds: h5py.Dataset) -> int:
    """The checksum of a whole dataset other than the columns (a result's id index, missing ids, ...), read in
    pieces of about 64 MiB: strings as the columns' are, anything else by its bytes."""
    text = h5py.check_string_dtype(ds.dtype) is not None
    step = max(1, (64 << 20) // max(1, ds.dtype.itemsize * int(np.prod(ds.shape[1:], dtype=np.int64))))
    crc = 0
    for a in range(0, ds.shape[0] if ds.shape else 1, step):
        part = ds[a:a + step] if ds.shape else ds[()]
        crc = _crc(np.asarray(part), STR, crc) if text else zlib.crc32(np.ascontiguousarray(part).tobytes(), crc)
    return crc


def _other_datasets(file: h5py.File, schema: Schema) -> list[str]:
    """The paths of every dataset of `file` that is not one of the schema's columns."""
    columns = {c.path for c in schema.columns}
    found: list[str] = []
    file.visititems(lambda name, obj: found.append(name) if isinstance(obj, h5py.Dataset) and name not in columns
                    else None)
    return sorted(found)


class Writer:
    def __init__(self, path: str | os.PathLike, schema: Schema, attrs: dict, rows_hint: int | None = None,
                 values_hint: dict[str, int] | None = None):
        self.path = Path(path)
        self.schema = schema
        self.file = h5py.File(self.path, "w")
        self.rows = 0
        self.nvalues = {g: 0 for g in schema.ragged_groups}
        self.crc = {c.path: 0 for c in schema.columns}
        self.offsets_crc = {f"{g}/offsets": _crc(np.zeros(1, np.int64), "int64", 0) for g in schema.ragged_groups}
        for c in schema.columns:
            shape = (0, c.width) if c.width else (0,)
            hint = (values_hint or {}).get(c.group) if c.ragged else rows_hint
            self.file.create_dataset(c.path, shape=shape, maxshape=(None,) + shape[1:], dtype=_h5_dtype(c),
                                     chunks=(_chunk_rows(c, hint),) + shape[1:])
        for g in schema.ragged_groups:
            self.file.create_dataset(f"{g}/offsets", data=np.zeros(1, np.int64), maxshape=(None,),
                                     chunks=(min(65536, (rows_hint or 65535) + 1),))
            for k, v in group_attrs(g, attrs).items():
                self.file[g].attrs[k] = v
        for k, v in attrs.items():
            self.file.attrs[k] = json.dumps(v) if isinstance(v, (dict, list)) else v
        self.file.attrs["schema"] = json.dumps(schema.to_json())
        self.file.attrs["finished"] = False

    def append(self, block: RowBlock) -> None:
        n = len(block)
        if n == 0:
            return
        for c in self.schema.row_columns:
            ds = self.file[c.path]
            data = block.columns[c.path]
            ds.resize(self.rows + n, axis=0)
            ds[self.rows:self.rows + n] = data
            self.crc[c.path] = _crc(data, c.dtype, self.crc[c.path])
        for g in self.schema.ragged_groups:
            lens = block.lengths[g]
            total = int(lens.sum())
            offsets = self.file[f"{g}/offsets"]
            offsets.resize(self.rows + n + 1, axis=0)
            ends = (self.nvalues[g] + np.cumsum(lens)).astype(np.int64)
            offsets[self.rows + 1:] = ends
            self.offsets_crc[f"{g}/offsets"] = _crc(ends, "int64", self.offsets_crc[f"{g}/offsets"])
            for c in self.schema.ragged_columns:
                if c.group == g and total:
                    ds = self.file[c.path]
                    ds.resize(self.nvalues[g] + total, axis=0)
                    ds[self.nvalues[g]:] = block.values[c.path]
                    self.crc[c.path] = _crc(block.values[c.path], c.dtype, self.crc[c.path])
            self.nvalues[g] += total
        self.rows += n

    def finish(self, extra_attrs: dict | None = None) -> None:
        """Record counts and checksums, mark finished, close and fsync.

        `finished` means the file was written to the end; `complete` (default True) is the result-level
        flag that says every expected sequence is present (False for `merge --allow-partial`).
        """
        extra = dict({"complete": True}, **(extra_attrs or {}))
        for k, v in extra.items():
            self.file.attrs[k] = json.dumps(v) if isinstance(v, (dict, list)) else v
        self.file.attrs["num_sequences"] = self.rows
        self.file.attrs["crc32"] = json.dumps(self.crc)
        # every other dataset's too (the ragged columns' offsets, a result's id index, missing and original ids,
        # variants table): a changed offset moves a row's values silently, a changed id index row gives another
        # record's row by id. Apart from crc32, which run_shards versions before 2026-12-07 check key by key.
        others = dict(self.offsets_crc, **{path: _dataset_crc(self.file[path])
                                           for path in _other_datasets(self.file, self.schema)
                                           if path not in self.offsets_crc})
        self.file.attrs["crc32_other"] = json.dumps(others)
        self.file.attrs["finished"] = True
        self.file.close()
        fsync_path(self.path)

    def abort(self) -> None:
        try:
            self.file.close()
        finally:
            self.path.unlink(missing_ok=True)


class Reader:
    """Reads a finished file; CorruptFile if it is unreadable or incomplete."""

    def __init__(self, path: str | os.PathLike, cache_bytes: int | None = None):
        """`cache_bytes`: HDF5's chunk cache per dataset (default 1 MiB); 0 for a file read in windows
        beside many others (a merge): each read then takes only the rows it asks for, and memory stays
        flat whatever the number of files open."""
        self.path = Path(path)
        try:
            cache = {} if cache_bytes is None else {"rdcc_nbytes": cache_bytes}
            self.file = h5py.File(self.path, "r", **cache)
            attrs = self.file.attrs
            if not bool(attrs.get("finished", False)):
                raise CorruptFile(f"{self.path}: not written to the end", [self.path])
            self.schema = Schema.from_json(json.loads(attrs["schema"]))
            self.rows = int(attrs["num_sequences"])
            self.expected_crc = json.loads(attrs["crc32"])
            self.expected_other = json.loads(attrs["crc32_other"]) if "crc32_other" in attrs else {}   # (earlier: none)
            if len(self.file["index"]) != self.rows:
                raise CorruptFile(f"{self.path}: {len(self.file['index'])} rows, header says {self.rows}", [self.path])
        except CorruptFile:
            self.close()
            raise
        except OSError as e:
            self.close()
            if e.errno in NOT_THE_FILES_FAULT:   # the file may be fine: say why it could not be opened instead
                raise OSError(e.errno, os.strerror(e.errno), str(self.path)) from None
            raise CorruptFile(f"{self.path}: unreadable ({type(e).__name__}: {e})", [self.path]) from None
        except Exception as e:  # h5py raises OSError/KeyError/ValueError for damaged files
            self.close()
            raise CorruptFile(f"{self.path}: unreadable ({type(e).__name__}: {e})", [self.path]) from None
        self.crc = {c.path: 0 for c in self.schema.columns}
        self.offsets_crc: dict[str, int] = {}   # of the offsets read in order, as `read` goes

    @property
    def attrs(self) -> dict:
        out = {}
        for k, v in self.file.attrs.items():
            if isinstance(v, bytes):
                v = v.decode()
            out[k] = v.item() if isinstance(v, np.generic) else v
        return out

    def data_bytes(self) -> int:
        """Bytes of the numeric datasets' values: a lower bound of any file holding these rows."""
        total = 0
        for c in self.schema.columns:
            if c.dtype != STR:
                ds = self.file[c.path]
                total += ds.size * ds.dtype.itemsize
        return total

    def index_column(self) -> np.ndarray:
        return self.file["index"][:]

    def index_slice(self, r0: int, r1: int) -> np.ndarray:
        """Positions of rows [r0, r1) (not checksummed: `read` reads them again)."""
        try:
            return self.file["index"][r0:r1]
        except Exception as e:
            raise CorruptFile(f"{self.path}: unreadable rows {r0}..{r1} ({type(e).__name__}: {e})", [self.path]) from None

    def offsets(self, group: str) -> np.ndarray:
        """The group's whole offsets, checked against their checksum (where the file records one)."""
        path = f"{group}/offsets"
        off = self.file[path][:]
        if path in self.expected_other and _crc(np.asarray(off, np.int64), "int64", 0) != self.expected_other[path]:
            raise CorruptFile(f"{self.path}: checksum mismatch in {path}", [self.path])
        return off

    def read(self, r0: int, r1: int, offsets: dict[str, np.ndarray] | None = None, check: bool = True) -> RowBlock:
        """Rows [r0, r1). With `check`, reads must be in order so checksums can be verified at the end."""
        try:
            columns = {c.path: self.file[c.path][r0:r1] for c in self.schema.row_columns}
            values, lengths, read_offsets = {}, {}, {}
            for g in self.schema.ragged_groups:
                off = offsets[g][r0:r1 + 1] if offsets else self.file[f"{g}/offsets"][r0:r1 + 1]
                read_offsets[g] = off
                lengths[g] = np.diff(off).astype(np.int64)
                for c in self.schema.ragged_columns:
                    if c.group == g:
                        values[c.path] = self.file[c.path][int(off[0]):int(off[-1])]
        except Exception as e:
            raise CorruptFile(f"{self.path}: unreadable rows {r0}..{r1} ({type(e).__name__}: {e})", [self.path]) from None
        if check:
            for c in self.schema.row_columns:
                self.crc[c.path] = _crc(columns[c.path], c.dtype, self.crc[c.path])
            for c in self.schema.ragged_columns:
                self.crc[c.path] = _crc(values[c.path], c.dtype, self.crc[c.path])
            for g, off in read_offsets.items():   # (in order: the first row's start, then each row's end)
                path = f"{g}/offsets"
                self.offsets_crc[path] = _crc(np.asarray(off[0 if r0 == 0 else 1:], np.int64), "int64",
                                              self.offsets_crc.get(path, 0))
        return RowBlock(self.schema, columns, values, lengths)

    def read_all(self) -> RowBlock:
        return self.read(0, self.rows)

    def verify_checksums(self) -> None:
        """After reading every row in order: CorruptFile if any column (or a ragged group's offsets, where the
        file records their checksum) differs from what was written."""
        bad = [k for k, v in self.expected_crc.items() if self.crc.get(k) != v]
        bad += [k for k, v in self.offsets_crc.items() if k in self.expected_other and self.expected_other[k] != v]
        if bad:
            raise CorruptFile(f"{self.path}: checksum mismatch in {', '.join(bad)}", [self.path])

    def verify(self) -> None:
        """Read the whole file in row windows and check its checksums, every other dataset's too."""
        step = max(1, (64 << 20) // max(1, sum(c.value_bytes() for c in self.schema.columns)))
        offsets = {g: self.offsets(g) for g in self.schema.ragged_groups}
        for r0 in range(0, self.rows, step):
            self.read(r0, min(self.rows, r0 + step), offsets)
        self.verify_checksums()
        bad = [path for path, v in self.expected_other.items() if not path.endswith("/offsets")
               and (path not in self.file or _dataset_crc(self.file[path]) != v)]
        if bad:
            raise CorruptFile(f"{self.path}: checksum mismatch in {', '.join(bad)}", [self.path])

    def close(self) -> None:
        f = getattr(self, "file", None)
        if f is not None:
            try:
                f.close()
            except Exception as e:   # h5py after a failed write: the error that matters was raised already
                log.debug("closing %s: %s: %s", self.path, type(e).__name__, e)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
