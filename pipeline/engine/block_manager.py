"""Pages of the KV cache: a free list, and each sequence's pages in order (its block table).

No prefix sharing, so a page has at most one owner; a sequence reserves every page it can need when it
is admitted, so a running sequence never waits for memory and nothing needs preempting. That makes the
block tables incremental for free: a sequence's row of `tables` is written once when it is admitted, and a
step's block table is one gather of its sequences' rows, never rebuilt page by page.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from .sequence import Sequence


class BlockManager:
    def __init__(self, num_pages: int, page_size: int):
        assert num_pages > 0 and page_size > 0
        self.num_pages, self.page_size = num_pages, page_size
        self.free_pages: deque[int] = deque(range(num_pages))
        self.owner = [-1] * num_pages      # seq_id holding each page, -1 when free
        # Block tables of the admitted sequences: row seq.row holds its pages in order (zeros past them).
        self.tables = np.zeros((16, 1), np.int32)
        self.table_lens = np.zeros(16, np.int64)   # pages in each row
        self.free_rows = list(range(15, -1, -1))   # pop() hands out 0, 1, 2, ...

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def num_free(self) -> int:
        return len(self.free_pages)

    def can_allocate(self, seq: Sequence) -> bool:
        return self.pages_for(seq.reserve_tokens) <= self.num_free

    def allocate(self, seq: Sequence) -> None:
        assert not seq.pages, f"{seq} already holds pages"
        n = self.pages_for(seq.reserve_tokens)
        assert n <= self.num_free, f"{seq} needs {n} pages, {self.num_free} free"
        for _ in range(n):
            page = self.free_pages.popleft()
            assert self.owner[page] == -1, f"page {page} on the free list is owned by {self.owner[page]}"
            self.owner[page] = seq.seq_id
            seq.pages.append(page)
        self._take_row(seq)

    def free(self, seq: Sequence) -> None:
        for page in seq.pages:
            assert self.owner[page] == seq.seq_id, f"{seq} frees page {page} owned by {self.owner[page]}"
            self.owner[page] = -1
            self.free_pages.append(page)
        seq.pages = []
        if seq.row >= 0:
            self.tables[seq.row] = 0
            self.table_lens[seq.row] = 0
            self.free_rows.append(seq.row)
            seq.row = -1

    def _take_row(self, seq: Sequence) -> None:
        """Write seq's pages into a free row of `tables` (grown by doubling when full or too narrow)."""
        assert seq.row == -1, f"{seq} already holds block-table row {seq.row}"
        rows, width = self.tables.shape
        if not self.free_rows or len(seq.pages) > width:
            new_rows = rows * 2 if not self.free_rows else rows
            grown = np.zeros((new_rows, max(width, len(seq.pages))), np.int32)
            grown[:rows, :width] = self.tables
            self.tables = grown
            self.table_lens = np.concatenate([self.table_lens, np.zeros(new_rows - rows, np.int64)])
            self.free_rows[:0] = range(new_rows - 1, rows - 1, -1)
        seq.row = self.free_rows.pop()
        self.tables[seq.row, :len(seq.pages)] = seq.pages
        self.table_lens[seq.row] = len(seq.pages)

    def block_tables(self, rows: np.ndarray) -> np.ndarray:
        """int32 [len(rows), most pages among them]: the block tables of the sequences in those rows."""
        width = max(int(self.table_lens[rows].max(initial=0)), 1)
        return self.tables[rows, :width]

    def check(self) -> None:
        """Every page is either free exactly once or owned (for tests and debugging)."""
        free = set(self.free_pages)
        assert len(free) == len(self.free_pages), "a page is on the free list twice"
        for page, owner in enumerate(self.owner):
            assert (owner == -1) == (page in free), f"page {page}: owner {owner}, free {page in free}"
        assert len(set(self.free_rows)) == len(self.free_rows), "a block-table row is free twice"
        for row in self.free_rows:
            assert self.table_lens[row] == 0 and not self.tables[row].any(), f"free row {row} holds pages"
