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
from .rundir import run_log
from .output import shard_state
from .config import RunConfig
from .errors import RunDirError, UserError
from .planning import tokenization_check
from .planning.input_checks import (apply_input_policies, check_long, check_storage, free_out, load_run_index,
                                    start_over_advice)
from .launchers.job import ShardJob, Submitted
from .rundir.layout import RunDir, RunLock
from .tasks import make_task, schema_for
from .reporting.facts import unknown_residues_line
from .tasks.tokenization import SequenceTokenizer

log = logging.getLogger("run_shards")


# --------------------------------------------------------------------------------------------- run
def _file_attrs(config: RunConfig, source, engine: str, index: SequenceIndex, convention) -> dict:
    return {
        "task": config.task, "model": config.model, "model_fingerprint": source.fingerprint,
        "model_family": source.family.key, "input_format": convention.words(),
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
    model_source.refuse_remote_code(source, config.trust_remote_code)
    engine = engines.choose(config.engine, source, config.task)
    engines.check_dtype(engine, config.torch_dtype_name, config.on_gpu)
    hf_config = model_source.read_config(source, config.trust_remote_code)
    hf_tokenizer = model_source.read_tokenizer(source, hf_config, config.trust_remote_code)
    info = model_source.describe(source, engine, hf_tokenizer, config.trust_remote_code, hf_config)
    if source.facts.remote_code:
        log.warning("--trust-remote-code: the hf engine runs this checkpoint's own Python code (%s)",
                    "; ".join(source.facts.remote_code))
    convention = tokenization_check.decide_and_check(index, source, hf_tokenizer, config.input_format)
    task = make_task(config, info)
    limit = info.max_tokens
    if config.max_length:
        if limit and config.max_length > limit:
            log.warning("--max-length %d is above the model's own limit of %d tokens; using %d", config.max_length,
                        limit, limit)
        limit = min(limit, config.max_length) if limit else config.max_length
    tokenizer = SequenceTokenizer(hf_tokenizer, convention)
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
        "info": info.to_json(), "input_format": convention.to_json(),
        "index": {"fingerprint": index.fingerprint(), "count": len(index)},
        "attrs": _file_attrs(config, source, engine, index, convention),
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
                                                              started, options))
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
          ray_address: str | None = None, sbatch: str | None = None) -> Path | Submitted:
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
            if sbatch is not None and launcher != "slurm":
                raise UserError(f"--sbatch applies only to runs with --launcher slurm (this run's launcher is "
                                f"{launcher})")
            if sbatch is not None and sbatch != manifest["config"].get("sbatch", ""):
                log.info("--sbatch %r from now on (was %r)", sbatch, manifest["config"].get("sbatch", ""))
                manifest["config"]["sbatch"] = sbatch     # kept: a later rerun submits with it too
                run_dir.write_manifest(manifest)
                manifest = run_dir.read_manifest()
            if ray_address is not None:
                manifest["config"]["ray_address"] = ray_address
            if worker_timeout:
                manifest["config"]["worker_timeout"] = worker_timeout
            return _reported(run_dir, lambda: _run_shards(run_dir, manifest, index, shards, show_progress,
                                                          time.time(), options))
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
            aside = shard_state.set_aside(run.shard_path(s.rank))
            log.warning("shard %d cannot be used (%s); set aside as %s and computed again", s.rank,
                        s.detail.split(";")[0], aside.name)
    ranks = [r for r in (only if only else range(config.world)) if states[r].state != "complete"]
    for r in (only or []):
        if states[r].state == "complete":
            log.info("shard %d is already complete", r)
    if ranks and config.launcher == "slurm":
        running = [r for r in ranks if RunLock.shard_running(run, r)]
        if running:   # a task still holds them; submitting them again would only queue a refusal
            # (Ray's launcher waits for its tasks and then merges, so it keeps them: their tasks wait for
            # the shard's lock to be free.)
            log.info("shard(s) %s are being computed now; not submitted again", ", ".join(map(str, running)))
            ranks = [r for r in ranks if r not in running]
            if not ranks:
                return Submitted(f"every unfinished shard is being computed now; follow with `run_shards status "
                                 f"{run.root}`")
    timings = None
    if ranks:
        job = ShardJob(run, manifest, index, ranks, {r: states[r].expected - states[r].durable for r in ranks},
                       show_progress, options=dict(options or {}))
        outcome = launchers.launch(job)
        if outcome is not None:
            return outcome
        timings = job.options.get("timings")
    changed = index.records_changed()   # edited after the last shard's last check: the result would not describe it
    if changed:
        raise UserError(f"the input FASTA changed during the run ({changed}); nothing was merged. "
                        f"{start_over_advice(run, manifest)}")
    path = result_merge.merge_result(run, manifest, index, allow_partial=False)
    unknown = unknown_residues_line(run)
    if unknown:
        log.warning("%s", unknown)
    if timings and timings[1]:
        spawned, (first, last) = timings
        end = time.time()
        log.info("timings: prepare %.1f s, start workers and load model %.1f s, compute %.1f s, finish shards and "
                 "merge %.1f s; total %.1f s, %.1f%% outside model compute", spawned - started, first - spawned,
                 last - first, end - last, end - started, 100.0 * (1 - (last - first) / max(end - started, 1e-9)))
    return path


def merge(out: str, allow_partial: bool = False) -> Path:
    """`run_shards merge`: merge and validate the shards of OUT into OUT/result.h5."""
    run_dir = RunDir(out)
    run_dir.read_manifest()   # a clear error for a wrong directory before creating a lock file there
    with RunLock(run_dir, "merge"):
        handler = run_log.attach(run_dir)   # run.log keeps what the merge says (a SLURM merge job's too)
        try:
            run_dir.remove_stale_temporaries()
            manifest = run_dir.read_manifest()
            return _reported(run_dir, lambda: result_merge.merge_result(
                run_dir, manifest, load_run_index(run_dir, manifest), allow_partial))
        except (UserError, FastaError) as e:
            handler.write_only_here(logging.ERROR, f"error: {e}")
            raise
        finally:
            run_log.detach(handler)


def _reported(run_dir: RunDir, work):
    """Run `work`, then write OUT/report.html however it ended, with the error that ended it (not for a
    submission to a scheduler, whose jobs have not run yet). RUN_SHARDS_REPORT=0 leaves it out (about a
    second: scripted runs, the tests)."""
    outcome, error = None, None
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
        if not isinstance(outcome, Submitted) and os.environ.get("RUN_SHARDS_REPORT", "1") != "0":
            write_report(run_dir, error)


def write_report(run_dir: RunDir, error: str | None = None) -> None:
    """OUT/report.html; a failure to write it is a warning, never the run's failure."""
    try:
        from .reporting import report
        log.info("report: %s", report.write(run_dir.root, error))
    except Exception as e:   # noqa: BLE001 - the run's outcome stands whatever the report does
        log.warning("could not write %s (%s: %s); `run_shards report %s` tries again", run_dir.root / "report.html",
                    type(e).__name__, e, run_dir.root)
