"""The parent's work behind each command: run, rerun, merge, status, index statistics.

Every function here takes plain arguments and returns a result, so the CLI only parses and prints. The
parent builds the index, checks the input and the options before any model runs, writes the run's
manifest, supervises the workers and merges; it never initialises CUDA.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from index import FastaError, SequenceIndex, load_or_build
from index.cache import cache_dir

from . import __version__, engines, model_source, status_codes
from .config import RunConfig
from .errors import DiskFull, MergeError, RunDirError, UserError, disk_full_reason, ensure_space
from .h5io import CorruptFile, Reader, Writer
from .merge import describe_problems, merge_sorted_runs
from .progress import ProgressBoard
from .rows import Schema
from .run_dir import RunDir, RunLock, fsync_dir
from .supervisor import Supervisor, explain_exit
from .tasks import make_task, schema_for
from .tokenization import SequenceTokenizer

log = logging.getLogger("run_shards")

MAX_LISTED = 10


class RunFailed(UserError):
    """Some shards did not finish; nothing was merged."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


# --------------------------------------------------------------------------------------------- logging
def _log_to_run(run: RunDir) -> logging.Handler:
    run.logs_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(run.parent_log, mode="a")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logging.getLogger("run_shards").addHandler(handler)
    logging.getLogger("run_shards").setLevel(logging.INFO)
    return handler


def _unlog(handler: logging.Handler) -> None:
    logging.getLogger("run_shards").removeHandler(handler)
    handler.close()


# --------------------------------------------------------------------------------------------- index
def _where(index: SequenceIndex, i: int) -> str:
    return f"{index.path_of(i)}:{index.line_of(i)} '{index.id(i)}'"


def apply_input_policies(index: SequenceIndex, config: RunConfig) -> SequenceIndex:
    """Duplicate ids and empty records: refuse with the list, or apply the chosen policy."""
    groups = index.duplicate_ids()
    if groups:
        if config.on_duplicate_id == "error":
            total = sum(len(g) - 1 for g in groups)
            shown = "; ".join(f"'{index.id(g[0])}' at " + ", ".join(f"{index.path_of(i)}:{index.line_of(i)}" for i in g)
                              for g in groups[:MAX_LISTED])
            more = f" (and {len(groups) - MAX_LISTED} more ids)" if len(groups) > MAX_LISTED else ""
            raise UserError(f"{total} duplicate sequence id(s) in the input: {shown}{more}. Output rows are "
                            "keyed by id, so ids must be unique: fix the FASTA, or pass --on-duplicate-id rename "
                            "to suffix repeats ('id.dup2') and keep the original ids in the output.")
        index, originals = index.with_renamed_duplicates(groups)
        log.warning("%d duplicate id(s) renamed (e.g. %s); originals kept in `original_ids`", len(originals),
                    ", ".join(f"{v} -> {index.id(k)}" for k, v in list(originals.items())[:3]))
    empty = index.empty_records()
    if len(empty) and not config.skip_empty:
        shown = ", ".join(_where(index, int(i)) for i in empty[:MAX_LISTED])
        raise UserError(f"{len(empty)} record(s) have no residues: {shown}. Remove them, or pass --skip-empty "
                        f"to keep them as rows with status {status_codes.EMPTY} (empty) and no values.")
    return index


