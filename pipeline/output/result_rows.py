"""Where each row of the merged result comes from, window by window: the shards' rows, and the copies the
run's copy plan (copy_plan.py) asks for, each checked against the sequence planned at its position.

The result's windows tile the FASTA positions (about `budget` bytes of rows each). Before the pass, each
reused result is read once in row order and the rows it gives are parked for the windows they belong to
(row_spill.py); in the pass, each window takes its shards' rows and its parked rows, then copies every
first record of a sequence in it to the later records of that sequence (in the window, or parked for
theirs). So each copied row is read, parked and taken once, whatever the order of the FASTA, and memory
holds a window. Every row is then checked: the shards' rows by the merge (positions, ids, checksums),
the copies by position (each exactly once), and every row's sequence digest against the plan's.
"""
from __future__ import annotations

import os
from typing import Callable, Iterator

import numpy as np

from ..errors import MergeError
from .copy_plan import COMPUTED, CopyPlan, SourceFile
from .h5io import CorruptFile, Reader
from .merge_problems import MergeProblems
from .row_spill import RowSpill
from .schema import RowBlock, Schema
from .sorted_merge import DEFAULT_BUDGET_BYTES, Window, position_bounds

_PAIRS = 1 << 16   # copies made at once


class ResultRows:
    """The windows of a result merge and what completes each (see the module's docstring)."""

    def __init__(self, index, shard_schema: Schema, plan: CopyPlan | None, workdir: str,
                 ids_at: Callable[[np.ndarray], np.ndarray], budget: int = DEFAULT_BUDGET_BYTES):
        self.index, self.plan, self.ids_at = index, plan, ids_at
        self.shard_schema, self.schema = shard_schema, shard_schema.with_result_columns()
        self.n = len(index)
        self.bounds = position_bounds(self.n, self._row_bytes, budget)
        copies = plan is not None and plan.counts["computed"] < self.n
        self.spill = RowSpill(os.path.join(workdir, "rows"), self.schema, len(self.bounds)) if copies else None
        self.check_digests = plan is not None and "sequence_digest" in {c.path for c in shard_schema.columns}
        self._window = -1
        self._pair = 0          # the next duplicate pair to copy
        self.copied = 0

    def _row_bytes(self, a: int, b: int) -> np.ndarray:
        sizes = self.schema.row_bytes(np.asarray(self.index.lengths[a:b]))
        self.index.release()
        return sizes

    # ------------------------------------------------------------------ before the pass
    def gather_reused(self) -> None:
        """Read each reused result once and park the rows this run takes from it for their windows."""
        if self.plan is None:
            return
        for k, source in enumerate(self.plan.sources):
            rows, positions = self.plan.pairs(f"reused_{k}")
            if len(rows):
                self._gather(k, source, rows, positions)

    def _gather(self, k: int, source: SourceFile, rows: np.ndarray, positions: np.ndarray) -> None:
        try:   # (copy_plan.check_sources named a file gone or replaced before the merge began)
            with Reader(source.path, cache_bytes=0) as reader:
                if reader.attrs.get("crc32") != source.checksums or reader.rows != source.rows \
                        or reader.schema.without_result_columns() != self.shard_schema:
                    raise MergeError(f"cannot merge: {source.path} (--reuse {source.given}) is not the result this "
                                     "run was planned with (other rows or checksums); restore it, or start a new run")
                self._gather_from(reader, k, rows, positions)
                reader.verify_checksums()
        except CorruptFile as e:
            raise MergeError(f"cannot merge: {source.path} (--reuse {source.given}), whose rows this run reuses, is "
                             f"damaged ({e}); restore an intact copy, or start a new run without it") from None

    def _gather_from(self, reader: Reader, k: int, rows: np.ndarray, positions: np.ndarray) -> None:
        """Every row of `reader` read in order (its checksums checked), the wanted ones parked."""
        step = max(1, DEFAULT_BUDGET_BYTES // max(1, sum(c.value_bytes() for c in reader.schema.columns)))
        t = 0
        for j0 in range(0, reader.rows, step):
            j1 = min(reader.rows, j0 + step)
            block = reader.read(j0, j1)
            e = int(np.searchsorted(rows, j1, "left"))
            if e == t:
                continue
            taken = block.take(np.asarray(rows[t:e], np.int64) - j0)
            where = np.asarray(positions[t:e], np.int64)
            out = self._as_result(taken, where, where, k)
            self.spill.add_by_window(out, np.searchsorted(self.bounds, where, "right") - 1)
            t = e
            self.plan.release()

    # ------------------------------------------------------------------ the pass
    def windows(self) -> Iterator[Window]:
        """Each window's positions expected from the shards (all but the copies)."""
        last = len(self.bounds) - 2
        for w in range(max(1, len(self.bounds) - 1)):
            a, b = int(self.bounds[w]), int(self.bounds[min(w + 1, len(self.bounds) - 1)])
            if self.plan is None:
                want = np.arange(a, b, dtype=np.int64)
            else:
                want = a + np.flatnonzero(np.asarray(self.plan.source[a:b]) == COMPUTED).astype(np.int64)
            yield Window(want, None if w >= last else b, a)

    def complete(self, rows: RowBlock, window: Window, problems: MergeProblems) -> RowBlock:
        """The window's rows in the result's schema: the shards' `rows` and the window's copies, checked."""
        self._window += 1
        a = window.start
        b = self.n if window.end is None else window.end
        rows = self._as_result(rows, rows.columns["index"], rows.columns["index"], -1)
        if self.spill is not None:
            parked = self.spill.take(self._window)
            base = RowBlock.concat(self.schema, [rows, parked]).sorted_by_index()
            copies = RowBlock.concat(self.schema, [parked, self._copy_duplicates(base, b)]).sorted_by_index()
            if len(copies):   # (a copy carries its first record's id until here)
                copies.columns["ids"] = self.ids_at(copies.columns["index"])
            copies = self._check_copies(copies, a, b, problems)
            rows = RowBlock.concat(self.schema, [rows, copies]).sorted_by_index()
            self.copied += len(copies)
        if self.check_digests and len(rows):
            self._check_digests(rows, a, b, problems)
        if self.plan is not None:
            self.plan.release()
        return rows

    def _copy_duplicates(self, base: RowBlock, b: int) -> RowBlock:
        """Copies of the first records of sequences in this window (`base`, sorted) to their later records:
        those in the window returned, the others parked for their windows."""
        first, copy = self.plan.pairs("duplicates")
        end = int(np.searchsorted(first, b, "left"))
        here = []
        have = base.columns["index"]
        while self._pair < end:
            c1 = min(end, self._pair + _PAIRS)
            q, p = np.asarray(first[self._pair:c1], np.int64), np.asarray(copy[self._pair:c1], np.int64)
            self._pair = c1
            k = np.searchsorted(have, q)
            found = np.flatnonzero((k < len(have)) & (have[np.minimum(k, max(len(have) - 1, 0))] == q)) \
                if len(have) else np.zeros(0, np.int64)   # (a first record missing from a partial merge: its
            made = base.take(k[found])                     # copies are missing too, and counted so)
            made.columns["index"] = p[found]
            dest = np.searchsorted(self.bounds, p[found], "right") - 1
            now = dest == self._window
            here.append(made.take(np.flatnonzero(now)))
            if not now.all():
                later = np.flatnonzero(~now)
                self.spill.add_by_window(made.take(later), dest[later])
        return RowBlock.concat(self.schema, here)

    def _check_copies(self, copies: RowBlock, a: int, b: int, problems: MergeProblems) -> RowBlock:
        """Each copy expected in [a, b) exactly once: the rest are problems (never written twice)."""
        copies = copies.sorted_by_index()
        want = a + np.flatnonzero(np.asarray(self.plan.source[a:b]) != COMPUTED).astype(np.int64)
        idx = copies.columns["index"]
        first = np.ones(len(idx), bool)
        first[1:] = idx[1:] != idx[:-1]
        if not first.all():
            problems.add_duplicates(np.unique(idx[~first]))
        expected = np.isin(idx, want)
        for i in np.flatnonzero(first & ~expected):
            problems.add_extra(int(idx[i]), copies.columns["ids"][i])
        keep = first & expected
        if keep.sum() != len(want):
            problems.add_missing(np.setdiff1d(want, idx[keep]))
        return copies if keep.all() else copies.take(np.flatnonzero(keep))

    def _check_digests(self, rows: RowBlock, a: int, b: int, problems: MergeProblems) -> None:
        planned = self.plan.digest_bytes(a, b)[rows.columns["index"] - a]
        for i in np.flatnonzero(np.any(rows.columns["sequence_digest"] != planned, axis=1)):
            problems.add_sequence(int(rows.columns["index"][i]), rows.columns["ids"][i])

    def _as_result(self, block: RowBlock, index: np.ndarray, computed_at: np.ndarray, reused_from: int) -> RowBlock:
        """`block` (a shard's or a reused result's rows) in the result's schema, at positions `index`."""
        columns = {c.path: block.columns[c.path] for c in self.shard_schema.row_columns}
        columns["index"] = np.asarray(index, np.int64)
        columns["computed_at"] = np.asarray(computed_at, np.int64)
        columns["reused_from"] = np.full(len(block), reused_from, np.int16)
        values = {c.path: block.values[c.path] for c in self.shard_schema.ragged_columns}
        return RowBlock(self.schema, columns, values, {g: block.lengths[g] for g in self.shard_schema.ragged_groups})
