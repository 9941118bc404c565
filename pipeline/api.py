"""The parent's work behind `run`, `rerun` and `merge`, and the index statistics of `run_shards index`.

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
from pathlib import Path

from index import FastaError, SequenceIndex, load_or_build
from index.alphabet import alphabet_mismatch
from index.cache import cache_dir

from . import __version__, launchers
from .engine import selection as engines, windowed as windows
from .models import checkpoint as model_source
from .output import result as result_merge, status_codes
from .output.h5io import CorruptFile, Reader
from .rundir import run_log
from .output import shard_state
from .config import RunConfig
from .errors import RunDirError, RunFailed, UserError
from .planning.input_checks import (apply_input_policies, check_long, check_storage, free_out, load_run_index, start_over_advice)
from .launchers.job import ShardJob, Submitted
from .rundir import events
from .rundir.layout import RunDir
from .rundir.locks import RunLock, ShardLock, wait_for_running_shards
from .tasks import make_task, schema_for
from .tasks.tokenization import SequenceTokenizer

log = logging.getLogger("run_shards")


# --------------------------------------------------------------------------------------------- run
def _file_attrs(config: RunConfig, source, engine: str, index: SequenceIndex) -> dict:
    return {
        "task": config.task, "model": config.model, "model_fingerprint": source.fingerprint,
        "model_type": source.model_type, "dtype": config.torch_dtype_name, "engine": engine,
        "batch_invariant": engines.batch_invariant(engine, config),
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
        log.info("%d record(s): using %d shard(s), not %d", len(index), len(index), config.world)
        if config.shards:
            config.shards = len(index)
        else:
            config.devices, config.workers = config.devices[:len(index)], min(config.workers, len(index))
    source = model_source.resolve(config.model, cache_dir())
    engine = engines.choose(config.engine, source.model_type, config.task)
    engines.check_dtype(engine, config.torch_dtype_name, config.on_gpu)
    info, hf_tokenizer = model_source.describe(source, engine)
    task = make_task(config, info)
    limit = info.max_tokens
    if config.max_length:
        if limit and config.max_length > limit:
            log.warning("--max-length %d is above the model's own limit of %d tokens; using %d", config.max_length,
                        limit, limit)
        limit = min(limit, config.max_length) if limit else config.max_length
    tokenizer = SequenceTokenizer(hf_tokenizer)
    mismatch = alphabet_mismatch(index, hf_tokenizer.get_vocab())   # DNA given to a protein model, or the reverse
    if mismatch:
        log.warning("%s", mismatch)
    if config.on_long == "window":
        windows.plan(config, limit, tokenizer)
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
    if old_config.torch_dtype_name != config.torch_dtype_name and "dtype" not in changed:   # --dtype auto
        changed.append(f"dtype {old_config.torch_dtype_name} -> {config.torch_dtype_name}, which --dtype auto takes "
                       f"from --gpus: bfloat16 with a GPU per worker, float32 without")
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
    # How the shards are run may change between commands (a longer --time after a task ran out of it, a
    # partition sbatch refused, fewer workers): the command's options apply, never silently the old ones.
    new = {k: getattr(config, k) for k in RunConfig.LAUNCH_FIELDS if old["config"].get(k) != getattr(config, k)}
    if new:
        log.info("with this command's %s", ", ".join(f"{RunConfig.option_name(k)} {v!r} (was {old['config'].get(k)!r})"
                                                    for k, v in new.items()))
        old["config"].update(new)
        run.write_manifest(old)


def run(config: RunConfig, show_progress: bool = True, options: dict | None = None) -> Path | Submitted:
    """Plan (index, input checks, manifest), launch the shards, merge. Returns the merged file's path, or
    what a scheduler was handed (`options`: dry_run, wait for --launcher slurm).

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
                return _reported(run_dir, lambda: _run_shards(run_dir, manifest, index, None, show_progress,
                                                              started, options), "run")
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
          worker_timeout: float | None = None, options: dict | None = None,
          ray_address: str | None = None, sbatch: str | None = None,
          merge_sbatch: str | None = None) -> Path | Submitted:
    """Re-run failed or unfinished shards from their checkpoints (locally, or resubmitted to the run's
    scheduler), then merge."""
    run_dir = RunDir(out)
    run_dir.read_manifest()   # a clear error for a wrong directory before creating a lock file there
    with RunLock(run_dir, "rerun"):
        manifest = run_dir.read_manifest()
        handler = run_log.attach(run_dir)
        try:
            run_dir.remove_stale_temporaries()
            index = load_run_index(run_dir, manifest, refresh_copies=True)
            world = manifest["world"]
            if shards:
                bad = [s for s in shards if not 0 <= s < world]
                if bad:
                    raise UserError(f"--shards {','.join(map(str, bad))}: this run has shards 0..{world - 1}")
            launcher = manifest["config"].get("launcher", "local")
            asked = [f"--{k.replace('_', '-')}" for k, v in (options or {}).items() if v]
            if asked and launcher != "slurm":
                raise UserError(f"{' and '.join(asked)} apply only to runs with --launcher slurm (this run's "
                                f"launcher is {launcher})")
            if ray_address is not None and launcher != "ray":
                raise UserError(f"--ray-address applies only to runs with --launcher ray (this run's launcher is "
                                f"{launcher})")
            for option, value in (("sbatch", sbatch), ("merge_sbatch", merge_sbatch)):
                if value is not None and launcher != "slurm":
                    raise UserError(f"{RunConfig.option_name(option)} applies only to runs with --launcher slurm "
                                    f"(this run's launcher is {launcher})")
                if value is not None and value != manifest["config"].get(option, ""):
                    log.info("%s %r from now on (was %r)", RunConfig.option_name(option), value,
                             manifest["config"].get(option, ""))
                    manifest["config"][option] = value     # kept: a later rerun submits with it too
                    run_dir.write_manifest(manifest)
                    manifest = run_dir.read_manifest()
            if ray_address is not None:
                manifest["config"]["ray_address"] = ray_address
            if worker_timeout:
                manifest["config"]["worker_timeout"] = worker_timeout
            return _reported(run_dir, lambda: _run_shards(run_dir, manifest, index, shards, show_progress,
                                                          time.time(), options), "rerun")
        except (UserError, FastaError) as e:
            handler.write_only_here(logging.ERROR, f"error: {e}")
            raise
        finally:
            run_log.detach(handler)