def check_long(index: SequenceIndex, tokenizer: SequenceTokenizer, limit: int | None, config: RunConfig) -> None:
    """Refuse, before any work, sequences over the model's hard limit unless a policy says what to do."""
    if not limit:
        return
    if limit <= tokenizer.num_special:
        where = "--max-length" if config.max_length == limit else "the model's length limit"
        raise UserError(f"{where} of {limit} tokens leaves no room for residues: the model adds "
                        f"{tokenizer.num_special} special token(s) to every sequence. Give a larger --max-length.")
    long = np.flatnonzero(tokenizer.tokens_for_residues(index.lengths) > limit)
    if len(long) and not tokenizer.char_level:  # the residue estimate is an upper bound: count exactly
        exact = tokenizer.encode([index.sequence(int(i)) for i in long])
        long = long[[len(t.ids) > limit for t in exact]]
    if len(long) == 0:
        return
    what = "the --max-length limit" if config.max_length == limit else "the model's limit"
    if config.on_long == "error":
        longest = int(long[np.argmax(index.lengths[long])])
        shown = ", ".join(f"'{index.id(int(i))}' ({index.lengths[i]} residues)" for i in long[:MAX_LISTED])
        raise UserError(
            f"{len(long)} sequence(s) exceed {what} of {limit} tokens ({tokenizer.num_special} of them "
            f"special), the longest '{index.id(longest)}' with {index.lengths[longest]} residues: {shown}. "
            "Choose --on-long truncate (cut to the limit; recorded in `truncated` and `num_tokens`) or "
            f"--on-long skip (kept as rows with status {status_codes.SKIPPED_TOO_LONG}).")
    log.warning("%d sequence(s) exceed %s of %d tokens and will be %s (--on-long %s)", len(long), what,
                limit, "truncated" if config.on_long == "truncate" else "skipped", config.on_long)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1000
    return f"{n:.1f} TB"


def estimate_result_bytes(schema: Schema, index: SequenceIndex, tokenizer: SequenceTokenizer) -> int:
    """Bytes of the merged result: fixed-width columns per row, ragged columns per residue token, ids."""
    fixed = sum(c.row_bytes() for c in schema.row_columns if c.path != "ids") * len(index)
    ids = int(index.id_offsets[-1]) + 16 * len(index)
    per_token = sum(c.row_bytes() for c in schema.ragged_columns)
    ragged = per_token * int(index.lengths.sum(dtype=np.int64))
    return fixed + ids + ragged + 8 * len(index) * len(schema.ragged_groups)


def check_storage(schema: Schema, index: SequenceIndex, tokenizer: SequenceTokenizer, world: int, where: Path,
                  free_bytes: int | None = None) -> str:
    """Say before any work how much disk the run needs; warn when it will not fit on the target disk.

    Shards hold the rows once, the merged result once more, and a shard being finalised briefly holds
    its checkpoints beside it: the peak is about 2 x result + 1 shard.
    """
    result = estimate_result_bytes(schema, index, tokenizer)
    peak = 2 * result + result // max(1, world)
    if free_bytes is None:
        import shutil
        free_bytes = shutil.disk_usage(where).free
    text = (f"storage estimate: result {human_bytes(result)}, about {human_bytes(peak)} on disk at the peak "
            f"(shards + merged result); {human_bytes(free_bytes)} free in {where}")
    if peak > free_bytes:
        log.warning("%s. This will NOT fit: free space, choose another --out, drop --per-residue, or use "
                    "--per-residue-dtype float16", text)
    else:
        log.info("%s", text)
    return text


