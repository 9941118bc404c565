"""Each row's sequence digest (`sequence_digest`, 16 bytes): BLAKE2b-128 of the residues as the index
reads them (whitespace removed, upper-cased unless the run's input convention keeps case, as SaProt's
structure-aware pairs and ProstT5's 3Di strings do, a trailing '*' dropped), before any truncation. Rows of equal
sequences have equal digests, in one result and across results, so that a later run can find a sequence
already computed (with the same model and settings) without the FASTA it came from."""
from __future__ import annotations

import hashlib
from typing import Iterable

import numpy as np

SIZE = 16


def digests(sequences: Iterable[str]) -> np.ndarray:
    """[n, 16] uint8: the digest of each sequence."""
    raw = b"".join(hashlib.blake2b(s.encode("ascii"), digest_size=SIZE).digest() for s in sequences)
    return np.frombuffer(raw, np.uint8).reshape(-1, SIZE).copy()
