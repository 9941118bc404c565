"""The merged result, OUT/result.h5: every shard of this run, validated and placed in FASTA order.

Shards must come from this very run (schema, task, model, index) and add up to the index exactly: no row
missing, repeated, foreign or with another id. A shard that fails its checksums is set aside so `rerun`
computes it again; every damaged shard is named at once. The result is written under a temporary name
and renamed into place, so an existing result.h5 is always a finished, validated one.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import h5py
import numpy as np

from index import SequenceIndex

from ..advice import command
from ..errors import DiskFull, MergeError, disk_full_reason, ensure_open_files, ensure_space, make_room
from . import copy_plan, heap
from .copy_plan import CopyPlan
from .h5io import CorruptFile, Reader, Writer
from .id_index import IdIndexWriter
from .merge_problems import MergeProblems, describe_problems
from .result_rows import ResultRows
from .sorted_merge import merge_sorted_runs
from .schema import Schema
from ..rundir.layout import RunDir, fsync_path
from .shard_state import set_aside
from . import variants

log = logging.getLogger("run_shards")


def merge_result(run: RunDir, manifest: dict, index: SequenceIndex, allow_partial: bool) -> Path:
    """Merge the shards into OUT/result.h5 in FASTA order, validated; atomic rename into place."""
    schema = Schema.from_json(manifest["schema"])
    world = manifest["world"]
    readers, not_ready = [], []
    sizes = index.shard_stats(world).sequences
    # every shard is held open while the rows are merged (and, with --allow-partial, each checkpoint of one)
    held = sum(1 for r in range(world) if run.shard_path(r).exists())
    if allow_partial:
        held += sum(len(list(run.parts_dir(r).glob("part_*.h5"))) for r in range(world) if run.parts_dir(r).is_dir())
    again = command("merge", run.root, *(["--allow-partial"] if allow_partial else []))
    ensure_open_files(held, f"the shards of {run.root}", "Raise it (`ulimit -Hn` as root, or ask your "
                      f"administrator) and run `{again}`")
    try:
        for r in range(world):
            path = run.shard_path(r)
            if sizes[r] == 0 and not path.exists():
                continue   # nothing to compute (a run that copies every row): no file, nothing to merge from it
            if path.exists():
                try:
                    readers.append(_check_shard(Reader(path, cache_bytes=0), manifest, r, run))
                    continue
                except CorruptFile as e:
                    not_ready.append(f"shard {r} is corrupt ({e})")
            else:
                not_ready.append(f"shard {r} is not finished")
            if allow_partial:
                for part in sorted(run.parts_dir(r).glob("part_*.h5")) if run.parts_dir(r).is_dir() else []:
                    try:
                        readers.append(_check_shard(Reader(part, cache_bytes=0), manifest, r, run))
                    except CorruptFile as e:
                        log.warning("skipping corrupt checkpoint %s: %s", part, e)
        if not_ready and _kept_whole(run, not_ready):   # (never replaced by fewer rows, whatever was asked)
            return run.result_path
        if not_ready and not allow_partial:
            not_ready += _damaged_among(readers)
            raise MergeError("cannot merge: " + "; ".join(not_ready) +
                             f". Run `{command('rerun', run.root)}` (or "
                             f"`{command('merge', run.root, '--allow-partial')}` for the rows that exist).")
        return _write(run, manifest, index, schema, readers, allow_partial)
    finally:
        for r in readers:
            r.close()


def _kept_whole(run: RunDir, not_ready: list[str]) -> bool:
    """Whether OUT/result.h5 is a complete result already, which shards that are gone or unfinished (`not_ready`)
    could only replace with fewer rows: True (nothing to merge) where it reads back intact; a MergeError naming
    both where it fails its checksums; False where there is no complete result."""
    try:
        with Reader(run.result_path) as whole:
            if not whole.attrs.get("complete"):
                return False
            rows = whole.rows
            try:
                whole.verify()
            except CorruptFile as e:
                raise MergeError(f"{run.result_path} holds all {rows:,} rows of the run but fails its checksums ({e}), "
                                 f"and its shards cannot give it again: {'; '.join(not_ready)}. Set it aside "
                                 f"(`mv {run.result_path} {run.result_path}.corrupt`) and run "
                                 f"`{command('rerun', run.root)}`, which computes the shards and merges") from None
    except (OSError, CorruptFile):
        return False
    log.info("%s is complete: %s holds all %s rows, checksums verified; nothing was merged again (its shards could "
             "give only fewer: %s)", run.root, run.result_path.name, f"{rows:,}", "; ".join(not_ready))
    return True


def _damaged_among(readers: list[Reader]) -> list[str]:
    """Finished shards that fail their checksums, so a refusal names every shard `rerun` must compute."""
    found = []
    for r in readers:
        try:
            with Reader(r.path) as fresh:
                fresh.verify()
        except CorruptFile as e:
            found.append(f"shard file {r.path.name} is corrupt ({e}); `rerun` computes it again")
    return found


def _write(run: RunDir, manifest: dict, index: SequenceIndex, schema: Schema, readers: list[Reader],
           allow_partial: bool) -> Path:
    attrs = dict(manifest["attrs"])
    tmp = run.result_path.with_name(f".{run.result_path.name}.tmp")
    again = command('merge', run.root, *(['--allow-partial'] if allow_partial else []))

    def remedy(reason: str) -> str:
        return f"The shards are intact; {make_room(reason)} and run `{again}`"
    plan = CopyPlan(run.copies_path) if run.copies_path.exists() else None
    if plan is not None:
        attrs.update(reused_from=[s.given for s in plan.sources], copies=plan.counts)
        try:
            copy_plan.check_sources(run, manifest, plan)
        except BaseException:
            plan.close()
            raise
    ensure_space(run.root, sum(r.data_bytes() for r in readers), f"the result {run.result_path}", remedy)
    heap.return_freed_arrays()   # resident memory stays at a window's
    work = tempfile.mkdtemp(prefix=".rs-merge-", dir=run.root)   # spill files (a killed merge's: rundir removes them)
    writer = None
    try:
        ids_at = lambda p: _ids_at(index, p)  # noqa: E731
        rows = ResultRows(index, schema, plan, work, ids_at)
        writer = Writer(tmp, rows.schema, attrs, rows_hint=len(index))
        ids = IdIndexWriter(len(index), work)
        problems = MergeProblems(work)
        try:
            rows.gather_reused()
            merge_sorted_runs(readers, _Indexing(writer, ids), rows.windows(), expected_ids=ids_at,
                              problems=problems, complete=rows.complete, schema=schema)
        except CorruptFile as e:
            raise MergeError(_set_aside_shards(run, e)) from None
        counts = problems.counts()
        only_missing = not any(v for k, v in counts.items() if k != "missing")
        if problems and not (allow_partial and only_missing):
            message = describe_problems(problems, index.id, run.problems_path)
            raise MergeError(f"merge refused, {message}")
        missing = counts["missing"]
        _write_missing_ids(writer.file, index, problems)
        _write_original_ids(writer.file, index.meta.get("renamed_ids") or {})
        variants.add_to_result(writer.file, run, manifest)
        ids.write(writer.file)
        writer.finish({"complete": missing == 0, "num_missing": int(missing)})
    except BaseException as e:
        if writer is not None:
            writer.abort()
        reason = disk_full_reason(e) if isinstance(e, Exception) else None
        if reason:
            raise DiskFull(f"cannot write {run.result_path}: {reason}. No result file was left behind. "
                           f"{remedy(reason)}") from None
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if plan is not None:
            plan.close()
    os.replace(tmp, run.result_path)
    fsync_path(run.root)
    variants.export(run, manifest)
    run.problems_path.unlink(missing_ok=True)
    if missing:
        log.warning("partial result: %d of %d sequences missing (listed in `missing_ids`)", missing, len(index))
    if plan is not None:   # (the plan's counts: of a partial result, what was planned)
        log.info("rows%s: %s", f" as planned ({missing:,} missing from this partial result)" if missing else "",
                 copy_plan.summary(plan.counts, [s.given for s in plan.sources], planned=bool(missing)))
    log.info("merged %d sequences into %s", len(index) - missing, run.result_path)
    return run.result_path


def _write_original_ids(file: h5py.File, renamed: dict) -> None:
    """The FASTA's own ids of the records whose ids the run renamed (e.g. duplicates), by FASTA position."""
    if not renamed:
        return
    pos = np.array(sorted(int(k) for k in renamed), np.int64)
    file.create_dataset("original_ids/index", data=pos)
    file.create_dataset("original_ids/ids", dtype=h5py.string_dtype("utf-8"),
                        data=np.array([renamed[str(p)].encode() for p in pos], dtype=object))