def index_report(fasta: list[str], workers: int) -> str:
    """`run_shards index`: records, residues, length percentiles, per-worker token imbalance."""
    index, reused = load_or_build(fasta)
    pct = index.length_percentiles((0, 10, 50, 90, 99, 100))
    stats = index.shard_stats(workers)
    lines = [
        f"index: {'reused cached' if reused else 'built'} ({len(index.inputs)} file(s))",
        f"records: {len(index):,}",
        f"residues: {index.total_residues:,}",
        "length: " + ", ".join(f"{'min' if q == 0 else 'max' if q == 100 else f'p{q}'} {v:,}" for q, v in pct.items()),
        f"stride split over {workers} worker(s): max/mean tokens {stats.imbalance:.4f}",
    ]
    for r in range(workers):
        lines.append(f"  worker {r}: {stats.sequences[r]:,} sequences, {stats.tokens[r]:,} residues")
    dups = index.duplicate_ids()
    if dups:
        lines.append(f"warning: {sum(len(g) - 1 for g in dups)} duplicate id(s), e.g. '{index.id(dups[0][0])}'")
    empty = index.empty_records()
    if len(empty):
        lines.append(f"warning: {len(empty)} empty record(s), e.g. {_where(index, int(empty[0]))}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- run
def _file_attrs(config: RunConfig, source, engine: str, index: SequenceIndex) -> dict:
    return {
        "task": config.task, "model": config.model, "model_fingerprint": source.fingerprint,
        "model_type": source.model_type, "dtype": config.torch_dtype_name, "engine": engine,
        "config": json.loads(config.to_json()), "software_version": __version__,
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "index_fingerprint": index.fingerprint(), "fasta_files": config.fasta,
        "status_codes": {str(k): v for k, v in status_codes.DESCRIPTIONS.items()},
    }


def _prepare(config: RunConfig, run: RunDir) -> tuple[dict, SequenceIndex]:
    index, reused = load_or_build(config.fasta)
    log.info("index %s: %d records, %d residues, %d file(s)", "reused from cache" if reused else "built",
             len(index), index.total_residues, len(index.inputs))
    index = apply_input_policies(index, config)
    if config.world > len(index):   # a worker with an empty shard would load the model for nothing
        log.info("%d record(s): using %d worker(s), not %d", len(index), len(index), config.world)
        config.devices, config.workers = config.devices[:len(index)], min(config.workers, len(index))
    source = model_source.resolve(config.model, cache_dir())
    engine = engines.choose(config.engine, source.model_type, config.task)
    info, hf_tokenizer = model_source.describe(source, engine)
    task = make_task(config, info)
    limit = info.max_tokens
    if config.max_length:
        if limit and config.max_length > limit:
            log.warning("--max-length %d is above the model's own limit of %d tokens; using %d", config.max_length,
                        limit, limit)
        limit = min(limit, config.max_length) if limit else config.max_length
    tokenizer = SequenceTokenizer(hf_tokenizer)
    check_long(index, tokenizer, limit, config)
    trained = info.extra.get("trained_context")
    if trained and trained < (limit or float("inf")):
        over = int((tokenizer.tokens_for_residues(index.lengths) > trained).sum())
        if over:
            log.warning("%d sequence(s) are longer than the model's trained context of %d tokens "
                        "(max_position_embeddings); they run, but the model was not trained on such lengths. "
                        "--max-length %d with --on-long truncate or skip keeps within it.", over, trained, trained)
    check_storage(schema_for(task), index, tokenizer, config.world, run.root)
    stats = index.shard_stats(config.world)
    log.info("shards: %d, sequences per shard %d..%d, residues max/mean %.4f", config.world,
             int(stats.sequences.min()), int(stats.sequences.max()), stats.imbalance)
    for r in range(config.world):
        log.info("  shard %d: %d sequences, %d residues", r, int(stats.sequences[r]), int(stats.tokens[r]))
    manifest = {
        "config": json.loads(config.to_json()), "model": source.identity(), "engine": engine,
        "schema": schema_for(task).to_json(), "max_tokens": limit, "world": config.world,
        "index": {"fingerprint": index.fingerprint(), "count": len(index)},
        "attrs": _file_attrs(config, source, engine, index),
    }
    if run.exists():
        _check_same_run(run, config, manifest)
    else:
        index.save(run.index_path)
        run.write_manifest(manifest)
    return run.read_manifest(), index


def _check_same_run(run: RunDir, config: RunConfig, manifest: dict) -> None:
    old = run.read_manifest()
    old_config = RunConfig.from_json(json.dumps(old["config"]))
    changed = [k for k, v in config.result_fields().items() if old_config.result_fields().get(k) != v]
    if old["model"]["fingerprint"] != manifest["model"]["fingerprint"]:
        changed.append("model checkpoint")
    if old["index"]["fingerprint"] != manifest["index"]["fingerprint"]:
        changed.append("FASTA content")
    if old["world"] != manifest["world"]:
        changed.append(f"number of shards ({old['world']} -> {manifest['world']})")
    if changed:
        raise RunDirError(f"{run.root} already holds a run with other settings (changed: {', '.join(changed)}). "
                          f"Use another --out, or `run_shards rerun {run.root}` to continue that run as it was.")
    log.info("%s holds this same run: continuing from its checkpoints", run.root)


def run(config: RunConfig, show_progress: bool = True) -> Path:
    """Index, spawn one worker per shard, supervise, merge. Returns the merged file's path."""
    run_dir = RunDir(config.out)
    run_dir.create()
    with RunLock(run_dir, "run") as lock:
        handler = _log_to_run(run_dir)
        try:
            if lock.took_over:
                log.warning("took over a stale lock left by pid %s", lock.took_over.get("pid"))
            log.info("run_shards %s: %s", __version__, " ".join(config.fasta))
            started = time.time()
            try:
                manifest, index = _prepare(config, run_dir)
            except (UserError, FastaError) as e:   # the terminal shows it (cli.py); keep it in run.log too
                handler.handle(log.makeRecord(log.name, logging.ERROR, __file__, 0, "refused: %s", (e,), None))
                raise
            return _run_shards(run_dir, manifest, index, None, show_progress, started)
        finally:
            _unlog(handler)


def rerun(out: str, shards: list[int] | None = None, show_progress: bool = True,
          worker_timeout: float | None = None) -> Path:
    """Re-run failed or unfinished shards from their checkpoints, then merge."""
    run_dir = RunDir(out)
    run_dir.read_manifest()   # a clear error for a wrong directory before creating a lock file there
    with RunLock(run_dir, "rerun"):
        manifest = run_dir.read_manifest()
        handler = _log_to_run(run_dir)
        try:
            index = load_run_index(run_dir, manifest)
            world = manifest["world"]
            if shards:
                bad = [s for s in shards if not 0 <= s < world]
                if bad:
                    raise UserError(f"--shards {','.join(map(str, bad))}: this run has shards 0..{world - 1}")
            if worker_timeout:
                manifest["config"]["worker_timeout"] = worker_timeout
            return _run_shards(run_dir, manifest, index, shards, show_progress, time.time())
        finally:
            _unlog(handler)


def load_run_index(run: RunDir, manifest: dict) -> SequenceIndex:
    """The run's index, after checking that the FASTA files still match it (refusing with what changed)."""
    try:
        index = SequenceIndex.load(run.index_path)
    except Exception as e:
        raise RunDirError(f"{run.index_path}: the run's index is damaged ({e}); start a new run") from None
    changes = index.inputs_unchanged()
    if changes:
        # mtime or size moved: only refuse if the records themselves differ
        try:
            fresh = SequenceIndex.build([f.path for f in index.inputs])
        except Exception as e:
            raise UserError(f"the input FASTA changed since this run started and cannot be read now ({e})") from None
        same = (len(fresh) == len(index) and np.array_equal(fresh.offsets, index.offsets)
                and np.array_equal(fresh.lengths, index.lengths))
        edited = [f.path for f, g in zip(index.inputs, fresh.inputs)
                  if f.content_crc32 is not None and f.content_crc32 != g.content_crc32]
        if not same or edited:
            detail = (f"{len(index):,} records when the run started, {len(fresh):,} now" if not same else
                      f"same records and lengths, but the contents of {', '.join(edited)} differ")
            raise UserError(f"the input FASTA no longer matches this run ({'; '.join(changes)}; {detail}). "
                            "Restore the original file, or start a new run with another --out.")
        unverified = [f.path for f in index.inputs if f.content_crc32 is None]
        if unverified:
            log.warning("input files were touched (%s); their records have the same layout, but this run's index "
                        "predates content checksums, so edits that keep every length cannot be ruled out",
                        "; ".join(changes))
        else:
            log.info("input files were touched (%s) but their contents are unchanged", "; ".join(changes))
    return index


def _run_shards(run: RunDir, manifest: dict, index: SequenceIndex, only: list[int] | None,
                show_progress: bool, started: float) -> Path:
    config = RunConfig.from_json(json.dumps(manifest["config"]))
    states = {r: shard_state(run, index, r, config.world) for r in range(config.world)}
    ranks = [r for r in (only if only else range(config.world)) if states[r].state != "complete"]
    for r in (only or []):
        if states[r].state == "complete":
            log.info("shard %d is already complete", r)
    if ranks:
        total = sum(states[r].expected - states[r].durable for r in ranks)
        from . import devices as dev
        slots = config.devices if config.on_gpu else [str(k) for k in range(config.workers)]
        if config.on_gpu:
            visible = dev.visible_gpus()
            missing = [d for d in slots if d not in visible]
            if missing and len(visible) >= len(slots):
                slots = visible[:len(slots)]
            elif missing:
                raise UserError(f"this run used GPUs {','.join(config.devices)}, and only {len(visible)} are "
                                "visible now; expose enough GPUs (CUDA_VISIBLE_DEVICES) and rerun")
        running = min(len(slots), len(ranks))
        where = f"{running} GPU(s)" if config.on_gpu else f"{running} CPU worker(s)"
        board = ProgressBoard(total, where, config.summary_seconds, show_bar=show_progress)
        for r in ranks:
            run.clear_failure(r)
        supervisor = Supervisor(run, ranks, slots, config.on_gpu, config.threads_per_worker, board,
                                config.worker_timeout)
        try:
            results = supervisor.wait()
        finally:
            board.close()
        log.info("per-shard summary:\n%s", board.table())
        failed = [p for p in results if p.exitcode != 0]
        for p in failed:
            run.record_failure(p.rank, {"exit_code": p.exitcode, "explanation": explain_exit(p.exitcode),
                                        "reason": p.reason, "log": str(run.worker_log(p.rank)),
                                        "log_tail": run.log_tail(p.rank)})
        if failed or supervisor.interrupted:
            raise RunFailed(_failure_report(run, failed, config.world, supervisor.interrupted),
                            exit_code=130 if supervisor.interrupted else 1)
        board.note(board.summary_line())
        spawned = supervisor.started_at
    path = merge(str(run.root), _locked=True, _index=index, _manifest=manifest)
    if ranks and board.compute_window():
        first, last = board.compute_window()
        end = time.time()
        log.info("timings: prepare %.1f s, start workers and load model %.1f s, compute %.1f s, finish shards and "
                 "merge %.1f s; total %.1f s, %.1f%% outside model compute", spawned - started, first - spawned,
                 last - first, end - last, end - started, 100.0 * (1 - (last - first) / max(end - started, 1e-9)))
    return path


def _failure_report(run: RunDir, failed: list, world: int, interrupted: str | None) -> str:
    lines = []
    for p in failed:
        lines.append(f"shard {p.rank} failed: {explain_exit(p.exitcode)}" + (f" - {p.reason}" if p.reason else ""))
        tail = run.log_tail(p.rank, 8)
        if p.exitcode == 2 and p.reason:   # the worker's own message says it all
            lines.append(f"  log: {run.worker_log(p.rank)}")
        elif tail:
            lines.append(f"  last lines of {run.worker_log(p.rank)}:")
            lines += [f"    {t}" for t in tail]
    if interrupted:
        lines.append(f"interrupted by {interrupted}: workers wrote their checkpoints.")
    done = sum(1 for r in range(world) if run.shard_path(r).exists())
    lines.append(f"{done} of {world} shards complete. No merged file was written; all finished and "
                 "checkpointed rows are kept.")
    ranks = ",".join(str(p.rank) for p in failed)
    lines.append(f"Continue with:  run_shards rerun {run.root}" + (f" --shards {ranks}" if ranks and not interrupted else ""))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- status
@dataclass
class ShardState:
    rank: int
    state: str          # complete, partial, pending, failed, corrupt (status adds running)
    expected: int
    durable: int
    detail: str = ""


def shard_state(run: RunDir, index: SequenceIndex, rank: int, world: int) -> ShardState:
    expected = len(index.stride_shard(rank, world))
    path = run.shard_path(rank)
    if path.exists():
        try:
            with Reader(path) as r:
                if r.rows == expected:
                    return ShardState(rank, "complete", expected, expected)
                detail = f"{r.rows} rows, expected {expected}"
        except CorruptFile as e:
            detail = str(e)
        return ShardState(rank, "corrupt", expected, 0, f"{detail}; `rerun` rebuilds it")
    durable, bad = 0, []
    parts = sorted(run.parts_dir(rank).glob("part_*.h5")) if run.parts_dir(rank).is_dir() else []
    for part in parts:
        try:
            with Reader(part) as r:
                durable += r.rows
        except CorruptFile:
            bad.append(part.name)
    failure = run.failure(rank)
    detail = ""
    if failure:
        detail = f"last run: {failure.get('explanation')}" + (f" - {failure['reason']}" if failure.get("reason") else "")
    if bad:
        detail = (detail + "; " if detail else "") + f"corrupt checkpoint(s) {', '.join(bad)} will be recomputed"
    state = "failed" if failure else "partial" if durable else "pending"
    return ShardState(rank, state, expected, durable, detail)


def status(out: str) -> str:
    run_dir = RunDir(out)
    manifest = run_dir.read_manifest()
    config = manifest["config"]
    lines = [f"run: {run_dir.root}", f"task: {config['task']}  model: {config['model']}  engine: {manifest['engine']}"]
    try:
        index = load_run_index(run_dir, manifest)
    except UserError as e:
        lines.append(f"inputs: CHANGED - {e}")
        index = SequenceIndex.load(run_dir.index_path)
    lines.append(f"sequences: {len(index):,} in {manifest['world']} shard(s)")
    holder = RunLock.active_holder(run_dir)
    if holder:
        import socket
        alive = "alive" if holder.get("host") == socket.gethostname() else "another host: not checked"
        lines.append(f"ACTIVE: `{holder.get('purpose')}` (pid {holder.get('pid')} on {holder.get('host')}, {alive}, "
                     f"since {holder.get('since')}) holds this run; unfinished shards may be running now")
    rows = [("shard", "state", "durable", "of", "progress", "detail")]
    for r in range(manifest["world"]):
        s = shard_state(run_dir, index, r, manifest["world"])
        if holder and s.state != "complete" and RunLock.shard_running(run_dir, r):
            s.state = "running"   # durable counts checkpointed rows only
        rows.append((str(r), s.state, f"{s.durable:,}", f"{s.expected:,}",
                     f"{100.0 * s.durable / max(1, s.expected):.1f}%", s.detail))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row[:5], widths)) + "  " + row[5] for row in rows]
    if run_dir.result_path.exists():
        try:
            with Reader(run_dir.result_path) as r:
                complete = bool(r.attrs.get("complete"))
                lines.append(f"result: {run_dir.result_path} ({r.rows:,} rows{'' if complete else ', PARTIAL'})")
        except CorruptFile as e:
            lines.append(f"result: CORRUPT ({e}); run `run_shards merge {run_dir.root}`")
    else:
        lines.append("result: not merged yet")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- merge
