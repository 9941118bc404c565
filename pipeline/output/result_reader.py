"""Reading a result by id, by FASTA position or in chunks, without loading it: what `run_shards get`
and Python users (numpy, pandas) read a result.h5 with.

    from pipeline.output.result_reader import open_result
    with open_result("OUT") as res:                 # a run directory or a result.h5
        len(res), res.columns                      # rows; every column's dataset path
        res.get("P12345")["embeddings/mean"]       # one row by id: {column: value}
        res.records(["a", "b"])                    # their rows, each {column: value}
        res.rows(["a", "b"])                       # their rows (MissingIds names any that are absent)
        res.at_position(17)                        # the row of the FASTA's 18th record
        for chunk in res.chunks(100_000, ["ids", "embeddings/mean"]): ...   # {column: array}
        res.per_residue(row, "per_residue/values") # a row's per-residue values, [residues, dim]

Lookups go through the id index the merge writes (id_index.py); a result written before it is searched
by reading its ids once, a chunk at a time.
"""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Iterable, Iterator

import h5py
import numpy as np

from ..advice import command
from ..errors import UserError
from ..rundir.layout import RunDir, describe_holder
from .id_index import GROUP, VERIFY_ABOVE, IdIndex, hashes_of
from .schema import STR, Column, Schema

MAX_NAMED = 10


class MissingIds(UserError):
    """Ids asked for that the result does not hold."""

    def __init__(self, path: Path, missing: list[str]):
        self.missing = missing
        shown = ", ".join(repr(m) for m in missing[:MAX_NAMED])
        more = f" (and {len(missing) - MAX_NAMED:,} more)" if len(missing) > MAX_NAMED else ""
        header = next((m for m in missing if m.startswith(">")), None)
        lines = "" if header is None else (
            f"; {header!r} is looked up as written: `--ids-from FILE` reads FASTA header lines (its id, without '>' "
            "and the description)")
        super().__init__(f"{len(missing):,} id(s) not in {path}: {shown}{more}. Ids are matched exactly as "
                         "the FASTA header's first word (renamed duplicates as 'id.dup2'); a partial result "
                         f"lists the ids it lacks in `missing_ids`{lines}")


def result_path(path: str | os.PathLike) -> Path:
    """A result.h5, or the result of a finished run directory."""
    path = Path(path)
    if path.is_dir():
        if not (path / "result.h5").exists():
            run = RunDir(path)
            holder = run.active_command()
            # (`merge` would be refused, naming the command that holds the run; one of another node, whose
            # process cannot be checked from here, may be a killed command's record: then merging is the way)
            if holder and holder.get("host") == socket.gethostname():
                raise UserError(f"{path} holds no result.h5 yet: a run_shards command is working there now "
                                f"({describe_holder(holder)}); `{command('status', path)}` shows its progress, "
                                "and the result can be read once it is merged")
            if not run.manifest_path.exists():   # (status and merge would refuse it too: name no command here)
                raise UserError(f"{path} is not a run_shards run directory (it holds neither result.h5 nor "
                                "manifest.json): give the --out folder of a run, or a result.h5 file")
            raise UserError(f"{path} holds no result.h5 yet: `{command('status', path)}` says what is left, "
                            f"`{command('rerun', path)}` computes it and merges, and "
                            f"`{command('merge', path, '--allow-partial')}` merges the rows there are now")
        return path / "result.h5"
    if not path.exists():
        raise UserError(f"{path}: no such result file or run directory")
    return path


