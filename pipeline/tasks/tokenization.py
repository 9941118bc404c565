"""Turn sequence text into the token ids a model sees, with special-token masks and truncation.

Truncation keeps the tokenizer's leading and trailing special tokens (e.g. <cls> ... <eos>) and cuts the
residue tokens in between, so a truncated sequence still looks like a sequence to the model.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Tokenized:
    ids: list[int]
    special: np.ndarray      # bool per token
    truncated: bool
    unknown: bool            # a residue became the unknown token
    residues: str = ""       # the sequence text it was made from


class SequenceTokenizer:
    def __init__(self, tokenizer, max_tokens: int | None = None):
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.unk_id = tokenizer.unk_token_id
        with_specials = tokenizer("ACDEFGHIKLMNPQRSTVWY", add_special_tokens=True)["input_ids"]
        plain = tokenizer("ACDEFGHIKLMNPQRSTVWY", add_special_tokens=False)["input_ids"]
        self.num_special = len(with_specials) - len(plain)
        marks = tokenizer("ACDEFGHIKLMNPQRSTVWY", add_special_tokens=True,
                          return_special_tokens_mask=True)["special_tokens_mask"]
        # Special tokens before and after every sequence's content (what a window repeats).
        self.head = next((i for i, m in enumerate(marks) if not m), len(marks))
        self.tail = next((i for i, m in enumerate(reversed(marks)) if not m), 0)
        # Character-level tokenizers (ESM, the demo model) give one token per residue (encode makes sure
        # of it), so token counts are known from residue counts before tokenizing anything.
        self.char_level = len(plain) == 20

    def tokens_for_residues(self, residues: np.ndarray) -> np.ndarray:
        """Tokens per sequence (exact for character-level tokenizers, an upper bound otherwise)."""
        return np.asarray(residues, np.int64) + self.num_special

    def encode(self, sequences: list[str]) -> list[Tokenized]:
        enc = self.tokenizer(sequences, add_special_tokens=True, return_special_tokens_mask=True,
                             return_attention_mask=False)
        out = []
        for seq, ids, special in zip(sequences, enc["input_ids"], enc["special_tokens_mask"]):
            special = np.asarray(special, bool)
            if self.char_level and len(ids) - int(special.sum()) != len(seq):
                ids, special = self._per_character(seq, ids, special)
            truncated = False
            if self.max_tokens and len(ids) > self.max_tokens:
                ids, special = self._truncate(ids, special)
                truncated = True
            unknown = self.unk_id is not None and any(
                t == self.unk_id and not s for t, s in zip(ids, special))
            out.append(Tokenized(list(ids), special, truncated, unknown, seq))
        return out

    def unit(self, residue: str) -> str:
        """The text of one residue as the model reads it (a token of its own with a token per residue)."""
        return residue

    def content_spans(self, tok: Tokenized) -> np.ndarray:
        """int64 `[content tokens, 2]`: the residues [start, end) each non-special token of `tok` stands for (one
        each for a character-level tokenizer; a subword token may stand for several), from the tokenizer's
        offsets into the text. Needs a fast tokenizer where tokens group residues."""
        n = int((~tok.special).sum())
        if self.char_level:
            return np.stack([np.arange(n), np.arange(1, n + 1)], axis=1).astype(np.int64)
        enc = self.tokenizer(tok.residues, add_special_tokens=True, return_offsets_mapping=True,
                             return_special_tokens_mask=True)
        spans = [o for o, m in zip(enc["offset_mapping"], enc["special_tokens_mask"]) if not m]
        return np.asarray(spans[:n], np.int64).reshape(-1, 2)

    def _per_character(self, seq: str, ids: list[int], special: np.ndarray) -> tuple[list[int], np.ndarray]:
        """One token per residue, each unknown character its own unknown token. Some character-level
        tokenizers (ESM's) turn a run of unknown characters into a single unknown token, which would shift
        every later residue's per-residue row; the special tokens around the body are kept as they were."""
        head = int(np.argmin(special)) if not special.all() else len(ids)
        tail = int(np.argmin(special[::-1])) if not special.all() else 0
        body = [self.tokenizer.convert_tokens_to_ids(c) for c in seq]
        body = [self.unk_id if t is None else t for t in body]
        ids = list(ids[:head]) + body + list(ids[len(ids) - tail:])
        return ids, np.array([True] * head + [False] * len(body) + [True] * tail)

    def _truncate(self, ids: list[int], special: np.ndarray) -> tuple[list[int], np.ndarray]:
        n = len(ids)
        head = 0
        while head < n and special[head]:
            head += 1
        tail = 0
        while tail < n - head and special[n - 1 - tail]:
            tail += 1
        keep_body = max(0, self.max_tokens - head - tail)
        keep = list(range(head + keep_body)) + list(range(n - tail, n))
        return [ids[i] for i in keep], special[keep]
