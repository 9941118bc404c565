"""Which residues each token of a sequence stands for (its span), so that per-residue rows are residues for
every tokenizer: a subword (BPE: ProtGPT2, Llama, Qwen) or k-mer (Nucleotide Transformer) token may stand
for several residues, a line break or a word marker for none. `embed --per-residue` gives each residue the
vector of the token that covers it, `score --per-residue` an equal share of that token's log-probability;
a token that covers no residue gives no row.

A span comes from the tokenizer's character offsets into the text it read (a fast tokenizer), or, for a
Python tokenizer (which has none), from its tokens' own text found in order in that text (a k-mer
vocabulary's tokens are pieces of it); a token whose text is not found there (the unknown token standing for
a run of unknown characters) covers the text up to where the next token's is. The characters of the text
belong to residues as the input convention wrote them (models/conventions.py: separators, a prefix, line
breaks and a suffix belong to none).
"""
from __future__ import annotations

import numpy as np

from ..errors import UserError
from ..models.conventions import Convention
from .residue_lookup import SPACE_MARKS


def char_owner(convention: Convention, residues: str) -> np.ndarray:
    """For each character of the convention's text of `residues`, the residue it belongs to (-1: a prefix,
    separator, line break or suffix). The convention keeps one character per residue in place."""
    owner: list[int] = [-1] * len(convention.prefix)
    width = convention.line_width or max(len(residues), 1)
    for i in range(len(residues)):
        if i and i % width == 0:
            owner.append(-1)                       # the line break
        elif i:
            owner += [-1] * len(convention.separator)
        owner += [i] * (1 + len(convention.unit_suffix))
    owner += [-1] * len(convention.suffix)
    return np.asarray(owner, np.int64)


def token_char_spans(tokenizer, texts: list[str], strict: bool = False) -> list[tuple[list[int], np.ndarray]]:
    """Per text: (its token ids with the tokenizer's special tokens, int64 [T, 2] the characters [start, end)
    each token stands for; (0, 0) for an added special token). `strict`: ValueError where a Python tokenizer's
    token other than the unknown one is not found where it should be (the check on probes)."""
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(texts, add_special_tokens=True, return_offsets_mapping=True, return_attention_mask=False)
        return [(list(ids), np.asarray(offsets, np.int64).reshape(-1, 2))
                for ids, offsets in zip(enc["input_ids"], enc["offset_mapping"])]
    return [_by_token_text(tokenizer, text, strict) for text in texts]


def _by_token_text(tokenizer, text: str, strict: bool) -> tuple[list[int], np.ndarray]:
    """A Python tokenizer's tokens placed on `text` by their own text (see the module's docstring)."""
    ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    pieces = tokenizer.tokenize(text)
    piece_ids = list(tokenizer.convert_tokens_to_ids(pieces))
    spans = np.zeros((len(ids), 2), np.int64)
    at = next((k for k in range(len(ids) - len(pieces) + 1) if ids[k:k + len(pieces)] == piece_ids), None)
    if at is None:   # the added special tokens are not around the pieces: nothing is placed
        if strict:
            raise ValueError(f"the tokens of {text[:40]!r} are not its pieces with special tokens around them")
        return ids, spans
    words = [_piece_text(tokenizer, p) for p in pieces]
    folded = text.lower()
    cursor = 0
    for k, word in enumerate(words):
        while cursor < len(text) and text[cursor].isspace():
            cursor += 1
        if word and folded.startswith(word.lower(), cursor):
            end = cursor + len(word)
        else:   # not found where it should be (an unknown token): up to where the next one is found
            if strict and piece_ids[k] != tokenizer.unk_token_id:
                raise ValueError(f"token {pieces[k]!r} is not found at character {cursor} of {text[:40]!r}")
            following = next((w for w in words[k + 1:] if w), "")
            found = folded.find(following.lower(), cursor + 1) if following else -1
            end = found if found > cursor else len(text)
        spans[at + k] = (cursor, end)
        cursor = end
    return ids, spans


def _piece_text(tokenizer, piece: str) -> str:
    """The text a token of a Python tokenizer stands for, word marks and spaces left out ('' if none)."""
    try:
        text = tokenizer.convert_tokens_to_string([piece])
    except Exception:   # (a tokenizer that cannot say: its piece as written)
        text = piece
    text = text.translate(SPACE_MARKS).strip()
    return text[2:] if text.startswith("##") else text


def residue_spans(char_spans: np.ndarray, owner: np.ndarray) -> np.ndarray:
    """int64 [T, 2]: the residues [start, end) each token stands for, from its characters `char_spans` and the
    residue each character belongs to (`owner`, char_owner: residues in order, so a token's residues run from
    its first residue character's to its last's); (0, 0) for a token that stands for none."""
    n, size = len(char_spans), len(owner)
    out = np.zeros((n, 2), np.int64)
    if n == 0 or size == 0:
        return out
    start = np.clip(char_spans[:, 0], 0, size)
    end = np.clip(np.maximum(char_spans[:, 1], start), 0, size)
    inside = owner >= 0
    position = np.arange(size)
    # the first residue character at or after each character (size: none), the last at or before it (-1: none)
    first_after = np.minimum.accumulate(np.where(inside, position, size)[::-1])[::-1]
    last_before = np.maximum.accumulate(np.where(inside, position, -1))
    has = end > start
    first = np.full(n, size)
    first[has] = first_after[start[has]]
    found = has & (first < end)
    last = last_before[end[found] - 1]
    out[found, 0] = owner[first[found]]
    out[found, 1] = owner[last] + 1
    return out


def token_of_residue(spans: np.ndarray) -> np.ndarray:
    """int64 [residues]: for each residue up to the last one any token covers, the token (row of `spans`)
    that covers it, the later one where two do (a character split over two byte-level tokens); -1 where none
    does."""
    count = int(spans[:, 1].max()) if len(spans) else 0
    found = np.full(count, -1, np.int64)
    widths = spans[:, 1] - spans[:, 0]
    covering = widths > 0
    if covering.any():
        tokens = np.repeat(np.flatnonzero(covering), widths[covering])
        starts = np.repeat(spans[covering, 0], widths[covering])
        offsets = np.arange(len(tokens)) - np.repeat(np.cumsum(widths[covering]) - widths[covering], widths[covering])
        np.maximum.at(found, starts + offsets, tokens)
    return found


def refuse_unplaced_tokens(tokenizer) -> None:
    """UserError where the run's tokenizer (tokenization.SequenceTokenizer) groups residues and its tokens
    cannot be placed on them (see this module's docstring)."""
    if not tokenizer.one_token_per_residue and not tokenizer.spans_cover_residues():
        raise UserError("--per-residue places each token on the residues it stands for, by the tokenizer's "
                        "character offsets (a fast tokenizer: tokenizer.json) or its tokens' own text; this "
                        "checkpoint's tokenizer gives neither for sample sequences. Leave out --per-residue, or "
                        "give the checkpoint its tokenizer.json.")
