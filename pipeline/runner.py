"""The parent's work behind `run`, `rerun` and `merge`, and the index statistics of `run_shards index`.

Every function here takes plain arguments and returns a result, so the CLI only parses and prints. The
parent builds the index, checks the input and the options before any model runs, writes the run's
manifest, supervises the workers and merges; it never initialises CUDA.
"""
from __future__ import annotations

import datetime
import json
import logging
import time
from pathlib import Path

import numpy as np

from index import FastaError, SequenceIndex, load_or_build
from index.cache import cache_dir

from . import __version__, engines, model_source, result_merge, run_log, shard_state, status_codes
from .config import RunConfig
from .errors import RunDirError, UserError
from .exits import EXIT_INTERRUPTED, EXIT_OK, EXIT_USER_ERROR
from .input_checks import apply_input_policies, check_long, check_storage, where_in_input
from .progress import ProgressBoard
from .run_dir import RunDir, RunLock
from .supervisor import Supervisor
from .tasks import make_task, schema_for
from .tokenization import SequenceTokenizer

log = logging.getLogger("run_shards")


class RunFailed(UserError):
    """Some shards did not finish (failed, or the run was interrupted: exit code 130); nothing was merged."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code

    @property
    def label(self) -> str:
        return "interrupted" if self.exit_code == 130 else "error"


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
        lines.append(f"warning: {len(empty)} empty record(s), e.g. {where_in_input(index, int(empty[0]))}")
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
    inputs = []
    if old["model"]["fingerprint"] != manifest["model"]["fingerprint"]:
        inputs.append("model checkpoint")
    if old["index"]["fingerprint"] != manifest["index"]["fingerprint"]:
        inputs.append("FASTA content")
    if old["world"] != manifest["world"]:
        changed.append(f"number of shards ({old['world']} -> {manifest['world']})")
    if inputs:   # `rerun` would refuse too: say how to get either run
        raise RunDirError(
            f"{run.root} already holds a run with other inputs (changed: {', '.join(inputs + changed)}). To run on "
            f"the inputs as they are now, use another --out: `{config.as_command(free_out(run.root))}`. To finish "
            f"the run that is there, restore its inputs as they were and run `run_shards rerun {run.root}`.")
    if changed:
        raise RunDirError(f"{run.root} already holds a run with other settings (changed: {', '.join(changed)}). "
                          f"Use another --out (`{config.as_command(free_out(run.root))}`), or "
                          f"`run_shards rerun {run.root}` to continue that run as it was.")
    log.info("%s holds this same run: continuing from its checkpoints", run.root)


def free_out(root: Path) -> str:
    """A sibling of `root` that does not exist yet (`OUT-2`, `OUT-3`, ...), for messages that suggest one."""
    k = 2
    while Path(f"{root}-{k}").exists():
        k += 1
    return f"{root}-{k}"


def run(config: RunConfig, show_progress: bool = True) -> Path:
    """Index, spawn one worker per shard, supervise, merge. Returns the merged file's path.

    When the input checks refuse (or the user interrupts them) before the run's manifest exists, the output
    directory is left as it was found: removed if this command created it.
    """
    run_dir = RunDir(config.out)
    existed = run_dir.root.exists()
    run_dir.create()
    try:
        with RunLock(run_dir, "run") as lock:
            handler = run_log.attach(run_dir)
            try:
                if lock.took_over:
                    log.warning("took over a stale lock left by pid %s", lock.took_over.get("pid"))
                run_dir.remove_stale_temporaries()
                log.info("run_shards %s: %s", __version__, " ".join(config.fasta))
                started = time.time()
                manifest, index = _prepare(config, run_dir)
                return _run_shards(run_dir, manifest, index, None, show_progress, started)
            except (UserError, FastaError) as e:   # the terminal shows it (cli.py); run.log keeps it too
                handler.write_only_here(logging.ERROR, f"error: {e}")
                raise
            finally:
                run_log.detach(handler)
    except (UserError, FastaError, KeyboardInterrupt):
        if not run_dir.exists():
            run_dir.discard_unstarted(remove_root=not existed)
        raise


def rerun(out: str, shards: list[int] | None = None, show_progress: bool = True,
          worker_timeout: float | None = None) -> Path:
    """Re-run failed or unfinished shards from their checkpoints, then merge."""
    run_dir = RunDir(out)
    run_dir.read_manifest()   # a clear error for a wrong directory before creating a lock file there
    with RunLock(run_dir, "rerun"):
        manifest = run_dir.read_manifest()
        handler = run_log.attach(run_dir)
        try:
            run_dir.remove_stale_temporaries()
            index = load_run_index(run_dir, manifest)
            world = manifest["world"]
            if shards:
                bad = [s for s in shards if not 0 <= s < world]
                if bad:
                    raise UserError(f"--shards {','.join(map(str, bad))}: this run has shards 0..{world - 1}")
            if worker_timeout:
                manifest["config"]["worker_timeout"] = worker_timeout
            return _run_shards(run_dir, manifest, index, shards, show_progress, time.time())
        except (UserError, FastaError) as e:
            handler.write_only_here(logging.ERROR, f"error: {e}")
            raise
        finally:
            run_log.detach(handler)


def input_changes(index: SequenceIndex) -> str | None:
    """What changed in the FASTA files since `index` was built, or None when their records and bytes are the
    same (a file only touched, same bytes, is accepted)."""
    changes = index.inputs_unchanged()
    if not changes:
        return None
    try:   # mtime or size moved: only the records themselves matter
        fresh = SequenceIndex.build([f.path for f in index.inputs])
    except Exception as e:
        return f"{'; '.join(changes)}; it cannot be read now: {e}"
    same = (len(fresh) == len(index) and np.array_equal(fresh.offsets, index.offsets)
            and np.array_equal(fresh.lengths, index.lengths))
    edited = [f.path for f, g in zip(index.inputs, fresh.inputs)
              if f.content_crc32 is not None and f.content_crc32 != g.content_crc32]
    if not same or edited:
        detail = (f"{len(index):,} records when the run started, {len(fresh):,} now" if not same else
                  f"same records and lengths, but the contents of {', '.join(edited)} differ")
        return f"{'; '.join(changes)}; {detail}"
    if any(f.content_crc32 is None for f in index.inputs):
        log.warning("input files were touched (%s); their records have the same layout, but this run's index "
                    "predates content checksums, so edits that keep every length cannot be ruled out",
                    "; ".join(changes))
    else:
        log.info("input files were touched (%s) but their contents are unchanged", "; ".join(changes))
    return None


def _start_over(run: RunDir, manifest: dict) -> str:
    """Advice when a run's inputs changed: both ways out, each with a command that works."""
    config = RunConfig.from_json(json.dumps(manifest["config"]))
    return (f"Restore the original file and run `run_shards rerun {run.root}` again, or start a new run on the "
            f"file as it is now: `{config.as_command(free_out(run.root))}`.")


