"""`run_shards get OUT ID...`: the rows of some ids, printed or written as TSV, JSON or numpy arrays.

- tsv: a header line of column names, then one line per id; a vector as comma-separated values, a
  per-residue column as its residue vectors separated by ';'; in text (generate/text, which a BPE model's
  line-break tokens put newlines in) a tab, newline, carriage return and backslash as `\\t`, `\\n`, `\\r`
  and `\\\\`, so that every row stays one line of cells. An id is written as it is: it holds no tab nor line
  break (it ends at the header's first whitespace or control byte), so `cut -f1` gives the ids back exactly,
  a backslash in one included, to join on or to pass to `--ids-from`.
- json: one JSON object per line and id (JSON Lines), every column of its row, arrays as lists, NaN as null,
  an infinity as "inf" or "-inf" (standard JSON has neither).
- npy: a numpy .npz archive (np.load reads it): one array per column, rows in the order of the ids; a
  per-residue column as its values back to back plus `COLUMN.offsets` (row k is values[offsets[k]:offsets[k+1]]).
"""
from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Iterable, Iterator, TextIO

import numpy as np

from ..advice import command
from ..errors import UserError
from ..rundir.layout import atomic_path
from . import run_inputs
from .result_reader import MAX_NAMED, MissingIds, ResultFile, result_path
from .run_inputs import check_output_file
from .schema import Column

FORMATS = ("tsv", "json", "npy")
_LINES = re.compile(r"\r\n|\r|\n")
_SPACE = "".join(map(chr, range(0x21)))   # whitespace and control bytes, which end a FASTA id
_ID = re.compile(r"[^\x00-\x20]+")


def _stdin_bytes(stream: TextIO) -> bytes | str:
    """What standard input holds, as bytes where the stream has them (a text stream given in its place: its text)."""
    buffer = getattr(stream, "buffer", None)
    return buffer.read() if buffer is not None else stream.read()


class HeaderLine(str):
    """An id of an --ids-from line that starts with '>': the id of a FASTA header line (one '>' dropped, as the
    FASTA's reading drops it), unless the result holds the line's first word as written, an id that itself
    starts with '>' (`cut -f1` of get's TSV gives such an id back as it is): `settle` decides."""
    written: str   # the line's first word as written, '>' included
    where: str     # "ids.txt, line 3"


def read_ids(given: Iterable[str], ids_from: str | None, stdin: TextIO | None = None) -> list[str]:
    """The ids of the command line, then those of `ids_from` (a file, or '-' for standard input), one per
    line (blank lines ignored; a line starting with '>' is a HeaderLine: a FASTA header's id, or an id that
    starts with '>')."""
    ids, idless = list(given), []   # (idless: --ids-from lines that are a '>' and nothing else)
    if ids_from:
        source = "standard input" if ids_from == "-" else ids_from
        try:   # (the bytes decoded here, a file's or standard input's, not in the locale's encoding; a BOM, as
            # Windows editors write, dropped)
            data = _stdin_bytes(stdin or sys.stdin) if ids_from == "-" else Path(ids_from).read_bytes()
            text = data if isinstance(data, str) else data.decode("utf-8-sig", "surrogateescape")
        except OSError as e:
            raise UserError(f"--ids-from {ids_from}: {e.strerror or e}") from None
        except UnicodeDecodeError as e:
            raise UserError(f"--ids-from {source}: not UTF-8 text ({e.reason} at byte {e.start}); ids are UTF-8, "
                            "as in the FASTA: save the file as UTF-8") from None
        # lines and ids split as the FASTA's are: at LF, CRLF or CR, and an id at the first byte up to 0x20
        # (str.splitlines and str.split would also split at Unicode's spaces and separators, U+00A0, U+0085,
        # U+3000 ..., which belong to an id in the FASTA)
        for number, line in enumerate(_LINES.split(text), 1):
            line = line.lstrip(_SPACE)
            word = _ID.search(line.removeprefix(">"))   # (one '>' is a header's mark: '>>x' is '>x')
            if not word:
                if line.startswith(">"):
                    idless.append(number)
                continue
            try:
                word[0].encode("utf-8")
            except UnicodeEncodeError:   # (undecodable bytes, kept as surrogates by the decoding above)
                raise UserError(f"--ids-from {source}, line {number}: the id is not UTF-8 text "
                                f"(its bytes: {word[0].encode('utf-8', 'surrogateescape')!r}); ids are UTF-8, as "
                                "in the FASTA: save the file as UTF-8") from None
            if line.startswith(">"):
                header = HeaderLine(word[0])
                header.written, header.where = _ID.search(line)[0], f"{source}, line {number}"
                ids.append(header)
            else:
                ids.append(word[0])
    if not ids:
        header = (f" ({source} has header lines without an id, a '>' and nothing after it: line(s) "
                  f"{', '.join(map(str, idless[:5]))})") if idless else ""
        raise UserError(f"no ids given{header}: pass them after OUT, or one per line with --ids-from FILE (- for "
                        "stdin)")
    return ids


