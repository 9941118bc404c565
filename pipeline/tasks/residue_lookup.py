"""Token ids by table lookup for tokenizers that give each residue a token of its own (ESM, SaProt, the demo
model, spaced word-level vocabularies): a 256-entry table over the residues' bytes plus the fixed tokens the
tokenizer puts around them, identical to the tokenizer and some 20-80x faster (bench/bench_tokenize.py).

Nothing is assumed about a tokenizer: the table is read off the tokenizer (each printable character as a
one-residue sequence), each entry checked against the vocabulary (the token whose text is the residue's unit,
or the unknown token), and the whole against the tokenizer on probes of neighbouring residues when built.
Characters the table cannot answer for exactly are left to the tokenizer, so a sequence holding one takes
the tokenizer's path: whitespace, control and non-ASCII characters, a character that is not one token of its
own, and a character through which the vocabulary could join neighbouring residues into another token
(ESM's '<' of `<mask>`, SaProt's lower-case 3Di letters after a '#'). Where a probe differs all the same, no
lookup is built and every sequence takes the tokenizer: never a guess.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..models.conventions import Convention

log = logging.getLogger("run_shards.tokenization")

STANDARD = "ACDEFGHIKLMNPQRSTVWY"
PRINTABLE = [chr(b) for b in range(33, 127)]   # ASCII without space and control characters
# How SentencePiece (metaspace) and byte-level BPE vocabularies write a space.
SPACE_MARKS = str.maketrans({"\u2581": " ", "\u0120": " "})

# (ids, special mask) for each sequence, untruncated: the tokenizer's path the lookup must equal.
Reference = Callable[[list[str]], list[tuple[list[int], np.ndarray]]]


@dataclass(frozen=True)
class ResidueLookup:
    table: np.ndarray    # int64 [256]: the token id of each byte as a residue
    safe: np.ndarray     # bool [256]: the bytes the table answers for exactly
    lead: np.ndarray     # int64: the special tokens before the residues' tokens (<cls>, ProstT5's <AA2fold>)
    trail: np.ndarray    # int64: the special tokens after them (<eos>, </s>, [SEP])

    def ids(self, sequences: list[str]) -> list[np.ndarray | None]:
        """int64 ids per sequence (lead, one token per residue, trail); None where the sequence holds a
        character the table does not answer for, or is empty: that one takes the tokenizer."""
        usable = [bool(s) and s.isascii() for s in sequences]
        chosen = [s for s, ok in zip(sequences, usable) if ok]
        codes = np.frombuffer("".join(chosen).encode("ascii"), np.uint8)
        body = self.table[codes]
        ends = np.cumsum([len(s) for s in chosen])
        starts = ends - np.array([len(s) for s in chosen], np.int64)
        unsafe = ~self.safe[codes]
        if unsafe.any():   # sequences with a character the tokenizer must read: one test per sequence
            clean = np.add.reduceat(unsafe, starts) == 0 if len(starts) else np.zeros(0, bool)
        else:
            clean = np.ones(len(chosen), bool)
        out: list[np.ndarray | None] = [None] * len(sequences)
        lead, trail = self.lead, self.trail
        k = 0
        for i, ok in enumerate(usable):
            if ok:
                if clean[k]:
                    out[i] = np.concatenate((lead, body[starts[k]:ends[k]], trail))
                k += 1
        return out

    def special(self, residues: int) -> np.ndarray:
        """bool per token of a looked-up sequence of `residues` residues: the lead and trail are special."""
        special = np.zeros(len(self.lead) + residues + len(self.trail), bool)
        special[:len(self.lead)] = True
        special[len(special) - len(self.trail):] = True
        return special


def build(tokenizer, convention: Convention, reference: Reference, by_unit: bool) -> ResidueLookup | None:
    """The lookup for `tokenizer` reading residues written by `convention`, or None (with the reason logged)
    where it cannot be exact. `reference` is the tokenizer's own path; `by_unit`: that path gives each residue
    the vocabulary's token for its unit (SequenceTokenizer._per_unit), which the table must then equal."""
    if convention.line_width:
        return _none("line breaks every few residues are tokens of their own")
    if convention.paired_with:
        return _none("each residue is two characters (a residue letter and its 3Di letter)")
    standard_ids, standard_special = reference([STANDARD])[0]
    shape = _lead_and_trail(standard_ids, standard_special, len(STANDARD))
    if shape is None:
        return _none("the special tokens do not all sit before and after the residues' tokens")
    lead, trail = shape
    joining = _joining_characters(tokenizer, convention)
    candidates = [c for c in PRINTABLE if c not in joining]
    table, safe = np.zeros(256, np.int64), np.zeros(256, bool)
    in_vocabulary = _vocabulary_check(tokenizer, convention, by_unit)
    for c, (ids, special) in zip(candidates, reference(candidates)):
        content = _content(ids, special, lead, trail)
        if content is not None and in_vocabulary(c, content):
            table[ord(c)], safe[ord(c)] = content, True
    lookup = ResidueLookup(table, safe, np.asarray(lead, np.int64), np.asarray(trail, np.int64))
    if not safe[[ord(c) for c in STANDARD]].all():
        return _none("a standard residue is not one token of its own")
    probes = _probes("".join(c for c in PRINTABLE if safe[ord(c)]))
    for probe, ours, (ids, special) in zip(probes, lookup.ids(probes), reference(probes)):
        if ours is None or ours.tolist() != list(ids) or not np.array_equal(lookup.special(len(probe)), special):
            return _none(f"the tokenizer reads {probe[:40]!r} otherwise")
    return lookup


