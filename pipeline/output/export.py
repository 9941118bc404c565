"""`run_shards export`: a result in the formats downstream tools read, streamed with bounded memory.

- parquet: one Arrow column per dataset (ids as strings, a vector column as a fixed-size list, a
  per-residue column as a list per row), row groups of about ROW_GROUP_BYTES; the result's attributes in
  the file's metadata under `run_shards`. Needs pyarrow (`pip install pyarrow`: the `parquet` extra).
- per-id-h5: one dataset per id, named by the id, holding that row's values of one column, as UniProt's
  per-protein.h5 (and per-residue.h5 for a per-residue column) and the tools that read them expect (a
  one-value column, a score or a text, as a scalar dataset; text as UTF-8 strings). Rows
  without values (status skipped, empty, out of memory) are left out; a '/' in an id, which HDF5 reads as
  a group separator, is written as '%2F' (and '%' as '%25', and an id '.', HDF5's root group, as '%2E'), said
  in the file's `name_escaping` attribute.
Both write under a temporary name and rename it into place.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import h5py
import numpy as np

from ..advice import command
from ..errors import UserError
from ..rundir.layout import atomic_path
from . import run_inputs, status_codes
from .result_reader import ResultFile, result_path
from .schema import BASE_COLUMNS, RESULT_COLUMNS, STR, Column

ROW_GROUP_BYTES = 64 << 20
FORMATS = {"parquet": "result.parquet", "per-id-h5": "result.per-id.h5"}


def export(source: str | os.PathLike, fmt: str, target: str | os.PathLike | None = None,
           column: str | None = None, widen_float16: bool = False) -> Path:
    """Write the result of `source` (a run directory or result.h5) as `fmt`; returns the file written.
    `widen_float16` (parquet): float16 columns written as float32, which every Parquet reader opens (pyarrow
    before 15 cannot open a file that holds Parquet's FLOAT16 type at all); the values are the same."""
    if widen_float16 and fmt != "parquet":
        raise UserError("--widen-float16 applies only to --format parquet (per-id-h5 keeps each column's type): "
                        "drop it, or use --format parquet")
    if column is not None and fmt != "per-id-h5":   # (it was ignored: every column was written)
        raise UserError("--column applies only to --format per-id-h5 (parquet writes every column, and readers "
                        "take the columns they need): drop it, or use --format per-id-h5")
    path = result_path(source)
    option = "-o" if target else "the default output (-o FILE writes elsewhere)"
    target = Path(target) if target else path.parent / FORMATS[fmt]
    run_inputs.check_output_file(option, target, run_inputs.of_result(path))
    with atomic_path(target) as tmp, ResultFile(path) as res:
        if fmt == "parquet":
            _parquet(res, tmp, widen_float16)
        else:
            _per_id(res, tmp, _per_id_column(res, column))
    return target


def _row_ranges(res: ResultFile):
    """Consecutive row ranges [a, b) of at most ROW_GROUP_BYTES each (one row alone where it is larger),
    each row counted with its own ragged values, read from its group's offsets: a mean over the file let a
    stretch of long records (a FASTA sorted by length, a few titins among short peptides) fill one range
    with tens of times the bytes, tens of GB of per-residue values in memory at once."""
    fixed = sum(c.value_bytes() for c in res.schema.row_columns)
    per_value: dict[str, int] = {}
    for c in res.schema.ragged_columns:
        per_value[c.group] = per_value.get(c.group, 0) + c.value_bytes()
    # a range holds at most this many rows (each takes `fixed` bytes at least), so the offsets read for one
    # range are a bounded fraction of the values it reads
    most = max(1, ROW_GROUP_BYTES // max(1, fixed))
    a = 0
    while a < res.n:
        end = min(res.n, a + most)
        sizes = np.full(end - a, fixed, np.int64)
        for group, size in per_value.items():
            sizes += np.diff(res.file[f"{group}/offsets"][a:end + 1].astype(np.int64)) * size
        b = a + max(1, int(np.searchsorted(np.cumsum(sizes), ROW_GROUP_BYTES, side="right")))
        yield a, b
        a = b


# ------------------------------------------------------------------------------------------- parquet
def _parquet(res: ResultFile, tmp: Path, widen_float16: bool = False) -> None:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError("--format parquet needs pyarrow: `pip install pyarrow` (or install run_shards with its "
                        "`parquet` extra)") from None
    wide = {c.path: np.float32 for c in res.schema.columns if widen_float16 and c.dtype == "float16"}
    fields = [pa.field(c.path, _arrow_type(pa, c, wide.get(c.path))) for c in res.schema.columns]
    schema = pa.schema(fields, metadata={"run_shards": json.dumps(res.attrs, default=str)})
    with pq.ParquetWriter(tmp, schema) as writer:
        for a, b in _row_ranges(res) if res.n else [(0, 0)]:   # (an empty result: one empty table)
            arrays = [_arrow_column(pa, res, c, a, b, wide.get(c.path)) for c in res.schema.columns]
            writer.write_table(pa.Table.from_arrays(arrays, schema=schema), row_group_size=max(1, b - a))


def _arrow_type(pa, c: Column, as_dtype=None):
    base = pa.string() if c.dtype == STR else pa.from_numpy_dtype(np.dtype(as_dtype or c.dtype))
    value = pa.list_(base, c.width) if c.width else base
    return pa.large_list(value) if c.ragged else value


def _arrow_column(pa, res: ResultFile, c: Column, a: int, b: int, as_dtype=None):
    if not c.ragged:
        data = res.file[c.path][a:b]
        if c.dtype == STR:
            return pa.array([x.decode("utf-8") if isinstance(x, bytes) else x for x in data], pa.string())
        return _values(pa, c, data, as_dtype)
    offsets = res.file[f"{c.group}/offsets"][a:b + 1].astype(np.int64)
    values = res.file[c.path][int(offsets[0]):int(offsets[-1])]
    return pa.LargeListArray.from_arrays(pa.array(offsets - offsets[0], pa.int64()), _values(pa, c, values, as_dtype))


def _values(pa, c: Column, data: np.ndarray, as_dtype=None):
    if as_dtype is not None:
        data = data.astype(as_dtype)
    if not c.width:
        return pa.array(data)
    return pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(data).reshape(-1)), c.width)