def _run_shards(run: RunDir, manifest: dict, index: SequenceIndex, only: list[int] | None,
                show_progress: bool, started: float, options: dict | None = None) -> Path | Submitted:
    """Verify what is on disk, hand the unfinished shards to the run's launcher, merge when they are done."""
    config = RunConfig.from_json(json.dumps(manifest["config"]))
    model_source.check_unchanged(manifest["model"])
    states = {r: shard_state.inspect(run, index.stride_shard(r, config.world), r, verify_shard=True)
              for r in range(config.world)}
    for s in states.values():
        if s.state == "corrupt":   # found before any work, so one `rerun` computes every damaged shard
            ShardLock(run, s.rank).if_free(lambda s=s: _set_aside(run, s))   # never under a worker finishing it
    ranks = [r for r in (only if only else range(config.world)) if states[r].state != "complete"]
    for r in (only or []):
        if states[r].state == "complete":
            log.info("shard %d is already complete", r)
    timings = None
    if ranks:
        opts = options or {}
        job = ShardJob(run, manifest, index, ranks, {r: states[r].expected - states[r].durable for r in ranks},
                       show_progress, dry_run=bool(opts.get("dry_run")), wait=bool(opts.get("wait")))
        outcome = launchers.launch(job)
        if isinstance(outcome, Submitted):
            return outcome
        if outcome.busy:   # another process computes them: nothing to merge yet, nothing failed
            raise RunFailed("\n".join(outcome.busy_lines(run)))
        timings = outcome.timings
    changed = index.records_changed()   # edited after the last shard's last check: the result would not describe it
    if changed:
        raise UserError(f"the input FASTA changed during the run ({changed}); nothing was merged. "
                        f"{start_over_advice(run, manifest)}")
    path = result_merge.merge_result(run, manifest, index, allow_partial=False)
    if timings and timings[1]:
        spawned, (first, last) = timings
        end = time.time()
        split = {"prepare": spawned - started, "start_and_load": first - spawned, "compute": last - first,
                 "finish_and_merge": end - last}
        log.info("timings: prepare %.1f s, start workers and load model %.1f s, compute %.1f s, finish shards and "
                 "merge %.1f s; total %.1f s, %.1f%% outside model compute", *split.values(), end - started,
                 100.0 * (1 - (last - first) / max(end - started, 1e-9)))
        events.append(run.run_events_path, "timings", **split)   # unrounded: the page rounds as this line
    return path


