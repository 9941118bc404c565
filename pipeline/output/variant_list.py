"""The variants of a `--task variants` run: the mutant notation, and the run directory's copy of the list
(OUT/variants.npz: each variant's record and mutant, in the file's order), which the workers and the merge
read so that they need nothing but the run directory.

Notation (ProteinGym's): a substitution is the wild-type letter, the 1-based position in the FASTA record
and the mutant letter, `A23V`; a multi-mutant joins substitutions with `:`, `A23V:G45D`. Letters are the 20
standard amino acids.
"""
from __future__ import annotations

import io
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..rundir.layout import write_atomic

AMINO_ACIDS = "ACDEFGHIKLMNPQRSTVWY"
_SUBSTITUTION = re.compile(r"([A-Za-z])([0-9]+)([A-Za-z])")
FORMAT = 1


@dataclass(frozen=True)
class Substitution:
    wild_type: str     # one of AMINO_ACIDS
    position: int      # 1-based, in the FASTA record
    mutant: str        # one of AMINO_ACIDS


class MalformedMutant(ValueError):
    """A mutant that is not in the notation; the message says what is wrong with it."""


def parse_mutant(text: str) -> tuple[Substitution, ...]:
    """The substitutions of a mutant such as `A23V` or `A23V:G45D`, ordered by position."""
    if not text.strip():
        raise MalformedMutant("the mutant is empty (expected e.g. A23V, or A23V:G45D)")
    subs = []
    for part in text.strip().split(":"):
        m = _SUBSTITUTION.fullmatch(part.strip())
        if m is None:
            raise MalformedMutant(f"'{part}' is not a substitution such as A23V (wild-type letter, 1-based "
                                  "position, mutant letter; several joined by ':')")
        wild, pos, mut = m[1].upper(), int(m[2]), m[3].upper()
        for letter in (wild, mut):
            if letter not in AMINO_ACIDS:
                raise MalformedMutant(f"'{part}': {letter} is not one of the 20 standard amino acids {AMINO_ACIDS}")
        if pos < 1:
            raise MalformedMutant(f"'{part}': positions start at 1")
        subs.append(Substitution(wild, pos, mut))
    positions = [s.position for s in subs]
    if len(set(positions)) != len(positions):
        raise MalformedMutant(f"'{text}' changes position {_repeated(positions)} twice")
    return tuple(sorted(subs, key=lambda s: s.position))


def _repeated(values: list[int]) -> int:
    seen = set()
    for v in values:
        if v in seen:
            return v
        seen.add(v)
    raise AssertionError("no repeated value")


@dataclass
class VariantList:
    """Every variant of the file, in its order: the FASTA position of its record and its mutant text."""
    record: np.ndarray          # int64 [n]
    mutant: list[str]           # [n]
    source: str = ""            # the file it was read from
    sha256: str = ""            # of that file's bytes

    def __len__(self) -> int:
        return len(self.record)

    def rows_by_record(self) -> dict[int, np.ndarray]:
        """record -> its variants' rows (file order)."""
        order = np.argsort(self.record, kind="stable")
        records, starts = np.unique(self.record[order], return_index=True)
        bounds = list(starts) + [len(order)]
        return {int(r): order[bounds[i]:bounds[i + 1]] for i, r in enumerate(records)}

    def counts(self, records: int) -> np.ndarray:
        """int64 [records]: how many variants each record has."""
        return np.bincount(self.record, minlength=records).astype(np.int64)

    def save(self, path: Path) -> None:
        """Written under a temporary name, fsynced and renamed into place (rundir.layout.write_atomic)."""
        encoded = [m.encode() for m in self.mutant]
        offsets = np.zeros(len(encoded) + 1, np.int64)
        np.cumsum([len(b) for b in encoded], out=offsets[1:])
        blob = np.frombuffer(b"".join(encoded), np.uint8)
        npz = io.BytesIO()
        np.savez(npz, format=np.int64(FORMAT), record=self.record.astype(np.int64), blob=blob,
                 offsets=offsets, source=np.array(self.source), sha256=np.array(self.sha256))
        write_atomic(path, npz.getvalue())

    @classmethod
    def load(cls, path: Path) -> "VariantList":
        with np.load(path) as f:
            if int(f["format"]) != FORMAT:
                raise ValueError(f"{path}: variants format {int(f['format'])}, expected {FORMAT}")
            blob, offsets = f["blob"].tobytes(), f["offsets"]
            mutant = [blob[offsets[i]:offsets[i + 1]].decode() for i in range(len(offsets) - 1)]
            return cls(f["record"].astype(np.int64), mutant, str(f["source"]), str(f["sha256"]))