class ResultFile:
    """An open result; see the module's docstring."""

    def __init__(self, path: str | os.PathLike):
        self.path = result_path(path)
        try:   # no chunk cache: a row read takes its own bytes, not its columns' whole 1 MiB chunks
            self.file = h5py.File(self.path, "r", rdcc_nbytes=0)
            self.schema = Schema.from_json(json.loads(self.file.attrs["schema"]))
            self.n = int(self.file.attrs["num_sequences"])
        except PermissionError as e:   # not a damaged file: another user's, closed to others (HDF5 names no file)
            raise PermissionError(e.errno, e.strerror, str(self.path)) from None
        except (OSError, KeyError, ValueError) as e:
            raise UserError(f"{self.path} is not a readable run_shards result ({type(e).__name__}: {e})") from None
        self.ids = IdIndex(self.file) if GROUP in self.file else None
        self._opened: dict[str, h5py.Dataset] = {}   # datasets opened once, when first read

    def __len__(self) -> int:
        return self.n

    def __enter__(self) -> "ResultFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.file.close()

    @property
    def columns(self) -> list[str]:
        return [c.path for c in self.schema.columns]

    @property
    def attrs(self) -> dict:
        return {k: v.decode() if isinstance(v, bytes) else v.item() if isinstance(v, np.generic) else v
                for k, v in self.file.attrs.items()}

    # ---------------------------------------------------------------- by id, by position
    def rows(self, ids: Iterable[str]) -> np.ndarray:
        """The row of each id, in the order given; MissingIds naming every id the result lacks."""
        ids = _id_list(ids, "rows")
        rows = self._rows_indexed(ids) if self.ids is not None else self._rows_scanned(ids)
        missing = [i for i, r in zip(ids, rows) if r < 0]
        if missing:
            raise MissingIds(self.path, missing)
        return rows

    def _rows_indexed(self, ids: list[str]) -> np.ndarray:
        out = np.full(len(ids), -1, np.int64)
        for k, (name, key, check) in enumerate(zip(ids, hashes_of(ids), hashes_of(ids, check=True))):
            for row in self.ids.candidates(int(key), int(check)):
                if (self.ids.checked and len(name.encode()) <= VERIFY_ABOVE) \
                        or _text(self._data("ids")[int(row)]) == name:   # (an index without check hashes: the id decides)
                    out[k] = int(row)
                    break
        return out

    def _data(self, path: str) -> h5py.Dataset:
        found = self._opened.get(path)
        if found is None:
            found = self._opened[path] = self.file[path]
        return found

    def _rows_scanned(self, ids: list[str]) -> np.ndarray:
        """A result without an id index: its ids read once, a chunk at a time."""
        wanted: dict[str, list[int]] = {}
        for k, i in enumerate(ids):
            wanted.setdefault(i, []).append(k)
        out = np.full(len(ids), -1, np.int64)
        step = 1 << 18
        for a in range(0, self.n, step):
            for j, value in enumerate(self.file["ids"][a:a + step]):
                for k in wanted.get(_text(value), ()):
                    out[k] = a + j
        return out

    def get(self, seq_id: str) -> dict:
        """Every column of the row of `seq_id`."""
        return self.records([seq_id])[0]

    def records(self, ids: list[str]) -> list[dict]:
        """Every column of the row of each id, in the order given. Each row's own id (read with the row) is
        checked against the id asked for: the id index is trusted on its 128-bit hashes, so a damaged index is
        named here instead of answering with another record's row."""
        ids = _id_list(ids, "records")
        rows = self.rows(ids)
        found = [self.row(int(r)) for r in rows]
        for asked, r, record in zip(ids, rows, found):
            if record["ids"] != asked:
                raise UserError(f"{self.path} is damaged: its id index gives row {int(r):,} for the id {asked!r}, and "
                                f"that row holds {record['ids']!r}. {_damage_advice(self.path)}")
        return found

    def at_position(self, position: int) -> dict:
        """The row of the FASTA record at `position` (0-based, in the order of the run's input files)."""
        return self.row(self.row_of_position(position))

    def row_of_position(self, position: int) -> int:
        index = self.file["index"]
        lo, hi = 0, self.n
        if 0 <= position < self.n and int(index[position]) == position:   # a complete result: row = position
            return position
        while lo < hi:   # a partial result: rows are sorted by position
            mid = (lo + hi) // 2
            if int(index[mid]) < position:
                lo = mid + 1
            else:
                hi = mid
        if lo < self.n and int(index[lo]) == position:
            return lo
        records = self.n + int(self.file.attrs.get("num_missing", 0))   # (a partial result lacks num_missing rows)
        why = f"the input has {records:,} records" if not 0 <= position < records else \
            "the result is partial: its row was not computed when it was merged"
        raise UserError(f"{self.path} has no row for FASTA record {position} (0-based; {why})")

    # ---------------------------------------------------------------- rows and chunks
    def row(self, i: int) -> dict:
        """Every column of row `i`: scalars, vectors, and each ragged column's values of the row."""
        self._check_row(i)
        out = {}
        for c in self.schema.columns:
            out[c.path] = self.per_residue(i, c.path) if c.ragged else _value(c, self._data(c.path)[i])
        return out

    def _check_row(self, i: int) -> None:
        if not 0 <= i < self.n:
            raise UserError(f"row {i} is out of range: {self.path} has {self.n:,} rows")

    def per_residue(self, i: int, path: str) -> np.ndarray:
        """The values of ragged column `path` for row `i` (e.g. [residues, dim] hidden states)."""
        column = self._column(path)
        if not column.ragged:
            raise UserError(f"{path} holds one value per row, not per residue")
        self._check_row(i)
        a, b = (int(x) for x in self._data(f"{column.group}/offsets")[i:i + 2])
        return self._data(path)[a:b]

    def chunks(self, size: int = 65536, columns: Iterable[str] | None = None) -> Iterator[dict]:
        """Rows `size` at a time, as {column: array} (ids as str; a ragged column as a list of arrays, one
        per row), in row order (FASTA order)."""
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
            raise UserError(f"chunks() takes a number of rows of at least 1 as its size, not {size!r}")
        if isinstance(columns, str):   # (iterated, "ids" would be the columns 'i', 'd', 's')
            raise UserError(f"chunks() takes a list of columns, not one column as text ({columns!r}): "
                            f"chunks({size}, [{columns!r}])")
        chosen = [self._column(p) for p in (columns or self.columns)]
        for a in range(0, self.n, size):
            b = min(self.n, a + size)
            yield {c.path: self._slice(c, a, b) for c in chosen}

    def _slice(self, c: Column, a: int, b: int):
        if not c.ragged:
            data = self.file[c.path][a:b]
            return np.array([_text(x) for x in data], dtype=object) if c.dtype == STR else data
        offsets = self._data(f"{c.group}/offsets")[a:b + 1]
        values = self.file[c.path][int(offsets[0]):int(offsets[-1])]
        cuts = (offsets - offsets[0]).astype(np.int64)
        return [values[cuts[k]:cuts[k + 1]] for k in range(b - a)]

    def _column(self, path: str) -> Column:
        for c in self.schema.columns:
            if c.path == path:
                return c
        raise UserError(f"{self.path} has no column {path!r}; its columns: {', '.join(self.columns)}")


def open_result(path: str | os.PathLike) -> ResultFile:
    """Open a result.h5, or the result of a finished run directory."""
    return ResultFile(path)


def _damage_advice(path: Path) -> str:
    """What to do about a damaged result: its run's `status --verify` (which names what writes it again), or for a
    result outside a run directory, where it came from."""
    if path.name == "result.h5" and RunDir(path.parent).manifest_path.exists():
        return f"`{command('status', path.parent, '--verify')}` checks every checksum and names what writes it again"
    return "Take it again from where it came from (a merge in its run directory writes it anew)"


def _id_list(ids: Iterable[str], method: str) -> list[str]:
    """The ids given to `method` (rows, records) as a list of text; one id given as text is refused: iterated,
    "P12345" would be the ids 'P', '1', ... (wrong rows)."""
    if isinstance(ids, (str, bytes)):
        raise UserError(f"{method}() takes a list of ids, not one id as text ({ids!r}): {method}([{ids!r}]), or "
                        f"get({ids!r}) for its values")
    return [_text(i) for i in ids]   # (ids read with h5py without .asstr() are bytes: b'P12345' is 'P12345')


def _text(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _value(c: Column, value):
    return _text(value) if c.dtype == STR else value