def _write_missing_ids(file: h5py.File, index: SequenceIndex, problems: MergeProblems) -> None:
    """`missing_ids`: the ids without a row, in FASTA order, written a chunk at a time."""
    text = h5py.string_dtype("utf-8")
    count = problems.missing.count
    if count == 0:
        file.create_dataset("missing_ids", shape=(0,), dtype=text)
        return
    dataset = file.create_dataset("missing_ids", shape=(count,), dtype=text, chunks=(min(count, 65536),))
    at = 0
    for chunk in problems.missing.chunks():
        chunk = np.sort(chunk)   # (each window's are sorted, and windows come in order)
        dataset[at:at + len(chunk)] = np.array([index.id_bytes(int(p)) for p in chunk], dtype=object)
        at += len(chunk)
        index.release()


def _ids_at(index: SequenceIndex, positions: np.ndarray) -> np.ndarray:
    """The ids at sorted `positions` (one merge window), read from the span of the index they cover."""
    if len(positions) == 0:
        return np.zeros(0, object)
    lo, hi = int(positions[0]), int(positions[-1]) + 1
    offs = np.asarray(index.id_offsets[lo:hi + 1], np.int64)
    blob = index.id_blob[int(offs[0]):int(offs[-1])].tobytes()
    rel = (offs - offs[0]).tolist()
    out = np.array([blob[rel[i - lo]:rel[i - lo + 1]] for i in positions.tolist()], dtype=object)
    index.release()
    return out


