"""Output rows in memory: the column schema every output file shares, and blocks of rows.

A column is either one value per row (`ids`, `embeddings/mean`, ...) or ragged: a variable number of
values per row stored CSR-style, values back to back plus an `offsets` dataset in the same group
(`per_residue/values` + `per_residue/offsets`). In memory a ragged group keeps per-row lengths instead.
Every file has the BASE_COLUMNS and its task's columns; the merged result also has RESULT_COLUMNS, which
say where each row's values were computed (a row copied from an identical sequence, or reused from an
earlier result with --reuse, holds the values of that computation).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from index.spill import ragged_arange

STR = "str"  # dtype marker for utf-8 string columns


def ragged_values(task: str, max_new_tokens: int, lengths) -> np.ndarray:
    """Values each row holds in its ragged columns, at most, for records of `lengths` residues: one per residue
    (per-residue values), or with --task generate its new tokens, --max-new-tokens (a row its EOS stops holds
    fewer). What row_bytes takes for a run's rows."""
    lengths = np.asarray(lengths, np.int64)
    return np.full_like(lengths, max_new_tokens) if task == "generate" else lengths


def ragged_total(task: str, max_new_tokens: int, rows: int, residues: int) -> int:
    """ragged_values summed over `rows` records of `residues` residues in all (a shard's, from the index's
    length histogram)."""
    return rows * max_new_tokens if task == "generate" else residues


@dataclass(frozen=True)
class Column:
    path: str           # HDF5 dataset path
    dtype: str          # numpy dtype name, or STR
    width: int = 0      # 0: one scalar per row (or value); D: a vector of D per row (or value)
    ragged: bool = False

    @property
    def group(self) -> str:
        """Ragged columns of the same HDF5 group share one offsets dataset."""
        return self.path.rsplit("/", 1)[0]

    def value_bytes(self) -> int:
        """Bytes of one value: a row's, or one of a ragged row's values (a string counts 16, its text apart)."""
        return 16 if self.dtype == STR else np.dtype(self.dtype).itemsize * max(1, self.width)

    def empty(self, n: int) -> np.ndarray:
        shape = (n, self.width) if self.width else (n,)
        if self.dtype == STR:
            return np.full(shape, "", dtype=object)
        fill = np.nan if np.dtype(self.dtype).kind == "f" else 0
        return np.full(shape, fill, dtype=self.dtype)


# Per-residue rows (the `per_residue` group) are residues for every tokenizer. How they come from the tokens
# (the root attribute `per_residue_tokens`, and `token_spread` of the group):
PER_RESIDUE_UNIT = "residue"
ONE_TOKEN_PER_RESIDUE = "one token per residue"
TOKEN_STATE_ON_ITS_RESIDUES = "each token's vector on every residue it covers; tokens covering none give no row"
TOKEN_LOGPROB_SHARED = ("each token's log-probability shared equally among the residues it covers; tokens "
                        "covering none give no row")


def group_attrs(group: str, file_attrs: dict) -> dict:
    """The attributes of a ragged group in a file with root attributes `file_attrs`: the `per_residue` group
    says its unit (`unit`, always residues) and how its rows come from the tokens (`token_spread`: one token
    per residue where a task records nothing else, as masked-LM scores need)."""
    if group != "per_residue":
        return {}
    return {"unit": file_attrs.get("per_residue_unit", PER_RESIDUE_UNIT),
            "token_spread": file_attrs.get("per_residue_tokens", ONE_TOKEN_PER_RESIDUE)}


BASE_COLUMNS = (
    Column("ids", STR),
    Column("index", "int64"),
    Column("lengths", "int32"),
    Column("num_tokens", "int32"),
    Column("truncated", "bool"),
    Column("status", "int8"),
    Column("sequence_digest", "uint8", 16),   # sequence_digest.py
)

# Only in the merged result (written by the merge, result_rows.py):
RESULT_COLUMNS = (
    Column("computed_at", "int64"),   # the `index` of the row whose computation this row holds: its own, or
                                      # the first record of the same sequence in this run (a copy of it)
    Column("reused_from", "int16"),   # -1: computed by this run; k: reused from the k-th --reuse result
)                                     # (the result's `reused_from` attribute lists them)