def load_run_index(run: RunDir, manifest: dict) -> SequenceIndex:
    """The run's index, after checking that the FASTA files still match it (refusing with what changed)."""
    try:
        index = SequenceIndex.load(run.index_path)
    except Exception as e:
        config = RunConfig.from_json(json.dumps(manifest["config"]))
        raise RunDirError(f"{run.index_path}: the run's index is damaged ({e}); start a new run: "
                          f"`{config.as_command(free_out(run.root))}`") from None
    changed = input_changes(index)
    if changed:
        raise UserError(f"the input FASTA no longer matches this run ({changed}). {_start_over(run, manifest)}")
    return index


def _run_shards(run: RunDir, manifest: dict, index: SequenceIndex, only: list[int] | None,
                show_progress: bool, started: float) -> Path:
    config = RunConfig.from_json(json.dumps(manifest["config"]))
    model_source.check_unchanged(manifest["model"])
    states = {r: shard_state.inspect(run, index.stride_shard(r, config.world), r, verify_shard=True)
              for r in range(config.world)}
    for s in states.values():
        if s.state == "corrupt":   # found before any work, so one `rerun` computes every damaged shard
            aside = shard_state.set_aside(run.shard_path(s.rank))
            log.warning("shard %d cannot be used (%s); set aside as %s and computed again", s.rank,
                        s.detail.split(";")[0], aside.name)
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
            board.expect(r, states[r].expected - states[r].durable)
            run.clear_failure(r)
        supervisor = Supervisor(run, ranks, slots, config.on_gpu, config.threads_per_worker, board,
                                config.worker_timeout)
        try:
            results = supervisor.wait()
        finally:
            board.close()
        log.info("per-shard summary:\n%s", board.table())
        stopped = [p for p in results if p.exitcode != EXIT_OK]
        for p in stopped:
            run.record_failure(p.rank, {"exit_code": p.exitcode, "explanation": p.explanation, "reason": p.reason,
                                        "interrupted": p.exitcode == EXIT_INTERRUPTED or bool(supervisor.interrupted),
                                        "log": str(run.worker_log(p.rank)), "log_tail": run.log_tail(p.rank)})
        if stopped or supervisor.interrupted:
            raise RunFailed(_failure_report(run, manifest, index, supervisor, stopped),
                            exit_code=130 if supervisor.interrupted else 1)
        board.note(board.summary_line())
        spawned = supervisor.started_at
    path = result_merge.merge_result(run, manifest, index, allow_partial=False)
    if ranks and board.compute_window():
        first, last = board.compute_window()
        end = time.time()
        log.info("timings: prepare %.1f s, start workers and load model %.1f s, compute %.1f s, finish shards and "
                 "merge %.1f s; total %.1f s, %.1f%% outside model compute", spawned - started, first - spawned,
                 last - first, end - last, end - started, 100.0 * (1 - (last - first) / max(end - started, 1e-9)))
    return path


