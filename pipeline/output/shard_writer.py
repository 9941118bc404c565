"""Rows of one shard: buffered, made durable at each checkpoint, merged into shard_N.h5 at the end.

A checkpoint sorts the buffered rows by FASTA position and writes them as one part file (temporary name,
fsync, rename, fsync of the directory), so a part that exists is complete and a kill -9 at any instant
loses at most the rows since the last checkpoint. On start the writer reads the existing parts to learn
which positions are durable; a part that fails to read is set aside as `.corrupt` and its rows are
simply computed again. The final shard is a bounded-memory merge of the parts, marked complete only
once every row is durable; then the parts are removed.
"""
from __future__ import annotations

import logging
import os
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np

from ..advice import command
from .. import faults
from . import shard_state
from ..errors import DiskFull, RunDirError, disk_full_reason, ensure_space, make_room
from .h5io import Reader, Writer
from .sorted_merge import merge_sorted_runs
from .schema import RowBlock, Schema
from ..rundir.layout import RunDir, fsync_path

log = logging.getLogger(__name__)

MAX_BUFFER_BYTES = 512 << 20


class ShardWriter:
    def __init__(self, run: RunDir, rank: int, schema: Schema, attrs: dict, positions: np.ndarray,
                 checkpoint_sequences: int, checkpoint_seconds: float):
        self.run, self.rank, self.schema, self.attrs = run, rank, schema, attrs
        self.expected = np.sort(np.asarray(positions, np.int64))
        self.checkpoint_sequences = checkpoint_sequences
        self.checkpoint_seconds = checkpoint_seconds
        self.parts = run.parts_dir(rank)
        self.buffer: list[RowBlock] = []
        self.buffered_rows = 0
        self.buffered_bytes = 0
        self.last_checkpoint = time.monotonic()
        self._remove_stale_temporaries()
        self.complete = self._shard_complete()
        self.done = np.zeros(0, np.int64) if self.complete else self._durable_positions()

    def _remove_stale_temporaries(self) -> None:
        """Files a killed writer of this shard left half-written (only the shard lock's holder gets here)."""
        for name in self.run.remove_shard_temporaries(self.rank):
            log.info("removed %s, left half-written by an earlier worker", name)

    def _shard_complete(self) -> bool:
        path = self.run.shard_path(self.rank)
        if not path.exists():
            return False
        problem = shard_state.complete_problem(path, self.expected, verify=True)
        if problem is None:
            shard_state.record_verified(path, len(self.expected))
            return True
        log.warning("shard file cannot be used (%s); set aside as %s, its rows are computed again", problem,
                    shard_state.set_aside(path).name)
        return False

    def _durable_positions(self) -> np.ndarray:
        done, _ = shard_state.durable_positions(self.parts, verify=True, set_aside_corrupt=True)
        done = done[np.isin(done, self.expected)]
        if len(done):
            log.info("resuming: %d of %d sequences already durable", len(done), len(self.expected))
        return done

    def is_done(self, positions: np.ndarray) -> np.ndarray:
        return np.isin(positions, self.done)

    @property
    def durable_rows(self) -> int:
        return len(self.done)

    def add(self, block: RowBlock) -> None:
        self.buffer.append(block)
        self.buffered_rows += len(block)
        self.buffered_bytes += block.nbytes()

    def due(self) -> bool:
        return self.buffered_rows > 0 and (
            self.buffered_rows >= self.checkpoint_sequences
            or self.buffered_bytes >= MAX_BUFFER_BYTES
            or time.monotonic() - self.last_checkpoint >= self.checkpoint_seconds)

    def checkpoint(self) -> None:
        """Make the buffered rows durable as one sorted part file."""
        self.last_checkpoint = time.monotonic()
        if not self.buffered_rows:
            return
        self._ensure_in_place()
        block = RowBlock.concat(self.schema, self.buffer).sorted_by_index()
        self.parts.mkdir(exist_ok=True)
        existing = shard_state.part_files(self.parts)
        number = int(existing[-1].stem.split("_")[1]) + 1 if existing else 0
        final = self.parts / f"part_{number:06d}.h5"
        tmp = self.parts / f".part_{number:06d}.h5.tmp"
        ensure_space(self.parts, block.nbytes(), f"checkpoint {final}", self._remedy)
        with self._new_file(tmp, dict(self.attrs, part=number), rows_hint=len(block),
                            values_hint={g: int(v.sum()) for g, v in block.lengths.items()}) as writer:
            writer.append(block)
            faults.maybe_die("part-written", self.rank, number)
        faults.maybe_die("part-finished", self.rank, number)
        os.replace(tmp, final)
        fsync_path(self.parts)
        self.done = np.union1d(self.done, block.columns["index"])
        self.buffer, self.buffered_rows, self.buffered_bytes = [], 0, 0
        log.info("checkpoint %s: %d rows, %d tokens (%d of %d durable)", final.name, len(block),
                 int(block.columns["num_tokens"].sum(dtype=np.int64)), len(self.done), len(self.expected))

    def _ensure_in_place(self) -> None:
        """Refuse to write once the run directory has gone from under the worker (moved, removed): the parts
        folder made anew at the old place (as mkdir -p did) held rows no run would read, and the shard
        written from it lacked the rows that moved away."""
        gone = self.run.gone()
        if gone:
            raise RunDirError(gone)

    def finalize(self, row_bytes: np.ndarray) -> Path:
        """Merge the parts into shard_N.h5 (all expected rows must be durable)."""
        self.checkpoint()
        self._ensure_in_place()
        missing = np.setdiff1d(self.expected, self.done)
        assert len(missing) == 0, f"finalize with {len(missing)} rows not computed"
        path = self.run.shard_path(self.rank)
        tmp = path.with_name(f".{path.name}.tmp")
        with ExitStack() as opened:   # a part that fails to open closes those opened before it
            readers = [opened.enter_context(Reader(p, cache_bytes=0)) for p in shard_state.part_files(self.parts)]
            ensure_space(path.parent, sum(r.data_bytes() for r in readers), f"shard {path}", self._remedy)
            with self._new_file(tmp, self.attrs, rows_hint=len(self.expected)) as writer:
                problems = merge_sorted_runs(readers, writer, self.expected, row_bytes)
                assert not problems, f"checkpoints of shard {self.rank} do not add up: {problems.counts()}"
        faults.maybe_die("shard-written", self.rank, 0)
        os.replace(tmp, path)
        fsync_path(path.parent)
        shard_state.record_verified(path, len(self.expected))   # its parts were read back in full just now
        if self.parts.is_dir():   # an empty shard (fewer records than workers) never checkpointed
            for p in self.parts.glob("*"):
                p.unlink()
            self.parts.rmdir()
        self.complete = True
        return path

    @contextmanager
    def _new_file(self, tmp: Path, attrs: dict, **hints):
        """A Writer on `tmp`, finished on success; on failure removed, and a full disk said plainly."""
        try:
            writer = Writer(tmp, self.schema, attrs, **hints)
            try:
                yield writer
                writer.finish()
            except BaseException:
                writer.abort()
                raise
        except Exception as e:
            self._raise_if_full(tmp, e)
            raise

    def _remedy(self, reason: str) -> str:
        return (f"Nothing partial was kept ({self.durable_rows} rows of this shard are durable); "
                f"{make_room(reason)} and run `{command('rerun', self.run.root)}`")

    def _raise_if_full(self, path: Path, error: Exception) -> None:
        reason = disk_full_reason(error)
        if reason:
            path.unlink(missing_ok=True)
            raise DiskFull(f"cannot write {path.parent}/{path.name.strip('.').removesuffix('.tmp')}: {reason}. "
                           + self._remedy(reason)) from None