def merge(out: str, allow_partial: bool = False, _locked: bool = False, _index: SequenceIndex | None = None,
          _manifest: dict | None = None) -> Path:
    """Merge the shards into OUT/result.h5 in FASTA order, validated; atomic rename into place."""
    run_dir = RunDir(out)
    lock = None if _locked else RunLock(run_dir, "merge")
    if lock:
        run_dir.read_manifest()   # a clear error for a wrong directory before creating a lock file there
        lock.acquire()
    try:
        manifest = _manifest or run_dir.read_manifest()
        index = _index or load_run_index(run_dir, manifest)
        return _merge(run_dir, manifest, index, allow_partial)
    finally:
        if lock:
            lock.release()


def _merge(run: RunDir, manifest: dict, index: SequenceIndex, allow_partial: bool) -> Path:
    schema = Schema.from_json(manifest["schema"])
    world = manifest["world"]
    readers, not_ready = [], []
    try:
        for r in range(world):
            path = run.shard_path(r)
            if path.exists():
                try:
                    readers.append(_check_shard(Reader(path), manifest, r))
                    continue
                except CorruptFile as e:
                    not_ready.append(f"shard {r} is corrupt ({e})")
            else:
                not_ready.append(f"shard {r} is not finished ({shard_state(run, index, r, world).state})")
            if allow_partial and run.parts_dir(r).is_dir():
                for part in sorted(run.parts_dir(r).glob("part_*.h5")):
                    try:
                        readers.append(_check_shard(Reader(part), manifest, r))
                    except CorruptFile as e:
                        log.warning("skipping corrupt checkpoint %s: %s", part, e)
        if not_ready and not allow_partial:
            raise MergeError("cannot merge: " + "; ".join(not_ready) +
                             f". Run `run_shards rerun {run.root}` (or `run_shards merge {run.root} --allow-partial` "
                             "for the rows that exist).")
        attrs = dict(manifest["attrs"])
        renamed = index.meta.get("renamed_ids") or {}
        tmp = run.result_path.with_name(f".{run.result_path.name}.tmp")
        ensure_space(run.root, sum(os.path.getsize(r.path) for r in readers), f"the result {run.result_path}",
                     f"The shards are intact; free space and run `run_shards merge {run.root}`")
        writer = Writer(tmp, schema, attrs, rows_hint=len(index))
        try:
            ragged_bytes = sum(c.row_bytes() for c in schema.ragged_columns)
            fixed = sum(c.row_bytes() for c in schema.row_columns)
            row_bytes = fixed + ragged_bytes * (index.lengths.astype(np.int64) + 2)
            blob, offs = index.id_blob.tobytes(), index.id_offsets
            ids_at = lambda p: np.array([blob[offs[i]:offs[i + 1]] for i in p], dtype=object)  # noqa: E731
            try:
                problems = merge_sorted_runs(readers, writer, np.arange(len(index), dtype=np.int64), row_bytes,
                                             expected_ids=ids_at)
            except CorruptFile as e:
                raise MergeError(_set_aside(run, e)) from None
            only_missing = not any(v for k, v in problems.counts().items() if k != "missing")
            if problems and not (allow_partial and only_missing):
                message = describe_problems(problems, index.id, run.problems_path)
                raise MergeError(f"merge refused, {message}")
            missing = problems.missing_positions()
            text = h5py.string_dtype("utf-8")
            writer.file.create_dataset("missing_ids", dtype=text, data=np.array(
                [index.id_bytes(int(p)) for p in missing], dtype=object))
            if renamed:
                pos = np.array(sorted(int(k) for k in renamed), np.int64)
                writer.file.create_dataset("original_ids/index", data=pos)
                writer.file.create_dataset("original_ids/ids", dtype=text, data=np.array(
                    [renamed[str(p)].encode() for p in pos], dtype=object))
            writer.finish({"complete": len(missing) == 0, "num_missing": int(len(missing))})
        except BaseException as e:
            writer.abort()
            reason = disk_full_reason(e) if isinstance(e, Exception) else None
            if reason:
                raise DiskFull(f"cannot write {run.result_path}: {reason}. No result file was left behind and "
                               f"the shards are intact; free space and run `run_shards merge {run.root}`") from None
            raise
    finally:
        for r in readers:
            r.close()
    os.replace(tmp, run.result_path)
    fsync_dir(run.root)
    run.problems_path.unlink(missing_ok=True)
    if len(missing):
        log.warning("partial result: %d of %d sequences missing (listed in `missing_ids`)", len(missing), len(index))
    log.info("merged %d sequences into %s", len(index) - len(missing), run.result_path)
    return run.result_path


def _set_aside(run: RunDir, error: CorruptFile) -> str:
    """A shard that fails its checksums is renamed aside so `rerun` recomputes it; says so."""
    message = f"merge refused: {error}"
    for path in run.shards_dir.glob("shard_*.h5"):
        if str(path) in str(error):
            aside = path.with_name(path.name + ".corrupt")
            path.rename(aside)
            return (f"{message}. The shard was set aside as {aside.name}; run `run_shards rerun {run.root}` "
                    "to compute it again")
    return f"{message}. Run `run_shards rerun {run.root}` to compute the damaged rows again"


def _check_shard(reader: Reader, manifest: dict, rank: int) -> Reader:
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
                         f"Remove it and run `run_shards rerun {Path(reader.path).parents[1]}`.")
    return reader