def _failure_report(run: RunDir, manifest: dict, index: SequenceIndex, supervisor, stopped: list) -> str:
    """What happened to every shard that did not finish, and the one command that continues the run."""
    world = manifest["world"]
    lines, failed = [], []
    for p in stopped:
        if p.exitcode == EXIT_INTERRUPTED:
            s = shard_state.inspect(run, index.stride_shard(p.rank, world), p.rank, verify_shard=False)
            why = f" ({p.killed_for})" if p.killed_for else ""
            lines.append(f"shard {p.rank} stopped at its final checkpoint{why}: {s.durable:,} of {s.expected:,} "
                         "sequences durable")
            continue
        if not supervisor.interrupted or p.rank in supervisor.killed_at_once:
            failed.append(p.rank)
        verb = "stopped" if supervisor.interrupted else "failed"
        lines.append(f"shard {p.rank} {verb}: {p.explanation}" + (f" - {p.reason}" if p.reason else ""))
        tail = run.log_tail(p.rank, 8)
        if (p.exitcode == EXIT_USER_ERROR and p.reason) or supervisor.interrupted:   # the message says it all
            lines.append(f"  log: {run.worker_log(p.rank)}")
        elif tail:
            lines.append(f"  last lines of {run.worker_log(p.rank)}:")
            lines += [f"    {t}" for t in tail]
    never = supervisor.pending
    if never:
        lines.append(f"shard(s) {', '.join(map(str, never))} were not started")
    if supervisor.interrupted:
        killed = supervisor.killed_at_once
        lines.append(f"interrupted by {supervisor.interrupted}: " + (
            f"shard(s) {', '.join(map(str, killed))} were killed at once by the second signal, losing the rows "
            "since their last checkpoint; everything checkpointed is kept." if killed else
            "every running worker wrote a final checkpoint."))
    done = sum(1 for r in range(world) if run.shard_path(r).exists())
    lines.append(f"{done} of {world} shards complete. No merged file was written; all finished and "
                 "checkpointed rows are kept.")
    changed = input_changes(index)
    if changed:
        lines.append(f"The input FASTA changed since this run started ({changed}). {_start_over(run, manifest)}")
    else:
        only = f" --shards {','.join(map(str, failed))}" if failed and not supervisor.interrupted else ""
        lines.append(f"Continue with:  run_shards rerun {run.root}{only}")
    return "\n".join(lines)


def merge(out: str, allow_partial: bool = False) -> Path:
    """`run_shards merge`: merge and validate the shards of OUT into OUT/result.h5."""
    run_dir = RunDir(out)
    run_dir.read_manifest()   # a clear error for a wrong directory before creating a lock file there
    with RunLock(run_dir, "merge"):
        run_dir.remove_stale_temporaries()
        manifest = run_dir.read_manifest()
        return result_merge.merge_result(run_dir, manifest, load_run_index(run_dir, manifest), allow_partial)
