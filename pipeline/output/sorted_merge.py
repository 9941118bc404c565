"""Merge sorted runs of rows (part files into a shard, shards into the result) with bounded memory.

Every run is sorted by FASTA position (`index`), so a merge is one pass: for each window of positions,
take from every run its next contiguous rows below the window's end, sort that small block, check it
against the positions expected there, and append it to the output. Memory is bounded by the window
(`budget_bytes`), whatever the size of the inputs. The same routine validates the final result: row count,
duplicates, missing and extra rows, ids that do not match the FASTA, and every input's checksums.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..errors import MergeError
from .h5io import CorruptFile, Reader, Writer
from .schema import RowBlock

log = logging.getLogger(__name__)

DEFAULT_BUDGET_BYTES = 256 << 20


@dataclass
class MergeProblems:
    missing: list[np.ndarray] = field(default_factory=list)      # positions with no row
    duplicates: list[np.ndarray] = field(default_factory=list)   # positions with more than one row
    extras: list[tuple[int, bytes]] = field(default_factory=list)  # (position, id) of rows not expected
    mismatched: list[tuple[int, bytes]] = field(default_factory=list)  # (position, id in shard)

    def counts(self) -> dict[str, int]:
        return {"missing": int(sum(len(m) for m in self.missing)),
                "duplicate": int(sum(len(d) for d in self.duplicates)),
                "extra": len(self.extras), "mismatched": len(self.mismatched)}

    def __bool__(self) -> bool:
        return any(self.counts().values())

    def missing_positions(self) -> np.ndarray:
        return np.concatenate(self.missing) if self.missing else np.zeros(0, np.int64)


def windows(expected: np.ndarray, row_bytes: np.ndarray, budget_bytes: int) -> list[tuple[int, int]]:
    """Split expected positions (sorted) into [start, stop) index ranges of about budget_bytes each."""
    if len(expected) == 0:
        return []
    cum = np.cumsum(row_bytes, dtype=np.int64)
    cuts = np.searchsorted(cum, np.arange(budget_bytes, int(cum[-1]), budget_bytes, dtype=np.int64), "right")
    bounds = np.unique(np.concatenate(([0], cuts, [len(expected)])))
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def merge_sorted_runs(readers: Sequence[Reader], writer: Writer, expected: np.ndarray, row_bytes: np.ndarray,
                      budget_bytes: int = DEFAULT_BUDGET_BYTES,
                      expected_ids: Callable[[np.ndarray], np.ndarray] | None = None,
                      on_rows: Callable[[int], None] | None = None) -> MergeProblems:
    """Write the rows of `readers` at the `expected` positions (sorted, unique) to `writer`, in order.

    Rows at unexpected positions, repeated positions and expected positions without a row are collected
    as problems (never written twice, never invented). With `expected_ids(positions) -> ids`, every row's
    id is checked too. Each reader's checksums are verified once it has been read to the end.
    """
    schema = writer.schema
    index_cols, offsets = [], []
    for r in readers:
        idx = r.index_column()
        if len(idx) > 1 and np.any(idx[1:] < idx[:-1]):
            raise CorruptFile(f"{r.path}: rows are not sorted by position", [r.path])
        index_cols.append(idx)
        offsets.append({g: r.offsets(g) for g in r.schema.ragged_groups})
    cursors = [0] * len(readers)
    problems = MergeProblems()
    spans = windows(expected, row_bytes, budget_bytes) or [(0, 0)]
    for w, (a, b) in enumerate(spans):
        last = w == len(spans) - 1
        limit = np.iinfo(np.int64).max if last else int(expected[b])
        blocks = []
        for k, r in enumerate(readers):
            hi = len(index_cols[k]) if last else int(np.searchsorted(index_cols[k], limit, "left"))
            if hi > cursors[k]:
                blocks.append(r.read(cursors[k], hi, offsets[k]))
                cursors[k] = hi
        block = RowBlock.concat(schema, blocks).sorted_by_index()
        want = expected[a:b]
        idx = block.columns["index"]
        keep = _check_window(idx, want, block, problems)
        if expected_ids is not None and keep.any():
            found = block.columns["ids"][keep]
            ref = expected_ids(idx[keep])
            bad = np.flatnonzero(found != ref)
            problems.mismatched += [(int(idx[keep][i]), found[i]) for i in bad]
        out = block if keep.all() else block.take(np.flatnonzero(keep))
        writer.append(out)
        if on_rows:
            on_rows(len(out))
    damaged = []
    for r in readers:   # every damaged input is named at once, not only the first
        try:
            r.verify_checksums()
        except CorruptFile as e:
            damaged.append(e)
    if damaged:
        raise CorruptFile("; ".join(map(str, damaged)), [p for e in damaged for p in e.paths])
    return problems


def _check_window(idx: np.ndarray, want: np.ndarray, block: RowBlock, problems: MergeProblems) -> np.ndarray:
    """Which rows of a sorted window to keep; records duplicates, extras and missing positions."""
    first = np.ones(len(idx), bool)
    first[1:] = idx[1:] != idx[:-1]
    if not first.all():
        problems.duplicates.append(np.unique(idx[~first]))
    pos = np.searchsorted(want, idx)
    expected_here = (pos < len(want)) & (want[np.minimum(pos, max(len(want) - 1, 0))] == idx) if len(want) \
        else np.zeros(len(idx), bool)
    for i in np.flatnonzero(~expected_here & first):
        problems.extras.append((int(idx[i]), block.columns["ids"][i]))
    keep = first & expected_here
    if keep.sum() != len(want):
        problems.missing.append(np.setdiff1d(want, idx[keep]))
    return keep


def describe_problems(problems: MergeProblems, id_of: Callable[[int], str], report: Path | None,
                      sources: str = "the shards") -> str:
    """One clear message with counts and the first ids; the full lists go to `report`."""
    counts = problems.counts()
    lines = []
    missing = problems.missing_positions()
    dups = np.concatenate(problems.duplicates) if problems.duplicates else np.zeros(0, np.int64)
    if counts["missing"]:
        lines.append(f"{counts['missing']} sequences missing from {sources} (first: "
                     f"{', '.join(id_of(int(p)) for p in missing[:5])})")
    if counts["duplicate"]:
        lines.append(f"{counts['duplicate']} sequences present more than once (first: "
                     f"{', '.join(id_of(int(p)) for p in dups[:5])})")
    if counts["extra"]:
        lines.append(f"{counts['extra']} rows that belong to no FASTA record of this run (first: "
                     f"{', '.join(_s(i) for _, i in problems.extras[:5])})")
    if counts["mismatched"]:
        first = problems.mismatched[:5]
        lines.append(f"{counts['mismatched']} rows whose id differs from the FASTA record at their position "
                     f"(first: {', '.join(f'{_s(i)} at record {p} ({id_of(p)})' for p, i in first)})")
    if report is not None:
        with open(report, "w") as fh:
            for p in missing:
                fh.write(f"missing\t{int(p)}\t{id_of(int(p))}\n")
            for p in dups:
                fh.write(f"duplicate\t{int(p)}\t{id_of(int(p))}\n")
            for p, i in problems.extras:
                fh.write(f"extra\t{p}\t{_s(i)}\n")
            for p, i in problems.mismatched:
                fh.write(f"mismatched\t{p}\t{_s(i)}\t{id_of(p)}\n")
        lines.append(f"full list: {report}")
    return "; ".join(lines)


def _s(x) -> str:
    return x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x)


__all__ = ["MergeError", "MergeProblems", "describe_problems", "merge_sorted_runs", "windows"]
