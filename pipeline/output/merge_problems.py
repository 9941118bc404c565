"""What a merge found wrong, with bounded memory: counts and the first few of each kind in memory, and,
given a folder, every problem spilled there as it is found (the missing positions, which a partial result
lists in `missing_ids`, and the full list that OUT/merge_problems.tsv gets when the merge is refused)."""
from __future__ import annotations

import os
from typing import Callable, Iterator

import numpy as np

SHOWN = 5
_ROW_KINDS = ("extra", "mismatched", "sequence")   # problems of one row with its id


class _Positions:
    """Positions appended in order: in memory, or in a file of int64 when given a path."""

    def __init__(self, path: str | None):
        self.path, self.count, self.first = path, 0, np.zeros(0, np.int64)
        self._mem: list[np.ndarray] = []

    def add(self, positions: np.ndarray) -> None:
        positions = np.asarray(positions, np.int64)
        if len(self.first) < SHOWN:
            self.first = np.concatenate((self.first, positions[:SHOWN - len(self.first)]))
        self.count += len(positions)
        if self.path is None:
            self._mem.append(positions)
        else:
            with open(self.path, "ab") as fh:
                fh.write(positions.tobytes())

    def chunks(self, step: int = 1 << 20) -> Iterator[np.ndarray]:
        if self.path is None:
            yield from self._mem
            return
        if not self.count:
            return
        with open(self.path, "rb") as fh:
            while True:
                data = fh.read(step * 8)
                if not data:
                    break
                yield np.frombuffer(data, np.int64)


class MergeProblems:
    """Missing, repeated, foreign and mismatched rows a merge found (see `counts`)."""

    def __init__(self, directory: str | os.PathLike | None = None):
        where = (lambda name: os.path.join(directory, name)) if directory is not None else (lambda name: None)
        self.missing = _Positions(where("missing.bin"))
        self.duplicates = _Positions(where("duplicate.bin"))
        self._rows_path = where("rows.tsv")
        self._rows: list[tuple[str, int, bytes]] = []          # every row problem (no folder), else the first
        self._row_counts = dict.fromkeys(_ROW_KINDS, 0)
        self._first_rows: dict[str, list[tuple[int, bytes]]] = {k: [] for k in _ROW_KINDS}

    # ------------------------------------------------------------------ recording
    def add_missing(self, positions: np.ndarray) -> None:
        if len(positions):
            self.missing.add(positions)

    def add_duplicates(self, positions: np.ndarray) -> None:
        if len(positions):
            self.duplicates.add(positions)

    def add_extra(self, position: int, found_id) -> None:
        """A row at a position that is not expected there."""
        self._add_row("extra", position, found_id)

    def add_mismatched(self, position: int, found_id) -> None:
        """A row whose id is not the FASTA record's at its position."""
        self._add_row("mismatched", position, found_id)

    def add_sequence(self, position: int, found_id) -> None:
        """A row whose sequence digest is not the one planned for the FASTA record at its position."""
        self._add_row("sequence", position, found_id)

    def _add_row(self, kind: str, position: int, found_id) -> None:
        self._row_counts[kind] += 1
        if len(self._first_rows[kind]) < SHOWN:
            self._first_rows[kind].append((position, found_id))
        if self._rows_path is None:
            self._rows.append((kind, position, found_id))
        else:
            with open(self._rows_path, "a") as fh:
                fh.write(f"{kind}\t{position}\t{text(found_id)}\n")

    # ------------------------------------------------------------------ reading
    def counts(self) -> dict[str, int]:
        return {"missing": self.missing.count, "duplicate": self.duplicates.count,
                "extra": self._row_counts["extra"], "mismatched": self._row_counts["mismatched"],
                "sequence": self._row_counts["sequence"]}

    def __bool__(self) -> bool:
        return any(self.counts().values())

    def missing_positions(self) -> np.ndarray:
        """Every missing position (only where they are few: a shard's merge, tests)."""
        parts = list(self.missing.chunks())
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def first(self, kind: str) -> list[tuple[int, bytes]]:
        return self._first_rows[kind]

    def row_lines(self) -> Iterator[tuple[str, int, str]]:
        """(kind, position, id) of every row problem, in the order found."""
        if self._rows_path is None:
            yield from ((k, p, text(i)) for k, p, i in self._rows)
        elif os.path.exists(self._rows_path):
            with open(self._rows_path) as fh:
                for line in fh:
                    kind, position, found = line.rstrip("\n").split("\t", 2)
                    yield kind, int(position), found


def describe_problems(problems: MergeProblems, id_of: Callable[[int], str], report=None,
                      sources: str = "the shards") -> str:
    """One clear message with counts and the first ids; the full lists go to `report`."""
    counts = problems.counts()
    lines = []
    if counts["missing"]:
        lines.append(f"{counts['missing']} sequences missing from {sources} (first: "
                     f"{', '.join(id_of(int(p)) for p in problems.missing.first)})")
    if counts["duplicate"]:
        lines.append(f"{counts['duplicate']} sequences present more than once (first: "
                     f"{', '.join(id_of(int(p)) for p in problems.duplicates.first)})")
    if counts["extra"]:
        lines.append(f"{counts['extra']} rows that belong to no FASTA record of this run (first: "
                     f"{', '.join(text(i) for _, i in problems.first('extra'))})")
    if counts["mismatched"]:
        lines.append(f"{counts['mismatched']} rows whose id differs from the FASTA record at their position "
                     f"(first: {', '.join(f'{text(i)} at record {p} ({id_of(p)})' for p, i in problems.first('mismatched'))})")
    if counts["sequence"]:
        lines.append(f"{counts['sequence']} rows whose sequence differs from the FASTA record's at their position "
                     f"(by sequence digest; first: {', '.join(f'{text(i)} at record {p}' for p, i in problems.first('sequence'))})")
    if report is not None:
        with open(report, "w") as fh:
            for kind, spill in (("missing", problems.missing), ("duplicate", problems.duplicates)):
                for chunk in spill.chunks():
                    for p in chunk.tolist():
                        fh.write(f"{kind}\t{p}\t{id_of(p)}\n")
            for kind, p, found in problems.row_lines():
                fh.write(f"{kind}\t{p}\t{found}\t{id_of(p)}\n" if kind == "mismatched" else f"{kind}\t{p}\t{found}\n")
        lines.append(f"full list: {report}")
    return "; ".join(lines)


def text(x) -> str:
    return x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x)
