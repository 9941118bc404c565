"""Rows parked on disk until a merge reaches their window: the copies the result merge makes ahead of
their place (rows reused from an earlier result, copies of a sequence's first record), one file per
window, each read once and removed. Memory holds only the rows being parked or taken."""
from __future__ import annotations

import os
import pickle

import numpy as np

from .schema import RowBlock, Schema


class RowSpill:
    def __init__(self, directory: str, schema: Schema, count: int):
        self.directory, self.schema = directory, schema
        os.makedirs(directory, exist_ok=True)
        self.rows = np.zeros(count, np.int64)   # rows parked per window

    def _path(self, bucket: int) -> str:
        return os.path.join(self.directory, f"{bucket}.rows")

    def add(self, bucket: int, block: RowBlock) -> None:
        """Park `block` (rows of this schema) for window `bucket`."""
        if len(block) == 0:
            return
        with open(self._path(bucket), "ab") as fh:
            pickle.dump((block.columns, block.values, block.lengths), fh, protocol=5)
        self.rows[bucket] += len(block)

    def add_by_window(self, block: RowBlock, windows: np.ndarray) -> None:
        """Park each row of `block` for its window (`windows`, one per row)."""
        order = np.argsort(windows, kind="stable")
        cuts = np.flatnonzero(np.diff(windows[order])) + 1
        for rows in np.split(order, cuts):
            if len(rows):
                self.add(int(windows[rows[0]]), block.take(rows))

    def take(self, bucket: int) -> RowBlock:
        """Every row parked for window `bucket` (then removed from disk)."""
        path = self._path(bucket)
        if not self.rows[bucket]:
            return RowBlock.empty(self.schema)
        blocks = []
        with open(path, "rb") as fh:
            while True:
                try:
                    columns, values, lengths = pickle.load(fh)
                except EOFError:
                    break
                blocks.append(RowBlock(self.schema, columns, values, lengths))
        os.unlink(path)
        block = RowBlock.concat(self.schema, blocks)
        if len(block) != self.rows[bucket]:
            raise OSError(f"{path}: {len(block)} rows read back, {int(self.rows[bucket])} parked")
        return block
