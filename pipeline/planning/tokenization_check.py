"""Before any model runs, in the parent: how residues are written for this checkpoint (its family's input
convention, the one its tokenizer shows, the structure form its vocabulary reads and the sample is written in
(models/structure_input.py), or --input-format), and whether its tokenizer reads this input, on a sample (the
longest, the shortest and a few hundred more). Residues that become unknown tokens in bulk (or residues a
structure form does not read), or fewer tokens than the residues could make, refuse the run; a few odd
characters are logged and their rows get status 2.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import numpy as np

from index import SequenceIndex

from ..errors import UserError
from ..models import structure_input
from ..models.conventions import BY_OPTION, PLAIN, SPACED, Convention
from ..output import status_codes
from ..tasks.tokenization import SequenceTokenizer
from .input_policies import listing

log = logging.getLogger("run_shards")

SAMPLE = 300              # sequences besides the longest and the shortest
SAMPLE_RESIDUES = 2000    # of each sampled sequence, from its start (enough to see how it tokenizes)
UNREADABLE = 0.25        # a sampled sequence of which this share of content tokens is unknown is unreadable
BULK_ROWS = 0.5           # more than this share of the sample unreadable refuses the run (a few odd rows do not)
_MARKERS = re.compile(r"^(##|▁|Ġ)")


@dataclass
class Seen:
    """How a convention tokenizes the sample."""
    convention: Convention
    rows: int
    tokens: int                    # content tokens
    unknown: int                   # content tokens that are the unknown token
    unknown_rows: list[int]        # sample positions (FASTA) with an unknown token
    unreadable: int                # sampled sequences with UNREADABLE or more of their tokens unknown
    impossible: list[tuple[int, int, int]]   # (position, residues, content tokens) where too few tokens
    content_ids: list[list[int]]

    @property
    def bulk(self) -> bool:
        """The tokenizer does not read this input: too few tokens anywhere, or most sequences mostly unknown."""
        return bool(self.impossible) or self.unreadable > BULK_ROWS * self.rows


def sample_positions(index: SequenceIndex) -> np.ndarray:
    """FASTA positions of the longest and the shortest non-empty sequences and SAMPLE more, evenly spread."""
    filled = np.flatnonzero(index.lengths > 0)
    if len(filled) == 0:
        return filled
    ends = [filled[np.argmax(index.lengths[filled])], filled[np.argmin(index.lengths[filled])]]
    spread = filled[np.linspace(0, len(filled) - 1, min(SAMPLE, len(filled))).astype(np.int64)]
    return np.unique(np.concatenate([ends, spread]))


def decide_and_check(index: SequenceIndex, source, tokenizer, input_format: str) -> Convention:
    """The run's input convention (logged with why), after checking that the tokenizer reads the sample
    written so; UserError when it does not, or when the convention cannot be told."""
    positions = sample_positions(index)
    if len(positions) == 0:
        return source.family.convention or PLAIN
    as_written = [index.sequence(int(p), keep_case=True)[:SAMPLE_RESIDUES] for p in positions]
    upper = [t.upper() for t in as_written]   # what the index reads for a convention that does not keep case
    texts_for = lambda c: as_written if c.keeps_case else upper  # noqa: E731
    longest = _max_residues_per_token(tokenizer)
    look = lambda c: _seen(c, tokenizer, positions, texts_for(c), longest)  # noqa: E731
    family = source.family
    structure = structure_input.choose(tokenizer, input_format, as_written, [index.id(int(p)) for p in positions],
                                       f"{source.name} ({family.name})")
    if structure is not None:
        convention, why = structure
        if input_format == "auto" and convention == family.convention:
            why = f"{family.name} (recognised by {family.recognised_by}): {family.convention_source}"
    elif input_format != "auto":
        convention, why = BY_OPTION[input_format], f"--input-format {input_format}"
        if family.convention and family.convention != convention:
            log.warning("--input-format %s for a %s checkpoint, whose card writes residues so: %s", input_format,
                        family.name, family.convention.words())
    elif family.convention is not None:
        convention = family.convention
        why = f"{family.name} (recognised by {family.recognised_by}): {family.convention_source}"
    else:
        convention, why = _told_by_tokenizer(source, look, longest)
    seen = look(convention)
    if seen.bulk:
        raise UserError(_refusal(source, seen, index, tokenizer, convention, why, look, input_format))
    log.info("input format: %s; %s", convention.words(), why)
    if seen.unknown_rows:
        rows = seen.unknown_rows
        texts = texts_for(convention)
        chars = _unknown_characters(tokenizer, convention, [texts[list(positions).index(p)] for p in rows])
        if convention.alphabet:   # (structure input: residues its form does not read are flagged too)
            log.warning("%d of %d sampled sequences contain residues this input format (%s) does not read, or "
                        "characters this model's tokenizer does not know (%s), e.g. %s; such rows are computed as "
                        "the tokenizer reads them and get status %d", len(rows), seen.rows, convention.words(),
                        chars or "unknown in context", listing([f"'{index.id(p)}'" for p in rows[:3]]),
                        status_codes.UNKNOWN_RESIDUES)
            return convention
        log.warning("%d of %d sampled sequences contain characters this model's tokenizer does not know (%s), e.g. "
                    "%s; such rows are computed with its unknown token and get status %d", len(rows), seen.rows,
                    chars or "unknown in context", listing([f"'{index.id(p)}'" for p in rows[:3]]),
                    status_codes.UNKNOWN_RESIDUES)
    return convention


def _told_by_tokenizer(source, look, longest: int) -> tuple[Convention, str]:
    """For a family without a card convention: as written or space-separated, whichever the tokenizer reads
    (not in bulk as unknown tokens); a subword tokenizer reads text as written. Refuses where the tokenizer does
    not tell: both read, differently, by a vocabulary of single letters; or neither reads."""
    plain, spaced = look(PLAIN), look(SPACED)
    name = source.family.name
    same = plain.content_ids == spaced.content_ids
    if not plain.bulk and (spaced.bulk or same or longest > 1):
        return PLAIN, (f"{name}: its tokenizer reads the residues as written ({plain.unknown} unknown tokens in "
                       f"{plain.rows} sampled sequences)")
    if not spaced.bulk and plain.bulk:
        return SPACED, (f"{name}: written as they are, residues become unknown tokens; space-separated, they do "
                        f"not ({spaced.unknown} unknown tokens in {spaced.rows} sampled sequences)")
    raise UserError(
        f"--model {source.name} ({name}): cannot tell how its tokenizer wants residues written: as written, "
        f"{_counts(plain)}; space-separated, {_counts(spaced)}. Pass --input-format plain or --input-format spaced "
        "(docs/models.md says what each means).")


def _counts(seen: Seen) -> str:
    return f"{seen.tokens:,} tokens, {seen.unknown:,} of them unknown, in {seen.rows} sampled sequences"


def _seen(convention: Convention, tokenizer, positions: np.ndarray, texts: list[str], longest: int) -> Seen:
    toks = SequenceTokenizer(tokenizer, convention).encode(texts)
    seen = Seen(convention, len(texts), 0, 0, [], 0, [], [])
    for p, text, t in zip(positions, texts, toks):
        content = [i for i, s in zip(t.ids, t.special) if not s]
        seen.tokens += len(content)
        seen.unknown += t.num_unknown
        seen.content_ids.append(content)
        if t.num_unknown:
            seen.unknown_rows.append(int(p))
            seen.unreadable += t.num_unknown >= UNREADABLE * max(len(content), 1)
        if len(content) * longest < len(text):
            seen.impossible.append((int(p), len(text), len(content)))
    return seen


def _max_residues_per_token(tokenizer) -> int:
    """The most letters one vocabulary token holds (word markers and special tokens aside): a sequence of n
    residues cannot honestly be fewer than n / this many tokens."""
    special = set(tokenizer.all_special_tokens)
    most = 1
    for token in tokenizer.get_vocab():
        if token in special or (token[:1] in "<[" and token[-1:] in ">]"):
            continue
        most = max(most, sum(c.isascii() and c.isalpha() for c in _MARKERS.sub("", token)))
    return most


def _unknown_characters(tokenizer, convention: Convention, texts: list[str]) -> str:
    """The characters of `texts` that are unknown tokens on their own, or residues the convention does not read
    (a lone letter where residues are residue + 3Di pairs), e.g. "'J', 'B'"."""
    probe = SequenceTokenizer(tokenizer, convention)
    chars = sorted({r for t in texts for r in convention.residues(t)})
    unknown = [c for c, t in zip(chars, probe.encode(chars)) if t.unknown]
    return ", ".join(repr(c) for c in unknown[:10])


def _refusal(source, seen: Seen, index, tokenizer, convention: Convention, why: str, look, input_format: str) -> str:
    """What was seen, and the fix."""
    what = []
    if seen.unknown:
        chars = _unknown_characters(tokenizer, convention, [index.sequence(p, convention.keeps_case)[:SAMPLE_RESIDUES]
                                                            for p in seen.unknown_rows[:20]])
        if convention.alphabet:   # (structure input: residues its form does not read count too)
            alone = f" (on their own: {chars})" if chars else ""
            what.append(f"{seen.unknown:,} of its {seen.tokens:,} tokens are residues this form does not read or "
                        f"the unknown token {tokenizer.unk_token!r}{alone}, in {len(seen.unknown_rows)} of "
                        f"{seen.rows} sampled sequences")
        else:
            alone = f" (unknown on their own: {chars})" if chars else ""
            what.append(f"{seen.unknown:,} of its {seen.tokens:,} tokens are the unknown token "
                        f"{tokenizer.unk_token!r}{alone}, in {len(seen.unknown_rows)} of {seen.rows} sampled sequences")
    if seen.impossible:
        p, residues, tokens = max(seen.impossible, key=lambda x: x[1])
        what.append(f"{len(seen.impossible)} sequence(s) became fewer tokens than their residues can make "
                    f"(e.g. '{index.id(p)}': {residues:,} residues as {tokens} token(s))")
    hint = structure_input.refusal_hint(convention)
    fixes = [hint] if hint else []
    for option, other in list(BY_OPTION.items()) + structure_input.alternatives(tokenizer):
        if option != input_format and other != convention and not look(other).bulk:
            fixes.append(f"--input-format {option} ({other.words()}) tokenizes the sample with no more than a few "
                         "unknown tokens")
    if input_format != "auto" and source.family.convention is not None:
        fixes.append("without --input-format the family's own convention applies "
                     f"({source.family.convention.words()})")
    fixes.append("check that the input is what this model reads (protein or DNA, its alphabet), or replace the "
                 "characters it does not know")
    return (f"--model {source.name} ({source.family.name}): its tokenizer does not read this input written as "
            f"{convention.words()} ({why}): {'; '.join(what)}. No model ran. Fix: {'; or '.join(fixes)}.")
