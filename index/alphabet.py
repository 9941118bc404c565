"""Does the input look like what the model reads? Records that look like nucleotides given to a protein
model, or like protein given to a nucleotide model, are counted before any work and named in one warning;
they run all the same (the results do not change).

A record looks like nucleotides when at least 90% of its residues are A, C, G, T, U or N, and like protein
otherwise. The model's alphabet is told by its tokenizer's vocabulary (`model_alphabet`).
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterable

import numpy as np

from .cache import cache_dir
from .errors import InputChanged
from .fasta_scan import NUCLEOTIDES, ScanStream
from .sequence_index import SequenceIndex

AMINO_ACIDS = frozenset("ACDEFGHIKLMNPQRSTVWY")
NUCLEOTIDE_SHARE = (9, 10)   # at least 9/10 of the residues: integer arithmetic, exact at any length
MAX_EXAMPLES = 5


def model_alphabet(vocab: Iterable[str]) -> str | None:
    """'nucleotide', 'protein', or None when the vocabulary does not tell.

    The vocabulary's alphabetic tokens decide: made only of A, C, G, T, U and N (single letters or k-mers,
    as DNA models have) means nucleotide; a small vocabulary (at most 64 alphabetic tokens) with a token
    for each of the 20 amino acids means protein (ESM, ProtBERT, the demo model). Subword text vocabularies
    (tens of thousands of tokens) read anything and are not checked.
    """
    words = [t for t in vocab if t.isascii() and t.isalpha()]
    letters = set("".join(words).upper())
    if {"A", "C", "G"} <= letters <= set(NUCLEOTIDES.decode()):
        return "nucleotide"
    if len(words) <= 64 and AMINO_ACIDS <= {w.upper() for w in words if len(w) == 1}:
        return "protein"
    return None


def nucleotide_like(index: SequenceIndex, cache: str | os.PathLike | None = None) -> np.ndarray:
    """Per record: at least 90% of its residues are A, C, G, T, U or N (an empty record is not).

    Counting reads every input once more (the index does not keep it: it would slow every index build by
    about a third); `cache`, a file name, keeps the answer for the next run on the same index.
    """
    if cache is not None:
        with contextlib.suppress(OSError, ValueError, EOFError):
            return np.unpackbits(np.load(cache))[:len(index)].astype(bool)
    like, at = np.zeros(len(index), bool), 0   # the files read a few blocks at a time, in index order
    share, whole = NUCLEOTIDE_SHARE
    for k, f in enumerate(index.inputs):
        for piece in ScanStream(f.path, nucleotides=True):
            n = len(piece.offsets)
            same = at + n <= len(index) and np.array_equal(piece.offsets, index.offsets[at:at + n])
            if not same or int(index.file_no[at]) != k:
                raise InputChanged(f.path, "the file changed after it was indexed; run again to index it anew")
            lengths = piece.lengths.astype(np.int64)
            like[at:at + n] = (lengths > 0) & (whole * piece.nucleotides >= share * lengths)
            at += n
            index.release()
    if at != len(index):
        raise InputChanged(index.inputs[-1].path, "the file changed after it was indexed; run again to index it anew")
    if cache is not None:
        tmp = f"{cache}.tmp{os.getpid()}.npy"
        try:
            Path(cache).parent.mkdir(parents=True, exist_ok=True)
            np.save(tmp, np.packbits(like))
            os.replace(tmp, cache)
        except OSError:   # a read-only cache is not fatal: the counts are just not reused
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return like


def alphabet_mismatch(index: SequenceIndex, vocab: Iterable[str]) -> str | None:
    """A warning naming how many records do not look like the model's alphabet, with examples; None when
    they all do or the model's alphabet is not told. The counts are cached beside the index cache."""
    alphabet = model_alphabet(vocab)
    if alphabet is None or len(index) == 0:
        return None
    like = nucleotide_like(index, cache_dir() / "index" / f"{index.fingerprint()}.nucleotide-like.npy")
    if alphabet == "protein":
        odd, looks = np.flatnonzero(like), "nucleotides (at least 90% A, C, G, T, U or N)"
    else:
        odd, looks = np.flatnonzero(~like), "protein (under 90% A, C, G, T, U or N)"
        odd = odd[np.asarray(index.lengths[odd]) > 0]
    if len(odd) == 0:
        return None
    several = len(index.inputs) > 1
    examples = ", ".join(f"'{index.id(int(i))}'" + (f" ({index.given_path_of(int(i))})" if several else "")
                         for i in odd[:MAX_EXAMPLES])
    more = f" and {len(odd) - MAX_EXAMPLES:,} more" if len(odd) > MAX_EXAMPLES else ""
    return (f"{len(odd):,} of {len(index):,} record(s) look like {looks}, but the model reads {alphabet} "
            f"sequences (its tokenizer's vocabulary): {examples}{more}. They run all the same; check that the "
            "FASTA and --model go together.")