def _set_aside(run: RunDir, s) -> None:
    aside = shard_state.set_aside(run.shard_path(s.rank))
    log.warning("shard %d cannot be used (%s); set aside as %s and computed again", s.rank, s.detail.split(";")[0],
                aside.name)


def merge(out: str, allow_partial: bool = False, lock_wait: float = 0.0) -> Path:
    """`run_shards merge`: merge and validate the shards of OUT into OUT/result.h5. `lock_wait`: how long to
    wait for another command working in OUT and for shards being computed (a SLURM merge job waits)."""
    run_dir = RunDir(out)
    run_dir.read_manifest()   # a clear error for a wrong directory before creating a lock file there
    with RunLock(run_dir, "merge", wait_seconds=lock_wait) as lock:
        handler = run_log.attach(run_dir)   # run.log keeps what the merge says (a SLURM merge job's too)
        try:
            run_dir.remove_stale_temporaries()
            manifest = run_dir.read_manifest()
            if lock.waited and _merged(run_dir):
                log.info("%s was merged meanwhile by the command this one waited for", run_dir.result_path)
                return run_dir.result_path
            wait_for_running_shards(run_dir, manifest["world"], lock_wait)
            return _reported(run_dir, lambda: result_merge.merge_result(
                run_dir, manifest, load_run_index(run_dir, manifest), allow_partial), "merge")
        except (UserError, FastaError) as e:
            handler.write_only_here(logging.ERROR, f"error: {e}")
            raise
        finally:
            run_log.detach(handler)


def _merged(run: RunDir) -> bool:
    try:
        with Reader(run.result_path) as r:
            return bool(r.attrs.get("complete"))
    except (OSError, CorruptFile):
        return False


def _reported(run_dir: RunDir, work, command: str = ""):
    """Run `work`, then record how the command ended (an `ended` event: its error, its seconds) and write
    OUT/report.html however it ended, with the error that ended it (not for a submission to a scheduler,
    whose jobs have not run yet). RUN_SHARDS_REPORT=0 leaves the page out (about a second: scripted runs,
    the tests)."""
    outcome, error, began = None, None, time.time()
    try:
        outcome = work()
        return outcome
    except (UserError, FastaError) as e:
        error = str(e)
        raise
    except KeyboardInterrupt as e:
        error = f"interrupted ({str(e) or 'SIGINT'})"
        raise
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
        raise
    finally:
        if not isinstance(outcome, Submitted):
            slurm = os.environ.get("SLURM_JOB_ID", "")
            events.append(run_dir.run_events_path, "ended", command=command, error=error,
                          seconds=round(time.time() - began, 3), slurm_job=slurm)
            if os.environ.get("RUN_SHARDS_REPORT", "1") != "0":
                write_report(run_dir, error)


def write_report(run_dir: RunDir, error: str | None = None) -> None:
    """OUT/report.html; a failure to write it is a warning, never the run's failure."""
    try:
        from .reporting import report
        log.info("report: %s", report.write(run_dir.root, error))
    except Exception as e:   # noqa: BLE001 - the run's outcome stands whatever the report does
        log.warning("could not write %s (%s: %s); `run_shards report %s` tries again", run_dir.root / "report.html",
                    type(e).__name__, e, run_dir.root)
