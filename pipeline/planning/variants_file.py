"""The --variants file, read and checked while planning, before any model runs: CSV or TSV with a header
naming the columns `id` and `mutant` (others are ignored), one variant per line. Every problem is refused at
once (exit 2), naming the file and line: an empty file, a header naming id or mutant twice, a malformed
mutant, an id the FASTA does not have, a position outside the record, a wild-type letter that is not the
record's residue there. A line that repeats an earlier line's variant (the same id and substitutions, in any
order or case) is kept, with a warning naming both lines: the variant is scored once, and its scores are
written on each of its lines."""
from __future__ import annotations

import csv
import hashlib
import io
import logging
from pathlib import Path

import numpy as np

from index import SequenceIndex
from index.id_hash import id_hashes

from ..errors import UserError
from ..output.run_inputs import ReadFile, check_output_file
from ..output.variant_list import MalformedMutant, VariantList, parse_mutant

SHOWN = 10   # problems listed in one refusal or warning (the count says how many more)

log = logging.getLogger("run_shards")


def read_variants(path: str, index: SequenceIndex) -> VariantList:
    """The variants of `path` (file order) with their records' FASTA positions, or UserError listing every
    problem with its line."""
    data = _read_bytes(path)
    rows, problems = _rows(path, data)
    positions = _positions_of(index, sorted({vid for _, vid, _ in rows}))
    records = [positions.get(vid, -1) for _, vid, _ in rows]
    problems += [f"line {line}: id '{vid}' is not in the FASTA input"
                 for (line, vid, _), r in zip(rows, records) if r < 0]
    problems += _check_against_records(index, rows, records)
    if problems:
        problems.sort(key=lambda p: int(p.split(":")[0].split()[1]))
        more = f" (and {len(problems) - SHOWN} more)" if len(problems) > SHOWN else ""
        raise UserError(f"--variants {path}: {len(problems)} problem(s){more}, nothing was computed:\n  "
                        + "\n  ".join(f"{path}, {p}" for p in problems[:SHOWN]))
    _warn_repeated(path, rows)
    return VariantList(np.array(records, np.int64), [m for _, _, m in rows], source=str(Path(path).resolve()),
                       sha256=hashlib.sha256(data).hexdigest())


def _warn_repeated(path: str, rows: list[tuple[int, str, str]]) -> None:
    """Warn of lines whose variant an earlier line has (the same id and substitutions), naming both lines.
    Such a variant is computed once (a record's passes are shared by its variants: tasks/variants.py)."""
    first: dict[tuple, tuple[int, str]] = {}
    repeats = []
    for line, vid, mutant in rows:
        earlier = first.setdefault((vid, parse_mutant(mutant)), (line, mutant))
        if earlier[0] != line:
            same = "" if earlier[1] == mutant else f" (written {earlier[1]} there)"
            repeats.append(f"line {line} ({vid} {mutant}) repeats line {earlier[0]}{same}")
    if repeats:
        more = f" (and {len(repeats) - SHOWN} more)" if len(repeats) > SHOWN else ""
        log.warning("--variants %s: %d line(s) repeat the variant of an earlier line%s; each such variant is "
                    "scored once and its scores are written on each of its lines (the table keeps one row per "
                    "line):\n  %s", path, len(repeats), more, "\n  ".join(f"{path}, {r}" for r in repeats[:SHOWN]))


