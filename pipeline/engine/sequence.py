"""One request to the engine: its tokens, how many are already in the cache, and where its state lives."""
from __future__ import annotations

import enum


class Status(enum.Enum):
    WAITING = "waiting"      # not admitted: no pages or state slot yet
    RUNNING = "running"      # admitted: pages reserved, being prefilled or decoded
    FINISHED = "finished"    # done; pages and slot returned


class Sequence:
    """Tokens (prompt, then generated ones), the count whose keys/values/state are computed, its pages."""

    def __init__(self, seq_id: int, token_ids: list[int], max_new_tokens: int = 0, key: int = 0):
        assert len(token_ids) > 0, "a sequence needs at least one token"
        self.seq_id = seq_id
        self.token_ids = list(token_ids)
        self.num_prompt = len(token_ids)
        self.max_new_tokens = max_new_tokens   # 0: no generation (embed / score)
        self.key = key                          # sampling stream (the FASTA position in the pipeline)
        self.num_computed = 0
        self.pages: list[int] = []
        self.row = -1                           # its block-table row (BlockManager.tables) while admitted
        self.slot = -1
        self.status = Status.WAITING
        self.finish_reason: str | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return f"Sequence({self.seq_id}, {len(self)} tokens, {self.num_computed} computed, {self.status.value})"

    @property
    def generates(self) -> bool:
        return self.max_new_tokens > 0

    @property
    def num_pending(self) -> int:
        """Tokens not yet run through the model."""
        return len(self.token_ids) - self.num_computed

    @property
    def is_decoding(self) -> bool:
        return self.num_computed >= self.num_prompt

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def generated(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def reserve_tokens(self) -> int:
        """KV slots this sequence can ever need: its prompt plus the generated tokens fed back (all but the last)."""
        return self.num_prompt + max(0, self.max_new_tokens - 1)

    def append(self, token: int) -> None:
        assert self.generates and self.num_pending == 0, "append only after every token has been computed"
        self.token_ids.append(int(token))
