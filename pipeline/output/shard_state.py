"""What each shard of a run holds on disk, read one way by `status`, `rerun` and the workers.

A shard is complete when `shard_N.h5` holds exactly its rows (and, verified, reads back byte for byte);
otherwise its durable rows are the distinct positions in the checkpoints of `shard_N.parts/` that read
back intact. Because all three read shards through this module they count the same rows: a checkpoint
that fails its checksums counts for nobody, and a count never exceeds the shard's size.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..advice import command
from .h5io import CorruptFile, Reader
from ..rundir.layout import RunDir

log = logging.getLogger(__name__)

# `status` reads every byte of finished shards and checkpoints (their checksums) when they total at most
# this much (a few seconds of reading); above it, it says which it did not verify, and `--verify` forces it.
VERIFY_AUTO_BYTES = 2 * 10**9


@dataclass
class ShardState:
    rank: int
    state: str          # complete, partial, pending, failed, interrupted, corrupt (`status` adds running)
    expected: int
    durable: int
    detail: str = ""
    verified: bool = False   # checksums were read back (for a complete shard, or every checkpoint)


def part_files(parts_dir: Path) -> list[Path]:
    return sorted(parts_dir.glob("part_*.h5")) if parts_dir.is_dir() else []


def set_aside(path: Path) -> Path:
    """Rename a damaged file to `NAME.corrupt` (kept for inspection, never read again), or to
    `NAME.corrupt.2`, `.3`, ... when earlier ones are there: none is overwritten."""
    aside, k = path.with_name(path.name + ".corrupt"), 2
    while aside.exists():
        aside, k = path.with_name(f"{path.name}.corrupt.{k}"), k + 1
    path.rename(aside)
    verified_path(path).unlink(missing_ok=True)
    return aside


def restore_set_aside(run: RunDir, expected: np.ndarray, rank: int) -> Path | None:
    """Put back a shard file set aside earlier that holds exactly shard `rank`'s rows (the FASTA positions
    `expected`) and reads back intact, when the shard has no file of its own; the name it had, or None.
    (Earlier versions set good shards aside when a continued run changed its number of workers.)"""
    path = run.shard_path(rank)
    if path.exists():
        return None
    expected = np.sort(np.asarray(expected, np.int64))
    for aside in sorted(path.parent.glob(path.name + ".corrupt*")):
        if complete_problem(aside, expected, verify=True) is None:
            aside.rename(path)
            return aside
    return None


def durable_positions(parts_dir: Path, verify: bool, set_aside_corrupt: bool = False
                      ) -> tuple[np.ndarray, list[str]]:
    """The distinct FASTA positions held by the intact checkpoints in `parts_dir`, and the names of the
    damaged ones (set aside as `.corrupt` with `set_aside_corrupt`: only the shard's writer may)."""
    found, bad = [], []
    for part in part_files(parts_dir):
        try:
            with Reader(part) as r:
                if verify:
                    r.verify()   # a checkpoint counts only if every byte reads back as written
                found.append(r.index_column())
        except CorruptFile as e:
            if not part.exists():   # removed since it was listed: its writer finished the shard (or set it aside)
                continue
            bad.append(part.name)
            if set_aside_corrupt:
                log.warning("checkpoint %s is corrupt (%s); its rows will be computed again", part.name, e)
                set_aside(part)
    done = np.unique(np.concatenate(found)) if found else np.zeros(0, np.int64)
    return done, bad


def complete_problem(path: Path, expected: np.ndarray, verify: bool) -> str | None:
    """None when the shard file at `path` holds exactly the `expected` positions (sorted) and, with
    `verify`, passes its checksums; otherwise what is wrong with it."""
    try:
        with Reader(path) as r:
            if r.rows != len(expected) or not np.array_equal(r.index_column(), expected):
                return f"{r.rows:,} rows, not this shard's {len(expected):,}"
            if verify:
                r.verify()
    except CorruptFile as e:
        return str(e)
    return None


def verified_path(path: Path) -> Path:
    """Where the state of a finished shard file is recorded once its rows were checked (`shard_N.verified`)."""
    return path.with_name(path.stem + ".verified")


def _stat_key(path: Path) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def record_verified(path: Path, rows: int) -> None:
    """Record that the shard file at `path` holds exactly its `rows` rows and passed its checksums, for
    the file as it is now (its size, modification time and inode): `status` then trusts it without opening
    it, until the file changes. A failure to record is not an error: the file is read instead."""
    record = verified_path(path)
    tmp = record.with_name(f".{record.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(dict(_stat_key(path), rows=rows)))
        os.replace(tmp, record)
    except OSError as e:
        log.info("could not record %s (%s); `status` reads the shard instead", record.name, e)
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass   # a read-only file system refuses even that, where nothing was written (`status` works there)


def recorded_verified(path: Path, rows: int) -> bool:
    """Whether `path` is the very file recorded as verified with `rows` rows."""
    try:
        record = json.loads(verified_path(path).read_text())
        return record == dict(_stat_key(path), rows=rows)
    except (OSError, ValueError):
        return False


def stored_bytes(run: RunDir, world: int) -> int:
    """Bytes of every finished shard and checkpoint: what verifying them all reads."""
    total = 0
    for r in range(world):
        for f in [run.shard_path(r)] + part_files(run.parts_dir(r)):
            try:
                total += f.stat().st_size
            except FileNotFoundError:   # not there, or a checkpoint its worker removed once the shard was written
                pass
    return total


def every_row_durable(state: str, durable: int, expected: int) -> bool:
    """Whether a shard its files call unfinished has every row in its checkpoints: its worker stopped after the
    last and before it wrote the shard file. A rerun computes nothing for it; a complete merged result (`merge
    --allow-partial`) took its rows from them, and then it is complete (status listed it as failed beside "the
    run is finished")."""
    return state in ("failed", "interrupted", "partial") and expected > 0 and durable == expected


def inspect(run: RunDir, expected: np.ndarray | Callable[[], np.ndarray], rank: int, verify_shard: bool | None,
            verify_parts: bool = False, count: int | None = None) -> ShardState:
    """The state of shard `rank`, whose rows are the FASTA positions `expected` (or a function returning
    them, called only when a file must be compared with them; then `count` says how many there are);
    `verify_*` read back every byte of a finished shard file / of the checkpoints (their checksums) instead
    of only their headers. `verify_shard` None or False: a shard file recorded as verified (`record_verified`)
    and unchanged since is trusted without opening it; others are read back (None) or their headers read
    (False). True reads every shard file back."""
    positions = None if callable(expected) else np.sort(np.asarray(expected, np.int64))

    def wanted() -> np.ndarray:
        nonlocal positions
        if positions is None:
            positions = np.sort(np.asarray(expected(), np.int64))
        return positions
    n = len(positions) if positions is not None else int(count)
    path = run.shard_path(rank)
    if n == 0 and not path.exists():   # (a run that copies every row: its one shard has nothing to compute)
        return ShardState(rank, "complete", 0, 0, verified=True)
    if path.exists():
        if verify_shard is not True and recorded_verified(path, n):
            return ShardState(rank, "complete", n, n, verified=True)
        problem = complete_problem(path, wanted(), verify_shard is not False)
        if problem is None:
            if verify_shard is not False:
                record_verified(path, n)
            return ShardState(rank, "complete", n, n, verified=verify_shard is not False)
        return ShardState(rank, "corrupt", n, 0, f"{problem}; `{command('rerun', run.root)}` "
                          "computes it again", verified=verify_shard is not False)
    verify = verify_parts
    done, bad = durable_positions(run.parts_dir(rank), verify)
    if path.exists():   # its worker wrote the shard file (and removed its checkpoints) while they were read
        return inspect(run, expected, rank, verify_shard, verify_parts, count)
    durable = int(np.isin(done, wanted()).sum()) if len(done) else 0
    failure = run.failure(rank)
    details = []
    if failure:
        details.append(f"last run: {failure.summary()}")
    if bad:
        details.append(f"corrupt checkpoint(s) {', '.join(bad)} will be recomputed")
    if failure:
        state = "interrupted" if failure.interrupted else "failed"
    else:
        state = "partial" if durable else "pending"
    return ShardState(rank, state, n, durable, "; ".join(details), verified=verify)
