"""The rows of one batch, in three parts so that the worker can overlap them with the device: `prepare` (the
host's part: read the records, statuses (empty, too long, unknown residues), tokenize, digest), `launch` (the
engine run and the task's device work queued, an out-of-memory batch split in two until it fits) and `finish`
(wait for the results, assemble a RowBlock). `rows` does all three in turn."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from .. import faults
from ..engine.interface import OutOfMemory
from ..errors import UserError
from ..output import status_codes as sc
from ..output.schema import BASE_COLUMNS, RowBlock, ragged_values
from ..output.sequence_digest import digests
from ..tasks.task import PendingOutput
from ..tasks.tokenization import Tokenized
from .token_counts import Encoded

log = logging.getLogger("run_shards.worker")

_BASE = {c.path for c in BASE_COLUMNS}


@dataclass
class PreparedBatch:
    """A batch as the host reads it, before any device work: per row of `todo` (FASTA positions) its length,
    status, truncation and digest, and the rows to compute with their tokens."""
    todo: np.ndarray
    lengths: np.ndarray                      # int32 residues (a residue + 3Di pair is one)
    status: np.ndarray                       # int8 status codes
    truncated: np.ndarray                    # bool
    digest: np.ndarray                       # uint8 [n, 16]
    compute: list[tuple[int, Tokenized]]     # (row in todo, its tokens) of the rows the engine runs


@dataclass
class LaunchedBatch:
    """A batch whose device work is queued: each group of rows (the batch, or its halves after an out of
    memory) with its task output to come, or None for a group that did not fit even alone."""
    prepared: PreparedBatch
    groups: list[tuple[list[tuple[int, Tokenized]], PendingOutput | None]]


class BatchComputer:
    """Rows for a batch of positions: statuses, tokenization, the engine (split on OOM), the task."""

    def __init__(self, index, engine, task, tokenizer, schema, config, limit: int | None, windows=None,
                 encoded: Encoded | None = None):
        """`encoded`: encodings made while planning (token_counts.py), taken instead of encoding again."""
        self.index, self.engine, self.task, self.tokenizer = index, engine, task, tokenizer
        self.schema, self.config, self.limit, self.windows = schema, config, limit, windows
        self.encoded = encoded

    def row_bytes(self, positions: np.ndarray) -> np.ndarray:
        return self.schema.row_bytes(ragged_values(self.config.task, self.config.max_new_tokens,
                                                   self.index.lengths[positions]))

    def rows(self, todo: np.ndarray) -> tuple[RowBlock, int]:
        """The batch's RowBlock and the tokens the engine ran for it, one part after the other."""
        return self.finish(self.launch(self.prepare(todo)))

    def prepare(self, todo: np.ndarray) -> PreparedBatch:
        """The host's part (no device work): InputChanged when a record no longer holds what the index says,
        UserError for a sequence over the model's limit that the task runs (unless --on-long skip)."""
        n = len(todo)
        lengths = self.index.lengths[todo].astype(np.int32)
        status = np.zeros(n, np.int8)
        truncated = np.zeros(n, bool)
        status[lengths == 0] = sc.EMPTY
        candidates = np.flatnonzero(lengths > 0)
        # (A batch of empty records only has nothing to tokenize: tokenizers fail on an empty list.)
        convention = self.tokenizer.convention   # (structure input keeps its case; a residue + 3Di pair is one)
        texts = [self.index.sequence(int(todo[i]), convention.keeps_case) for i in candidates]
        if convention.paired_with:
            lengths[candidates] = [convention.count(t) for t in texts]
        toks = self._encode(todo[candidates], texts)
        digest = np.repeat(digests([""]), n, axis=0)   # (an empty record's digest is the empty text's)
        digest[candidates] = digests(texts)
        compute = []
        for i, t in zip(candidates, toks):
            if self.limit and len(t.ids) > self.limit and not self.windows \
                    and self.task.runs(int(todo[i])):   # (only when not truncating)
                if self.config.on_long == "skip":
                    status[i] = sc.SKIPPED_TOO_LONG
                    continue
                raise UserError(f"sequence '{self.index.id(int(todo[i]))}' has {len(t.ids)} tokens, over the "
                                f"model's limit of {self.limit}; choose --on-long truncate or skip")
            truncated[i] = t.truncated
            if t.unknown:
                status[i] = sc.UNKNOWN_RESIDUES
            compute.append((int(i), t))
        return PreparedBatch(todo, lengths, status, truncated, digest, compute)

    def _encode(self, positions: np.ndarray, texts: list[str]) -> list[Tokenized]:
        """The records' tokens: those kept while planning, the others encoded in one call."""
        if not texts:
            return []
        if not self.encoded:
            return self.tokenizer.encode(texts)
        found = [self.encoded.take(int(p), t) for p, t in zip(positions, texts)]
        rest = [i for i, tok in enumerate(found) if tok is None]
        if rest:
            for i, tok in zip(rest, self.tokenizer.encode([texts[i] for i in rest])):
                found[i] = tok
        return found

    def launch(self, batch: PreparedBatch) -> LaunchedBatch:
        """The engine and the task's device work queued (on a CPU: done) for the rows to compute."""
        groups = self._run(batch.compute, batch.todo) if batch.compute else []
        return LaunchedBatch(batch, groups)

    def finish(self, launched: LaunchedBatch) -> tuple[RowBlock, int]:
        """Wait for the batch's results and assemble its RowBlock; also the tokens the engine ran for it."""
        batch = launched.prepared
        n, todo, status = len(batch.todo), batch.todo, batch.status.copy()
        num_tokens = np.zeros(n, np.int32)
        columns = {c.path: c.empty(n) for c in self.schema.row_columns if c.path not in _BASE}
        ragged_lengths = {g: np.zeros(n, np.int64) for g in self.schema.ragged_groups}
        values = {c.path: [] for c in self.schema.ragged_columns}
        computed = 0   # tokens the engine ran: the rows' own, or what the task says (masked copies)
        for items, pending in launched.groups:
            rows = np.array([i for i, _ in items])
            if pending is None:
                status[rows] = sc.OUT_OF_MEMORY
                continue
            out = pending.result()
            num_tokens[rows] = [len(t.ids) for _, t in items]
            computed += out.computed_tokens if out.computed_tokens is not None else int(num_tokens[rows].sum())
            if self.windows:
                columns["windows"][rows] = [self.windows.count(len(t.ids)) for _, t in items]
            for k, v in out.columns.items():
                columns[k][rows] = v
            for g, lens in out.lengths.items():
                ragged_lengths[g][rows] = lens
            for k, v in out.values.items():
                values[k].append(v)
        columns.update({
            "ids": np.array([self.index.id_bytes(int(p)) for p in todo], dtype=object),
            "index": todo.astype(np.int64), "lengths": batch.lengths, "num_tokens": num_tokens,
            "truncated": batch.truncated, "status": status, "sequence_digest": batch.digest,
        })
        values = {c.path: np.concatenate(values[c.path]) if values[c.path] else c.empty(0)
                  for c in self.schema.ragged_columns}
        return RowBlock(self.schema, columns, values, ragged_lengths), computed

    def _run(self, items: list, todo: np.ndarray) -> list:
        """[(items, PendingOutput or None)] in item order; an out-of-memory batch is halved until it fits."""
        try:
            batch = [t.ids for _, t in items]
            faults.maybe_out_of_memory(batch, padded=self.engine.info.name == "hf")
            return [(items, self.task.launch(self.engine, [t for _, t in items], todo[[i for i, _ in items]]))]
        except (OutOfMemory, torch.OutOfMemoryError) as e:
            _release_memory()
            if len(items) == 1:
                log.warning("out of memory on a single sequence of %d tokens (%s); marking it",
                            len(items[0][1].ids), str(e).splitlines()[0] if str(e) else "OOM")
                return [(items, None)]
            half = len(items) // 2
            log.info("out of memory on a batch of %d sequences; splitting it in two", len(items))
            return self._run(items[:half], todo) + self._run(items[half:], todo)


def _release_memory() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
