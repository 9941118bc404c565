"""Turn sequence text into the token ids a model sees, with special-token masks and truncation.

The residues are first written as the run's input convention says (models/conventions.py: spaced, rare
residues as X, a prefix such as ProstT5's <AA2fold>). Special tokens are those the tokenizer adds and the
convention's prefix and suffix tokens that are the tokenizer's special tokens (or that its family leaves out
of pooling); everything else is content: pooled, scored and stored per residue.

Truncation keeps the leading and trailing special tokens (e.g. <cls> ... <eos>) and cuts the content tokens
in between, so a truncated sequence still looks like a sequence to the model.

Where the tokenizer gives each residue a token of its own, batches are encoded by table lookup
(residue_lookup.py), checked against the tokenizer when built and identical to it; sequences the table cannot
answer for, and other tokenizers, go through the tokenizer (a fast one in batch, in Rust).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..models.conventions import PLAIN, Convention
from . import residue_lookup, residue_spans

PROBE = residue_lookup.STANDARD   # the 20 standard amino acids


@dataclass
class Tokenized:
    ids: list[int]
    special: np.ndarray      # bool per token
    truncated: bool
    num_unknown: int = 0     # content tokens that are the unknown token (at least), or residues the input
                             # convention does not read (Convention.odd: SaProt's lone letters, upper case in 3Di)
    residues: str = ""       # the sequence text it was made from

    @property
    def unknown(self) -> bool:
        """A residue became the unknown token, or is one the input convention does not read (status 2)."""
        return self.num_unknown > 0


def special_ids(tokenizer) -> set[int]:
    """Ids of the tokenizer's special tokens, the unknown token left out (it stands for residues) unless it is
    also one of the named ones (ProtGPT2's <|endoftext|> is its unknown, BOS and EOS token at once)."""
    ids = set(tokenizer.all_special_ids)
    named = {getattr(tokenizer, f"{k}_token_id", None) for k in ("bos", "eos", "pad", "cls", "sep", "mask")}
    if tokenizer.unk_token_id is not None and tokenizer.unk_token_id not in named:
        ids.discard(tokenizer.unk_token_id)
    return ids


class SequenceTokenizer:
    def __init__(self, tokenizer, convention: Convention = PLAIN, max_tokens: int | None = None,
                 lookup: bool = True):
        """`lookup=False` keeps every sequence on the tokenizer's own path (the reference the tests and
        bench/bench_tokenize.py compare the table lookup with)."""
        self.tokenizer, self.convention, self.max_tokens = tokenizer, convention, max_tokens
        self.unk_id = tokenizer.unk_token_id
        self._special_ids = np.array(sorted(special_ids(tokenizer)), np.int64)
        self._prefix_tokens = (len(tokenizer(convention.prefix, add_special_tokens=False)["input_ids"])
                               if convention.prefix_excluded else 0)
        self.char_level = False
        probe = self._encode(convention.example(PROBE))
        # Special tokens before and after every sequence's content (what a window repeats).
        self.head = int(np.argmin(probe.special)) if not probe.special.all() else len(probe.ids)
        self.tail = int(np.argmin(probe.special[::-1])) if not probe.special.all() else 0
        self.num_special = int(probe.special.sum())
        content = len(probe.ids) - self.num_special
        # One token per residue (ESM, the demo model; spaced ProtT5/ProtBert; SaProt's residue#): token counts
        # are known from residue counts before tokenizing anything.
        self.char_level = content == len(PROBE)
        one = self._encode(convention.example("A"))
        # Tokens per residue at most. A token stands for at least one character of the (ASCII) text: a byte-level
        # BPE's byte, a SentencePiece piece or its byte fallback, a WordPiece piece or its unknown token; so a
        # tokenizer that is not one token per residue makes at most one per character of each residue's text,
        # the separator and suffix included (spaced residues through a subword vocabulary: "▁", "K" or " ", "K").
        self.per_residue = 1 if self.char_level else 1 + len(convention.separator) + len(convention.unit_suffix)
        # Tokens a sequence may have beyond those (a word marker, the prefix's line break).
        self.overhead = 0 if self.char_level else max(content - self.per_residue * len(PROBE),
                                                      len(one.ids) - self.num_special - 1, 0) + 1
        self._lookup = (residue_lookup.build(tokenizer, convention, self._reference, self._by_unit)
                        if self.char_level and lookup else None)

    def tokens_for_residues(self, residues: np.ndarray) -> np.ndarray:
        """Tokens per sequence of `residues` characters (the index's lengths): exact for one token per residue
        (`exact_counts`), an upper bound otherwise (residues of two characters: SaProt's residue + 3Di pairs; a
        subword or k-mer tokenizer: one token per character of the text at most)."""
        residues = np.asarray(residues, np.int64)
        width = self.convention.line_width
        breaks = residues // width if width else 0
        return residues * self.per_residue + breaks + self.num_special + self.overhead

    @property
    def exact_counts(self) -> bool:
        """`tokens_for_residues` is exact: one token per residue, each residue one character."""
        return self.char_level and not self.convention.paired_with

    @property
    def looks_up(self) -> bool:
        """Batches are encoded by table lookup (residue_lookup.py), not by the tokenizer."""
        return self._lookup is not None

    def encode(self, sequences: list[str]) -> list[Tokenized]:
        """Each sequence's tokens, cut to max_tokens where set."""
        if self._lookup is None:
            return self._by_tokenizer(sequences, self.max_tokens)
        found = self._lookup.ids(sequences)
        out = [None if ids is None else self._looked_up(seq, ids) for seq, ids in zip(sequences, found)]
        rest = [i for i, t in enumerate(out) if t is None]
        if rest:
            for i, tok in zip(rest, self._by_tokenizer([sequences[i] for i in rest], self.max_tokens)):
                out[i] = tok
        return out

    def _by_tokenizer(self, sequences: list[str], max_tokens: int | None) -> list[Tokenized]:
        """The tokenizer's own path: the texts in one batch call."""
        texts = [self.convention.text(s) for s in sequences]
        enc = self.tokenizer(texts, add_special_tokens=True, return_attention_mask=False)
        return [self._tokenized(seq, ids, max_tokens) for seq, ids in zip(sequences, enc["input_ids"])]

    def _reference(self, sequences: list[str]) -> list[tuple[list[int], np.ndarray]]:
        """(ids, special mask) of the tokenizer's own path, uncut: what the lookup must equal."""
        return [(t.ids, t.special) for t in self._by_tokenizer(sequences, None)]

    def _looked_up(self, seq: str, ids: np.ndarray) -> Tokenized:
        """A sequence from the lookup's ids (lead, one per residue, trail), cut as _truncate cuts."""
        lead, trail = len(self._lookup.lead), len(self._lookup.trail)
        truncated = bool(self.max_tokens) and len(ids) > self.max_tokens
        if truncated:
            keep = max(0, self.max_tokens - lead - trail)
            ids = np.concatenate((ids[:lead + keep], ids[len(ids) - trail:]))
        body = len(ids) - lead - trail
        unknown = 0 if self.unk_id is None else int(np.count_nonzero(ids[lead:lead + body] == self.unk_id))
        return Tokenized(ids.tolist(), self._lookup.special(body), truncated, max(unknown, self.convention.odd(seq)),
                         seq)

    def _encode(self, seq: str) -> Tokenized:
        return self._tokenized(seq, self.tokenizer(self.convention.text(seq))["input_ids"], None)

    def _tokenized(self, seq: str, ids: list[int], max_tokens: int | None) -> Tokenized:
        special = self._special(ids)
        if self.char_level and self._by_unit and len(ids) - int(special.sum()) != self.convention.count(seq):
            ids, special = self._per_unit(seq, ids, special)
        truncated = False
        if max_tokens and len(ids) > max_tokens:
            ids, special = self._truncate(ids, special, max_tokens)
            truncated = True
        unknown = 0 if self.unk_id is None else sum(1 for t, s in zip(ids, special) if t == self.unk_id and not s)
        return Tokenized(list(ids), special, truncated, max(unknown, self.convention.odd(seq)), seq)

    def unit(self, residue: str) -> str:
        """The text of one residue as the model reads it (a token of its own with a token per residue)."""
        return self.convention.units(residue)[0]

    def content_spans(self, tok: Tokenized) -> np.ndarray:
        """int64 `[content tokens, 2]`: the residues [start, end) each non-special token of `tok` stands for (one
        each with a token per residue; a subword or k-mer token may stand for several, a line break or word
        marker for none, start == end): residue_spans.py."""
        return self.content_spans_of([tok])[0]

    def content_spans_of(self, toks: list[Tokenized], strict: bool = False) -> list[np.ndarray]:
        """content_spans of each of `toks`, the texts tokenized again in one call (with offsets); `strict` as
        residue_spans.token_char_spans takes it."""
        if self.one_token_per_residue:
            return [np.stack([np.arange(n), np.arange(1, n + 1)], axis=1).astype(np.int64)
                    for n in (int((~t.special).sum()) for t in toks)]
        texts = [self.convention.text(t.residues) for t in toks]
        found = []
        for tok, (ids, chars) in zip(toks, residue_spans.token_char_spans(self.tokenizer, texts, strict)):
            spans = residue_spans.residue_spans(chars, residue_spans.char_owner(self.convention, tok.residues))
            n = int((~tok.special).sum())
            found.append(spans[~self._special(ids)][:n])   # (a truncated sequence keeps its first n)
        return found

    def spans_cover_residues(self) -> bool:
        """The residue spans of probe sequences (amino acids, nucleotides) cover each residue: a Python
        tokenizer's tokens are placed on its text by their own text (residue_spans.py), which must hold."""
        toks = self.encode([PROBE * 3, "ACGT" * 8 + "N" + "TTGCA" * 5])
        try:
            placed = self.content_spans_of(toks, strict=True)
        except ValueError:
            return False
        for tok, spans in zip(toks, placed):
            covered = residue_spans.token_of_residue(spans)
            if (covered < 0).any() or (not tok.truncated and len(covered) != len(tok.residues)):
                return False
        return True

    @property
    def one_token_per_residue(self) -> bool:
        """Every non-special token is one residue, in order (no line breaks between them)."""
        return self.char_level and not self.convention.line_width

    @property
    def _by_unit(self) -> bool:
        """Each residue is one unit of text with no separator (ESM, SaProt): a tokenizer that merges a run
        of unknown units into one token can be corrected unit by unit."""
        return not self.convention.separator and not self.convention.prefix and not self.convention.line_width

    def _special(self, ids: list[int]) -> np.ndarray:
        """The tokenizer's special tokens (by id: the masks some tokenizers return assume an <eos> they do not
        add, as Nucleotide Transformer's), and the prefix tokens a family leaves out of pooling (ProstT5's)."""
        special = np.isin(np.asarray(ids, np.int64), self._special_ids)
        if self._prefix_tokens:
            start = int(np.argmin(special)) if not special.all() else len(special)
            special[start:start + self._prefix_tokens] = True
        return special

    def _per_unit(self, seq: str, ids: list[int], special: np.ndarray) -> tuple[list[int], np.ndarray]:
        """One token per residue, each unknown unit its own unknown token. Some character-level tokenizers
        (ESM's) turn a run of unknown characters into a single unknown token, which would shift every later
        residue's per-residue row; the special tokens around the body are kept as they were."""
        head = int(np.argmin(special)) if not special.all() else len(ids)
        tail = int(np.argmin(special[::-1])) if not special.all() else 0
        body = [self.tokenizer.convert_tokens_to_ids(u) for u in self.convention.units(seq)]
        body = [self.unk_id if t is None else t for t in body]
        ids = list(ids[:head]) + body + list(ids[len(ids) - tail:])
        return ids, np.array([True] * head + [False] * len(body) + [True] * tail)

    def _truncate(self, ids: list[int], special: np.ndarray, max_tokens: int) -> tuple[list[int], np.ndarray]:
        n = len(ids)
        head = 0
        while head < n and special[head]:
            head += 1
        tail = 0
        while tail < n - head and special[n - 1 - tail]:
            tail += 1
        keep_body = max(0, max_tokens - head - tail)
        keep = list(range(head + keep_body)) + list(range(n - tail, n))
        return [ids[i] for i in keep], special[keep]