class _Indexing:
    """The result's writer as the merge sees it, feeding each appended row's id to the id index."""

    def __init__(self, writer: Writer, ids: IdIndexWriter):
        self.writer, self.ids, self.schema = writer, ids, writer.schema

    def append(self, block) -> None:
        self.writer.append(block)
        self.ids.add(block.columns["ids"])


def _set_aside_shards(run: RunDir, error: CorruptFile) -> str:
    """Finished shards that fail their checksums are renamed aside so `rerun` computes them again."""
    message = f"merge refused: {error}"
    shards = [p for p in error.paths if p.parent == run.shards_dir and p.name.startswith("shard_")]
    if not shards:
        return f"{message}. Run `{command('rerun', run.root)}` to compute the damaged rows again"
    names = ", ".join(set_aside(p).name for p in shards)
    return (f"{message}. The damaged shard(s) were set aside as {names}; run `{command('rerun', run.root)}` to "
            "compute them again")


def _check_shard(reader: Reader, manifest: dict, rank: int, run: RunDir) -> Reader:
    """A shard (or checkpoint) must come from this very run: same schema, task, model and index."""
    attrs = reader.attrs
    expected = manifest["attrs"]
    problems = []
    if json.loads(attrs["schema"]) != manifest["schema"]:
        problems.append("different columns or dimensions")
    for key in ("task", "model_fingerprint", "index_fingerprint", "dtype", "engine"):
        if attrs.get(key) != expected.get(key):
            problems.append(f"{key} {attrs.get(key)!r} instead of {expected.get(key)!r}")
    if attrs.get("shard") != rank:
        problems.append(f"it is shard {attrs.get('shard')}, not shard {rank}")
    if problems:
        reader.close()
        raise MergeError(f"{reader.path} does not belong to this run: {'; '.join(problems)}. "
                         f"Remove it and run `{command('rerun', run.root)}`.")
    return reader
