"""The `variants` table of a --task variants result, made by the merge: the workers' per-record scores (the
ragged `variant_scores/*` columns, each record's variants in file order) put back in the variants file's
order, with the same strictness as the rows: every variant of a computed record exactly once, where the
file has it. Its CSV copy (--variants-out) is written from the finished result.

    variants/row      int64   the variant's place among the file's variants (0-based; row i is variant i in a
                              complete result)
    variants/id, variants/mutant   str
    variants/<score>  float64 one per score (masked_marginal and wt_marginal, or llr); NaN where not computed
    variants/status   int8    its record's status (0 ok, 2 unknown residues, 1 skipped too long, 4 out of memory)
"""
from __future__ import annotations

import csv
import json
import zlib
from pathlib import Path

import h5py
import numpy as np

from ..advice import command
from ..errors import MergeError, UserError
from ..rundir.layout import atomic_path
from .variant_list import VariantList

TABLE = "variants"
SCORES = "variant_scores"
COMPUTED = (0, 2)   # row statuses with values (output/status_codes.py)


def add_to_result(file: h5py.File, run, manifest: dict) -> None:
    """For a --task variants run: the table, into the merged result being written (`run` a rundir.RunDir)."""
    if manifest["attrs"].get("task") == "variants":
        write_table(file, run.variants_path, manifest["attrs"]["variant_scores"])


def export(run, manifest: dict) -> bool:
    """For a --task variants run with --variants-out: the CSV copy of the finished result's table (whether
    there was one to write)."""
    out = manifest["config"].get("variants_out")
    if manifest["attrs"].get("task") == "variants" and out:
        try:
            write_csv(run.result_path, Path(out))
        except OSError as e:
            raise UserError(f"--variants-out {out}: cannot write it ({e.strerror}); {run.result_path} holds the "
                            f"table: free the place and run `{command('merge', run.root)}` to write it again") from None
        return True
    return False


def write_table(file: h5py.File, variants_path: Path, score_names: list[str]) -> int:
    """Add the table to the merged result being written (`file`, its rows already in place); returns the
    number of variants in it. MergeError if the rows' variants are not the file's, each exactly once."""
    variants = VariantList.load(variants_path)
    positions, status = file["index"][:], file["status"][:]
    offsets, got = file[f"{SCORES}/offsets"][:], file[f"{SCORES}/row"][:]
    _check(variants, positions, status, offsets, got)
    present = np.isin(variants.record, positions)
    rows = np.flatnonzero(present)
    where = np.full(len(variants), -1, np.int64)      # each variant's value in the ragged columns
    where[got] = np.arange(len(got))
    table = {"row": rows.astype(np.int64),
             "status": status[np.searchsorted(positions, variants.record[rows])].astype(np.int8)}
    for name in score_names:
        values = file[f"{SCORES}/{name}"][:]
        table[name] = np.where(where[rows] >= 0, values[np.maximum(where[rows], 0)], np.nan)
    text = h5py.string_dtype("utf-8")
    result_rows = np.searchsorted(positions, variants.record[rows])
    needed, inverse = np.unique(result_rows, return_inverse=True)
    ids = np.array(file["ids"][needed] if len(needed) else [], dtype=object)[inverse] if len(rows) else \
        np.array([], dtype=object)
    mutants = np.array([variants.mutant[r].encode() for r in rows], dtype=object)
    group = file.create_group(TABLE)
    crc = {}
    for name, data in [("row", table["row"]), ("id", ids), ("mutant", mutants),
                       *((n, table[n]) for n in score_names), ("status", table["status"])]:
        group.create_dataset(name, data=data, dtype=text if data.dtype == object else data.dtype)
        crc[name] = zlib.crc32(b"\0".join(data) if data.dtype == object else data.tobytes())
    group.attrs["columns"] = json.dumps(["id", "mutant", *score_names, "status"])
    group.attrs["crc32"] = json.dumps(crc)
    group.attrs["source"] = variants.source
    return len(rows)


def _check(variants: VariantList, positions: np.ndarray, status: np.ndarray, offsets: np.ndarray,
           got: np.ndarray) -> None:
    """The rows' variants are exactly the file's: a computed record holds its variants, in file order; a record
    without values holds none."""
    expected_count = variants.counts(int(max(positions.max(initial=-1), variants.record.max(initial=-1))) + 1)
    lengths = np.diff(offsets)
    computed = np.isin(status, COMPUTED)
    want = np.where(computed, expected_count[positions], 0)
    wrong = np.flatnonzero(lengths != want)
    if len(wrong):
        i = int(wrong[0])
        raise MergeError(f"merge refused: {len(wrong)} record(s) hold another number of variants than the variants "
                         f"file gives them (first: the record at FASTA position {int(positions[i])}, {int(lengths[i])} "
                         f"instead of {int(want[i])}); the shards do not belong to this run's variants")
    order = np.argsort(variants.record, kind="stable")
    expected = order[np.isin(variants.record[order], positions[computed])]
    if not np.array_equal(got, expected):
        k = int(np.flatnonzero(got != expected)[0])
        raise MergeError(f"merge refused: the shards' variant rows differ from the variants file's from the "
                         f"{k + 1}th computed one on (variant {int(got[k])} where variant {int(expected[k])} "
                         "belongs); every variant must appear exactly once, in file order")


def write_csv(result: Path, out: Path) -> Path:
    """The result's variants table as a CSV file (header: id, mutant, the scores, status), written under a
    temporary name and renamed into place."""
    with h5py.File(result, "r") as f:
        group = f[TABLE]
        columns = json.loads(group.attrs["columns"])
        data = {c: group[c].asstr()[:] if c in ("id", "mutant") else group[c][:] for c in columns}
    out = Path(out)
    with atomic_path(out) as tmp, open(tmp, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(columns)
        for i in range(len(data["id"])):
            w.writerow([_cell(data[c][i]) for c in columns])
    return out


def _cell(value) -> str:
    """Scores with every digit float64 holds (repr), NaN as empty; ids and mutants as they are."""
    if isinstance(value, (float, np.floating)):
        return "" if np.isnan(value) else repr(float(value))
    return str(value)