# ------------------------------------------------------------------------------------------- per id
def _per_id_column(res: ResultFile, column: str | None) -> Column:
    base = {c.path for c in BASE_COLUMNS + RESULT_COLUMNS}   # the row's bookkeeping, not the model's output
    if column is not None:
        chosen = res._column(column)
        if chosen.path in base:
            raise UserError(f"--column {column}: a per-id file holds a model output column, not {column}")
        return chosen
    vectors = [c for c in res.schema.columns if c.path not in base and c.width and not c.ragged]
    if len(vectors) == 1:
        return vectors[0]
    outputs = [c.path for c in res.schema.columns if c.path not in base]
    raise UserError(f"{res.path} has {len(outputs)} output columns ({', '.join(outputs)}); choose the one "
                    f"to write with --column, e.g. "
                    f"`{command('export', res.path.parent, '--format', 'per-id-h5', '--column', outputs[0])}`"
                    if outputs else f"{res.path} has no output column to export")


def _per_id(res: ResultFile, tmp: Path, column: Column) -> None:
    escaped = 0
    # a text column (generate/text) as UTF-8 strings, which numpy's dtype of it ('str') has no HDF5 type for
    text = column.dtype == STR
    datatype = h5py.h5t.py_create(h5py.string_dtype("utf-8") if text else np.dtype(column.dtype), logical=True)
    spaces: dict[tuple, h5py.h5s.SpaceID] = {}
    # names marked UTF-8, as h5py's own create_dataset marks them (the low-level default is ASCII, which an id
    # such as 'protéine_α' is not: tools that go by the mark, h5dump's and other languages' readers, misread it)
    names = h5py.h5p.create(h5py.h5p.LINK_CREATE)
    names.set_char_encoding(h5py.h5t.CSET_UTF8)
    with h5py.File(tmp, "w", libver="latest") as out:
        out.attrs["source"] = str(res.path)
        out.attrs["column"] = column.path
        out.attrs["run_shards"] = json.dumps(res.attrs, default=str)
        chosen = [res._column(p) for p in ("ids", "status", column.path)]
        for a, b in _row_ranges(res):
            chunk = {c.path: res._slice(c, a, b) for c in chosen}
            for seq_id, status, value in zip(chunk["ids"], chunk["status"], chunk[column.path]):
                if int(status) not in status_codes.HAS_VALUES:
                    continue
                name = per_id_name(seq_id)
                escaped += name != seq_id
                # (np.array, not ascontiguousarray, which makes a scalar an array of shape (1,))
                value = np.array(value, dtype=object if text else np.dtype(column.dtype))
                space = spaces.get(value.shape) or spaces.setdefault(value.shape, h5py.h5s.create_simple(value.shape))
                # (h5py's low-level calls: half the time of create_dataset per id, which is all this costs)
                dataset = h5py.h5d.create(out.id, name.encode("utf-8"), datatype, space, lcpl=names)
                dataset.write(h5py.h5s.ALL, h5py.h5s.ALL, value)
                dataset.close()
        out.attrs["name_escaping"] = (f"{escaped} id(s) hold '/' or '%', or are '.': written with '/' as '%2F', '%' "
                                      "as '%25', and the id '.' as '%2E'") if escaped else \
            "none: every dataset is named by its id as it is"


def per_id_name(seq_id: str) -> str:
    """The dataset name of `seq_id`: '/' separates HDF5 groups and '.' alone names the file's root group, so
    those are written as URLs escape them (and '%' too, to keep the names reversible)."""
    name = seq_id.replace("%", "%25").replace("/", "%2F")
    return "%2E" if name == "." else name