def get(out: str | os.PathLike, ids: list[str], fmt: str = "tsv", target: str | os.PathLike | None = None) -> str:
    """The rows of `ids` as text (tsv, json) to print, or, with `target` (required for npy), written
    there; then the return value says where."""
    if fmt == "npy" and not target:
        raise UserError("--format npy writes a file: give it with -o, e.g. -o rows.npz (from Python: output=)")
    if target:
        check_output_file("-o", target, run_inputs.of_result(result_path(out)))
    with ResultFile(out) as res:
        ids = settle(res, ids)
        try:
            records = res.records(ids)
        except MissingIds as e:
            _refuse_missing(res, e)
        columns = res.schema.columns
    # -o: written under a temporary name and renamed into place, so that a failure (or Ctrl-C) leaves no
    # half-written file where the result was asked for, and an earlier file there as it was
    if fmt == "npy":
        with atomic_path(target) as tmp:
            _write_npz(tmp, columns, records)
        return f"wrote {len(records)} row(s) to {target}"
    lines = _tsv(columns, records) if fmt == "tsv" else _json_lines(records)
    if not target:
        return "".join(lines).rstrip("\n")
    with atomic_path(target) as tmp, open(tmp, "w", encoding="utf-8") as fh:
        fh.writelines(lines)
    return f"wrote {len(records)} row(s) to {target}"


def settle(res: ResultFile, ids: list[str]) -> list[str]:
    """`ids` with each HeaderLine read as the id the result holds: the header's id, or the line's word as
    written where only that is in the result ('>P1' from `cut -f1`, the id of the FASTA header '>>P1'); where
    the result holds both, a UserError asks for the one meant."""
    lines = [i for i in ids if isinstance(i, HeaderLine)]
    if not lines:
        return ids
    asked = [i.written for i in lines] + [str(i) for i in lines]
    try:
        res.rows(asked)
        held = set(asked)
    except MissingIds as e:
        held = set(asked) - set(e.missing)
    settled = []
    for i in ids:
        if isinstance(i, HeaderLine) and i.written in held:
            if str(i) in held:
                raise UserError(f"--ids-from {i.where}: {i.written!r} may be the FASTA header of {str(i)!r} or the "
                                f"id {i.written!r}, and {res.path} holds both: name the one you mean after OUT, "
                                f"where ids are taken as written, e.g. `{command('get', res.path, i.written)}`")
            settled.append(i.written)
        else:
            settled.append(str(i))
    return settled


def _refuse_missing(res: ResultFile, error: MissingIds) -> None:
    """Ids the result lacks: those of a partial result's `missing_ids` said as such (their rows were not
    computed when it was merged) with the command that computes them; the others as not in the input."""
    wanted = set(error.missing)
    listed = res.file.get("missing_ids")
    absent = set()
    for a in range(0, 0 if listed is None else len(listed), 1 << 16):
        absent |= wanted & {i.decode() if isinstance(i, bytes) else str(i) for i in listed[a:a + (1 << 16)]}
    if not absent:
        raise error
    run = res.path.parent
    how = (f"`{command('rerun', run)}` computes them and merges, after which `get` finds them"
           if (run / "manifest.json").exists() else
           "rerun the run it was merged in (`run_shards rerun OUT`), which computes them and merges")
    shown = ", ".join(repr(i) for i in sorted(absent)[:MAX_NAMED]) + (f" (and {len(absent) - MAX_NAMED:,} more)"
                                                                     if len(absent) > MAX_NAMED else "")
    others = [i for i in error.missing if i not in absent]
    raise UserError(f"{len(absent):,} id(s) missing from {res.path}, a partial result (merged with --allow-partial "
                    f"before every shard finished; it lists them in `missing_ids`): {shown}. They are in the input, "
                    f"but their rows were not computed yet: {how}"
                    + (f". Besides, {MissingIds(res.path, others)}" if others else ""))


def _cell(value, text: bool = True) -> str:
    """One TSV cell; `text` False for an id, written as it is (see the module's docstring)."""
    if isinstance(value, np.ndarray):
        if value.ndim == 2:
            return ";".join(",".join(str(v) for v in row) for row in value)
        return ",".join(str(v) for v in value)
    if isinstance(value, str):
        return value.translate(TSV_ESCAPES) if text else value
    return str(value.item() if isinstance(value, np.generic) else value)


TSV_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})


def _tsv(columns: list[Column], records: list[dict]) -> Iterator[str]:
    yield "\t".join(c.path for c in columns) + "\n"
    for rec in records:
        yield "\t".join(_cell(rec[c.path], c.path != "ids") for c in columns) + "\n"


def _plain(value):
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value] if value.ndim > 1 else [_number(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        value = value.item()
    return _number(value)


def _number(value):
    """A float as standard JSON holds it: NaN as null, an infinity (a float16 value past its range) as the
    string "inf" or "-inf" (JSON has no number for it; Python's Infinity is not JSON)."""
    if not isinstance(value, float) or math.isfinite(value):
        return value
    return None if value != value else ("inf" if value > 0 else "-inf")


def _json_lines(records: list[dict]) -> Iterator[str]:
    return (json.dumps({k: _plain(v) for k, v in rec.items()}, allow_nan=False) + "\n" for rec in records)


def _write_npz(target, columns: list[Column], records: list[dict]) -> None:
    arrays = {}
    for c in columns:
        values = [rec[c.path] for rec in records]
        if c.ragged:
            lengths = [len(v) for v in values]
            arrays[f"{c.path}.offsets"] = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
            arrays[c.path] = np.concatenate(values) if values else np.zeros((0,), np.dtype(c.dtype))
        elif c.dtype == "str":
            arrays[c.path] = np.array(values, dtype=str)
        else:
            arrays[c.path] = np.array(values, dtype=np.dtype(c.dtype))
    with open(target, "wb") as fh:
        np.savez(fh, **arrays)
