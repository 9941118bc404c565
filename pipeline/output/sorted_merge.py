"""Merge sorted runs of rows (part files into a shard, shards into the result) with bounded memory.

Every run is sorted by FASTA position (`index`), so a merge is one pass: for each window of positions,
take from every run its next contiguous rows below the window's end, sort that small block, check it
against the positions expected there, and append it to the output. Memory is bounded by the window
(`budget_bytes`) and each run's read-ahead of its `index` column, whatever the size of the inputs: no
array of the whole run is held (the windows of a result come from a stream, problems are counted and
spilled to disk). The same routine validates the final result: row count, duplicates, missing and extra
rows, ids that do not match the FASTA, and every input's checksums.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

from ..errors import MergeError
from .h5io import CorruptFile, Reader, Writer
from .merge_problems import MergeProblems, describe_problems
from .schema import RowBlock

log = logging.getLogger(__name__)

# Rows per window, by their size in the files. A window takes about three times this in memory while it is
# read, ordered and written (ids are Python objects there, blocks are copied once to put them in order).
DEFAULT_BUDGET_BYTES = 64 << 20


@dataclass
class Window:
    """One step of a merge: the positions expected from the runs here (sorted) and where the window ends:
    the runs' rows below `end` belong to it (None: every row left, the last window). `start` is the first
    position the window covers (a result's windows tile 0..N)."""
    want: np.ndarray
    end: int | None
    start: int = 0


def windows(expected: np.ndarray, row_bytes: np.ndarray, budget_bytes: int) -> list[tuple[int, int]]:
    """Split expected positions (sorted) into [start, stop) index ranges of about budget_bytes each."""
    if len(expected) == 0:
        return []
    cum = np.cumsum(row_bytes, dtype=np.int64)
    cuts = np.searchsorted(cum, np.arange(budget_bytes, int(cum[-1]), budget_bytes, dtype=np.int64), "right")
    bounds = np.unique(np.concatenate(([0], cuts, [len(expected)])))
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def position_bounds(n: int, row_bytes: Callable[[int, int], np.ndarray], budget_bytes: int,
                    step: int = 1 << 20) -> np.ndarray:
    """Windows over positions 0 .. n - 1 of about `budget_bytes` each, as their starts followed by n, from
    `row_bytes(a, b)` (the sizes of rows a .. b - 1) read `step` rows at a time: the cuts `windows` makes."""
    cuts, total = [np.zeros(1, np.int64)], 0
    for a in range(0, n, step):
        b = min(n, a + step)
        cum = total + np.cumsum(row_bytes(a, b), dtype=np.int64)
        first = (total // budget_bytes + 1) * budget_bytes
        targets = np.arange(first, int(cum[-1]) + (b < n), budget_bytes, dtype=np.int64)   # (below the total)
        cuts.append(a + np.searchsorted(cum, targets, "right"))
        total = int(cum[-1])
    bounds = np.unique(np.concatenate(cuts + [np.array([n], np.int64)]))
    return bounds[(bounds > 0) | (np.arange(len(bounds)) == 0)]


def windows_of(expected: np.ndarray, row_bytes: np.ndarray, budget_bytes: int = DEFAULT_BUDGET_BYTES
               ) -> list[Window]:
    """The windows of a merge whose expected positions fit in memory (a shard's)."""
    spans = windows(expected, row_bytes, budget_bytes) or [(0, 0)]
    last = len(spans) - 1
    return [Window(expected[a:b], None if k == last else int(expected[b]), int(expected[a]) if b > a else 0)
            for k, (a, b) in enumerate(spans)]


class _Cursor:
    """One sorted run read a window at a time; its `index` column is read ahead a piece at a time (doubling
    while a window needs more), never whole."""

    FIRST = 256

    def __init__(self, reader: Reader):
        self.reader, self.n = reader, reader.rows
        self.row = 0                           # the next row to hand out
        self.ahead = np.zeros(0, np.int64)     # `index` of rows row .. row + len(ahead) - 1
        self.step = self.FIRST
        self.last = np.iinfo(np.int64).min     # the position of the last row handed out

    def end_below(self, limit: int | None) -> int:
        """The first row at or above position `limit` (all rows for None)."""
        if limit is None:
            return self.n
        while True:
            k = int(np.searchsorted(self.ahead, limit, "left"))
            if k < len(self.ahead) or self.row + len(self.ahead) >= self.n:
                return self.row + k
            a = self.row + len(self.ahead)
            more = self.reader.index_slice(a, min(self.n, a + self.step))
            self.ahead = np.concatenate((self.ahead, more))
            self.step = min(self.step * 2, 1 << 20)

    def take(self, end: int) -> RowBlock | None:
        """Rows row .. end - 1 (checksummed in order), checked to be sorted by position."""
        if end <= self.row:
            return None
        block = self.reader.read(self.row, end)
        idx = block.columns["index"]
        if idx[0] < self.last or (len(idx) > 1 and np.any(idx[1:] < idx[:-1])):
            raise CorruptFile(f"{self.reader.path}: rows are not sorted by position", [self.reader.path])
        self.last = int(idx[-1])
        self.ahead = self.ahead[end - self.row:]
        self.row = end
        return block


def merge_sorted_runs(readers: Sequence[Reader], writer: Writer, expected: Iterable[Window] | np.ndarray,
                      row_bytes: np.ndarray | None = None, budget_bytes: int = DEFAULT_BUDGET_BYTES,
                      expected_ids: Callable[[np.ndarray], np.ndarray] | None = None,
                      on_rows: Callable[[int], None] | None = None, problems: MergeProblems | None = None,
                      complete: Callable[[RowBlock, Window, MergeProblems], RowBlock] | None = None,
                      schema=None) -> MergeProblems:
    """Write the rows of `readers` at the expected positions to `writer`, in order. `expected` is a stream of
    windows, or an array of sorted unique positions (with `row_bytes`, split into windows of `budget_bytes`).

    Rows at unexpected positions, repeated positions and expected positions without a row are collected
    as problems (never written twice, never invented). With `expected_ids(positions) -> ids`, every row's
    id is checked too. `complete(rows, window, problems)` may add rows to a window before it is written (the
    result's copies). `schema`: the runs' (default: the writer's). Each reader's checksums are verified
    once it has been read to the end.
    """
    if isinstance(expected, np.ndarray):
        expected = windows_of(expected, row_bytes, budget_bytes)
    schema = schema or writer.schema
    cursors = [_Cursor(r) for r in readers]
    problems = problems if problems is not None else MergeProblems()
    for window in expected:
        block = RowBlock.concat(schema, [p for p in (c.take(c.end_below(window.end)) for c in cursors) if p is not None])
        block = block.sorted_by_index()   # (the parts are freed once joined: a window is held at most twice)
        keep = _check_window(block, window.want, problems)
        if expected_ids is not None and keep.any():
            found = block.columns["ids"][keep]
            positions = block.columns["index"][keep]
            bad = np.flatnonzero(found != expected_ids(positions))
            for i in bad:
                problems.add_mismatched(int(positions[i]), found[i])
        out = block if keep.all() else block.take(np.flatnonzero(keep))
        if complete is not None:
            out = complete(out, window, problems)
        writer.append(out)
        if on_rows:
            on_rows(len(out))
    damaged = []
    for c in cursors:   # every damaged input is named at once, not only the first
        try:
            rest = c.take(c.n)   # (rows past a stream's last window: there are none when it ends with end=None)
            for i in range(len(rest) if rest is not None else 0):
                problems.add_extra(int(rest.columns["index"][i]), rest.columns["ids"][i])
            c.reader.verify_checksums()
        except CorruptFile as e:
            damaged.append(e)
    if damaged:
        raise CorruptFile("; ".join(map(str, damaged)), [p for e in damaged for p in e.paths])
    return problems


def _check_window(block: RowBlock, want: np.ndarray, problems: MergeProblems) -> np.ndarray:
    """Which rows of a sorted window to keep; records duplicates, extras and missing positions."""
    idx = block.columns["index"]
    first = np.ones(len(idx), bool)
    first[1:] = idx[1:] != idx[:-1]
    if not first.all():
        problems.add_duplicates(np.unique(idx[~first]))
    pos = np.searchsorted(want, idx)
    expected_here = (pos < len(want)) & (want[np.minimum(pos, max(len(want) - 1, 0))] == idx) if len(want) \
        else np.zeros(len(idx), bool)
    for i in np.flatnonzero(~expected_here & first):
        problems.add_extra(int(idx[i]), block.columns["ids"][i])
    keep = first & expected_here
    if keep.sum() != len(want):
        problems.add_missing(np.setdiff1d(want, idx[keep]))
    return keep


__all__ = ["MergeError", "MergeProblems", "Window", "describe_problems", "merge_sorted_runs", "position_bounds",
           "windows", "windows_of"]