def _none(why: str) -> None:
    log.debug("tokenizing with the tokenizer itself, no table lookup: %s", why)
    return None


def _lead_and_trail(ids: list[int], special: np.ndarray, residues: int) -> tuple[list[int], list[int]] | None:
    """The special tokens before and after the content of a sequence of `residues` one-token residues, when
    all of them are there (none between residues, none of the content special)."""
    head = int(np.argmin(special)) if not special.all() else len(ids)
    tail = len(ids) - head - residues
    expected = np.array([True] * head + [False] * residues + [True] * max(tail, 0))
    if tail < 0 or not np.array_equal(special, expected):
        return None
    return list(ids[:head]), list(ids[len(ids) - tail:])


def _content(ids: list[int], special: np.ndarray, lead: list[int], trail: list[int]) -> int | None:
    """The one content id of a one-residue sequence, when the tokens around it are `lead` and `trail`."""
    h, t = len(lead), len(trail)
    if (len(ids) != h + 1 + t or list(ids[:h]) != lead or list(ids[h + 1:]) != trail
            or not np.array_equal(special, [True] * h + [False] + [True] * t)):
        return None
    return int(ids[h])


def _vocabulary_check(tokenizer, convention: Convention, by_unit: bool) -> Callable[[str, int], bool]:
    """Whether the id the tokenizer gave character `c` is the vocabulary's token for its unit. By unit (the
    tokenizer's path corrects each residue to its unit's token): exactly that token, the unknown token where
    the vocabulary has none. Otherwise: the unknown token, or a token whose text, space marks read as spaces
    and stripped, is the unit as written or as the normaliser writes it (T5's '▁A' for 'A')."""
    units = {c: convention.units(c)[0] for c in PRINTABLE}
    if by_unit:
        ids = dict(zip(PRINTABLE, tokenizer.convert_tokens_to_ids(list(units.values()))))
        return lambda c, i: i == (tokenizer.unk_token_id if ids[c] is None else ids[c])
    normal = _normal_forms(tokenizer)
    texts = {i: t for t, i in tokenizer.get_vocab().items()}

    def check(c: str, i: int) -> bool:
        text = texts.get(i, "").translate(SPACE_MARKS).strip()
        return i == tokenizer.unk_token_id or text in (units[c], "".join(normal.get(u, u) for u in units[c]))
    return check


def _joining_characters(tokenizer, convention: Convention) -> set[str]:
    """Characters that let a vocabulary token span two residues' text. Each residue's text is its separator,
    the residue and its unit suffix (" A" spaced, "A#" for SaProt); a token that can lie across two of them
    would change both neighbours' tokens. For each way one can, one residue character it needs (a non-letter
    where it has one: ESM's '<' of `<mask>`): a sequence without that character cannot hold the token there.
    A token made of the convention's own text alone cannot be kept out: then every character. Characters the
    tokenizer's normaliser turns into a needed one go with it."""
    pattern = convention.separator + "\0" + convention.unit_suffix
    period, residue = len(pattern), len(convention.separator)
    read_as: dict[str, set[str]] = {}   # a character in a token -> the characters that tokenize as it
    for c, n in _normal_forms(tokenizer).items():
        read_as.setdefault(n, {n}).add(c)
    joining: set[str] = set()
    for token in tokenizer.get_vocab():
        text = token.translate(SPACE_MARKS)
        if len(text) < 2 or not text.isascii():
            continue   # one character stays within its residue's text; others never occur in ASCII text
        for k in range(period):
            if k + len(text) <= period:
                continue   # within one residue's text: the one-residue probes see what it does
            spots = [(k + i) % period for i in range(len(text))]
            if any(j != residue and text[i] != pattern[j] for i, j in enumerate(spots)):
                continue   # cannot lie over the text at this offset
            needed = [text[i] for i, j in enumerate(spots) if j == residue]
            if not needed:
                return set(PRINTABLE)
            pick = next((c for c in needed if not c.isalnum()), needed[0])
            joining |= read_as.get(pick, {pick})
    return joining


def _normal_forms(tokenizer) -> dict[str, str]:
    """Each printable character as the tokenizer's normaliser writes it (a fast tokenizer's normaliser, or a
    Python tokenizer's lower-casing); each character as itself where there is none."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    normalizer = getattr(backend, "normalizer", None) if backend is not None else None
    if normalizer is not None:
        return {c: normalizer.normalize_str(c) for c in PRINTABLE}
    if getattr(tokenizer, "do_lower_case", False):
        return {c: c.lower() for c in PRINTABLE}
    return {c: c for c in PRINTABLE}


def _probes(safe: str) -> list[str]:
    """Sequences of the safe characters that show any dependence on neighbours or position: all of them in
    order and reversed, each doubled, each first and last around the standard residues, and random mixes."""
    rng = np.random.default_rng(0)
    mixes = ["".join(rng.choice(list(safe), n)) for n in (2, 3, 5, 17, 64, 300)]
    return [safe, safe[::-1], "".join(c + c for c in safe)] + [c + STANDARD + c for c in safe] + mixes