def _read_bytes(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except IsADirectoryError:
        raise UserError(f"--variants {path}: is a directory; pass a CSV or TSV file") from None
    except OSError as e:
        raise UserError(f"--variants {path}: cannot read it ({e.strerror})") from None


def _rows(path: str, data: bytes) -> tuple[list[tuple[int, str, str]], list[str]]:
    """[(line, id, mutant text)] of the file's variants (mutants already parsed once), and its problems."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise UserError(f"--variants {path}: not UTF-8 text (byte {e.start}); save it as a UTF-8 CSV or TSV") from None
    # Lines as an editor numbers them: ended by \n, \r\n or \r only (not str.splitlines' form feeds and
    # Unicode separators), and counted by the csv reader itself, so that a quoted field across lines (a note
    # column) does not shift the numbers of the lines after it.
    first_line = next((line for line in io.StringIO(text, newline="") if line.strip()), "")
    delimiter = "\t" if "\t" in first_line else ","
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter)
    header = next((fields for fields in reader if any(f.strip() for f in fields)), None)
    if header is None:
        raise UserError(f"--variants {path}: the file is empty; it needs a header line naming the columns id and "
                        "mutant, then one variant per line (e.g. 'P12345,A23V')")
    header_line = reader.line_num
    header = [h.strip() for h in header]
    named: dict[str, list[int]] = {}
    for i, h in enumerate(header):
        named.setdefault(h.lower(), []).append(i)
    missing = [c for c in ("id", "mutant") if c not in named]
    if missing:
        raise UserError(f"--variants {path}, line {header_line}: the header has no {' or '.join(missing)} column "
                        f"(it has: {', '.join(header)}); name the columns id and mutant")
    twice = [c for c in ("id", "mutant") if len(named[c]) > 1]
    if twice:
        raise UserError(f"--variants {path}, line {header_line}: the header names the {' and the '.join(twice)} "
                        f"column more than once (it has: {', '.join(header)}); rename all but one")
    col_id, col_mut = named["id"][0], named["mutant"][0]
    rows, problems = [], []
    for fields in reader:
        n = reader.line_num   # (a record's last line)
        if not any(f.strip() for f in fields):
            continue
        if len(fields) <= max(col_id, col_mut):
            problems.append(f"line {n}: {len(fields)} field(s), fewer than the header's id and mutant columns")
            continue
        vid, mutant = fields[col_id].strip(), fields[col_mut].strip()
        try:
            parse_mutant(mutant)
        except MalformedMutant as e:
            problems.append(f"line {n}: malformed mutant: {e}")
            continue
        rows.append((n, vid, mutant))
    if not rows and not problems:
        raise UserError(f"--variants {path}: no variants (only a header); add one line per variant, e.g. "
                        f"'P12345{delimiter}A23V'")
    return rows, problems


def _positions_of(index: SequenceIndex, ids: list[str]) -> dict[str, int]:
    """FASTA position of each id of `ids` that the index holds (a hash of every index id, then an exact check)."""
    if not ids:
        return {}
    encoded = [i.encode() for i in ids]
    offsets = np.zeros(len(encoded) + 1, np.int64)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    wanted = id_hashes(np.frombuffer(b"".join(encoded), np.uint8), offsets)
    have = id_hashes(index.id_blob, index.id_offsets)
    order = np.argsort(have, kind="stable")
    found = {}
    for vid, h in zip(ids, wanted):
        k = int(np.searchsorted(have, h, sorter=order))
        while k < len(order) and have[order[k]] == h:
            if index.id(int(order[k])) == vid:
                found[vid] = int(order[k])
                break
            k += 1
    return found


def _check_against_records(index: SequenceIndex, rows: list, records: list[int]) -> list[str]:
    """Each substitution's position lies in its record and names the record's residue there."""
    problems, sequences = [], {}
    for (line, vid, mutant), record in zip(rows, records):
        if record < 0:
            continue
        if record not in sequences:
            sequences[record] = index.sequence(record)
        seq = sequences[record]
        for s in parse_mutant(mutant):
            where = f"{s.wild_type}{s.position}{s.mutant}"
            if s.position > len(seq):
                problems.append(f"line {line}: {where}: position {s.position} is outside '{vid}', which has "
                                f"{len(seq)} residue(s)")
            elif seq[s.position - 1] != s.wild_type:
                problems.append(f"line {line}: {where}: wild type {s.wild_type} does not match '{vid}', whose "
                                f"residue {s.position} is {seq[s.position - 1]}")
    return problems


def check_variants_out(path: str, reads: list[ReadFile]) -> None:
    """--variants-out must be a file name in an existing, writable directory, and none of the files the run
    `reads` (its FASTA, its variants file, its model's files, the run directory's own: checked before any
    compute)."""
    check_output_file("--variants-out", path, reads)