@dataclass
class Schema:
    columns: tuple[Column, ...]

    def __post_init__(self):
        self.columns = tuple(self.columns)

    @property
    def row_columns(self) -> list[Column]:
        return [c for c in self.columns if not c.ragged]

    @property
    def ragged_columns(self) -> list[Column]:
        return [c for c in self.columns if c.ragged]

    @property
    def ragged_groups(self) -> list[str]:
        return sorted({c.group for c in self.ragged_columns})

    def row_bytes(self, values_per_row: np.ndarray) -> np.ndarray:
        """Bytes each row takes in an output file, given how many values each row holds in the ragged
        columns (for per-residue values, its residues): the one estimate the planner, the workers, the merge
        and `status` size memory and disk by."""
        fixed = sum(c.value_bytes() for c in self.row_columns) + 8 * len(self.ragged_groups)   # + offsets
        per_value = sum(c.value_bytes() for c in self.ragged_columns)
        return fixed + per_value * np.asarray(values_per_row, np.int64)

    def result_bytes(self, index, values_per_row: np.ndarray) -> int:
        """Bytes of a whole file of this schema with a row for every record of `index` (a SequenceIndex):
        row_bytes, plus the ids' text."""
        return int(self.row_bytes(values_per_row).sum()) + int(index.id_offsets[-1])

    def with_result_columns(self) -> "Schema":
        """The merged result's schema: these columns and RESULT_COLUMNS (once)."""
        have = {c.path for c in self.columns}
        return Schema(self.columns + tuple(c for c in RESULT_COLUMNS if c.path not in have))

    def without_result_columns(self) -> "Schema":
        """The columns a worker writes (a result's schema without RESULT_COLUMNS)."""
        extra = {c.path for c in RESULT_COLUMNS}
        return Schema(tuple(c for c in self.columns if c.path not in extra))

    def to_json(self) -> list:
        return [[c.path, c.dtype, c.width, c.ragged] for c in self.columns]

    @classmethod
    def from_json(cls, data: list) -> "Schema":
        return cls(tuple(Column(p, d, int(w), bool(r)) for p, d, w, r in data))


class RowBlock:
    """Rows of one schema: per-row arrays, ragged value arrays and per-row lengths of each ragged group."""

    def __init__(self, schema: Schema, columns: dict[str, np.ndarray], values: dict[str, np.ndarray] | None = None,
                 lengths: dict[str, np.ndarray] | None = None):
        self.schema = schema
        self.columns = columns
        self.values = values or {}
        self.lengths = lengths or {}
        n = len(columns["index"])
        assert all(len(a) == n for a in columns.values()), "row columns of different lengths"
        for c in schema.ragged_columns:
            assert len(self.lengths[c.group]) == n
            assert len(self.values[c.path]) == int(self.lengths[c.group].sum())

    def __len__(self) -> int:
        return len(self.columns["index"])

    @classmethod
    def empty(cls, schema: Schema) -> "RowBlock":
        return cls(schema, {c.path: c.empty(0) for c in schema.row_columns},
                   {c.path: c.empty(0) for c in schema.ragged_columns},
                   {g: np.zeros(0, np.int64) for g in schema.ragged_groups})

    @classmethod
    def concat(cls, schema: Schema, blocks: list["RowBlock"]) -> "RowBlock":
        blocks = [b for b in blocks if len(b)]
        if not blocks:
            return cls.empty(schema)
        if len(blocks) == 1:
            return blocks[0]
        return cls(schema,
                   {c.path: np.concatenate([b.columns[c.path] for b in blocks]) for c in schema.row_columns},
                   {c.path: np.concatenate([b.values[c.path] for b in blocks]) for c in schema.ragged_columns},
                   {g: np.concatenate([b.lengths[g] for b in blocks]) for g in schema.ragged_groups})

    def take(self, rows: np.ndarray) -> "RowBlock":
        """Rows in the order given (a permutation or a subset)."""
        columns = {k: v[rows] for k, v in self.columns.items()}
        values, lengths = {}, {}
        for g in self.schema.ragged_groups:
            lens = self.lengths[g]
            starts = np.concatenate(([0], np.cumsum(lens)[:-1])).astype(np.int64)
            new_lens = lens[rows]
            gather = ragged_arange(starts[rows], new_lens)
            lengths[g] = new_lens
            for c in self.schema.ragged_columns:
                if c.group == g:
                    values[c.path] = self.values[c.path][gather]
        return RowBlock(self.schema, columns, values, lengths)

    def sorted_by_index(self) -> "RowBlock":
        order = np.argsort(self.columns["index"], kind="stable")
        if np.array_equal(order, np.arange(len(order))):
            return self
        return self.take(order)

    def nbytes(self) -> int:
        total = sum(a.nbytes for a in self.columns.values())
        return total + sum(a.nbytes for a in self.values.values())
