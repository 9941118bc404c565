"""Pages of the KV cache: a free list, and each sequence's pages in order (its block table).

No prefix sharing, so a page has at most one owner; a sequence reserves every page it can need when it
is admitted, so a running sequence never waits for memory and nothing needs preempting.
"""
from __future__ import annotations

from collections import deque

from .sequence import Sequence


class BlockManager:
    def __init__(self, num_pages: int, page_size: int):
        assert num_pages > 0 and page_size > 0
        self.num_pages, self.page_size = num_pages, page_size
        self.free_pages: deque[int] = deque(range(num_pages))
        self.owner = [-1] * num_pages      # seq_id holding each page, -1 when free

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

    def free(self, seq: Sequence) -> None:
        for page in seq.pages:
            assert self.owner[page] == seq.seq_id, f"{seq} frees page {page} owned by {self.owner[page]}"
            self.owner[page] = -1
            self.free_pages.append(page)
        seq.pages = []

    def check(self) -> None:
        """Every page is either free exactly once or owned (for tests and debugging)."""
        free = set(self.free_pages)
        assert len(free) == len(self.free_pages), "a page is on the free list twice"
        for page, owner in enumerate(self.owner):
            assert (owner == -1) == (page in free), f"page {page}: owner {owner}, free {page in free}"
