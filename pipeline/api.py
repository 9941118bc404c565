"""The parent's work behind `run`, `rerun` and `merge`, as Python functions with typed arguments.

Each takes plain arguments and returns a result, so the CLI only parses and prints. The parent plans the
run (planning/plan.py), supervises or submits the shards (launchers/) and merges; it never initialises CUDA.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from index import FastaError, SequenceIndex, records_changed

from .advice import command, files_shown, previewing
from . import __version__, launchers
from .config import RunConfig, misplaced, overlap_setting
from .errors import RunFailed, RunInterrupted, UserError
from .launchers.job import ShardJob, Submitted
from .launchers.sbatch_scripts import array_ranges, merged_ranges
from .output import copy_plan, result as result_merge, shard_state, variants as variants_output
from .output.copy_plan import CopyPlan
from .output.h5io import CorruptFile, Reader
from .planning.continued import with_launch_settings
from .planning.copies import check_plan
from .planning.model_copies import check_model_copies
from .planning.plan import plan
from .planning.run_index import load_run_index, start_over_advice
from .processes import command_began
from .reporting.facts import row_status_lines
from .rundir import events, run_log
from .rundir.layout import RunDir, free_out
from .rundir.locks import RunLock, ShardLock, wait_for_running_shards

log = logging.getLogger("run_shards")


@dataclass
class NotMerged:
    """The shards a command was asked for are done, others are not: nothing was merged. `text` says which
    are left and the command that finishes the run."""
    text: str


@contextlib.contextmanager
def command_session(run: RunDir, purpose: str, lock_wait: float = 0.0, again: str | None = None):
    """What `run`, `rerun` and `merge` do around their work: hold the run's lock (waiting up to `lock_wait`
    seconds for another command's; `again`: the command line that starts a new run again, which the lock
    records for a run killed while it plans), keep the log in run.log, remove what a killed command left, and
    record a user error in run.log (the terminal shows it: cli.py)."""
    with RunLock(run, purpose, wait_seconds=lock_wait, again=again) as lock:
        handler = run_log.attach(run)
        try:
            if lock.took_over:
                log.warning("took over a stale lock left by pid %s", lock.took_over.get("pid"))
            run.remove_stale_temporaries()
            run.restore_folders()
            run.check_entry_kinds()
            yield lock
        except (UserError, FastaError) as e:
            handler.write_only_here(logging.ERROR, f"error: {e}")
            raise
        except RunInterrupted as e:
            handler.write_only_here(logging.ERROR, f"interrupted: {e}")
            raise
        finally:
            run_log.detach(handler)


def run(config: RunConfig, show_progress: bool = True, dry_run: bool = False, wait: bool = False
        ) -> Path | Submitted | NotMerged:
    """Plan (index, input checks, manifest), launch the shards, merge. Returns the merged file's path, or
    what a scheduler was handed (`dry_run`, `wait`: --launcher slurm).

    When planning stops before the run's manifest exists (a refusal, an interruption, or any other error),
    the output directory is left as it was found: removed if this command created it, nothing half-made
    kept in it. `config` is not changed.
    """
    from .launchers.early_workers import start_early
    from .launchers.waiting_workers import WaitingWorkers
    if config.launcher == "local":   # (a cluster's tasks read their nodes' environment)
        overlap_setting()
    run_dir = RunDir(config.out)
    existed = run_dir.root.exists()
    run_dir.create()
    # (a command refused by the lock undoes nothing: what is there belongs to the command planning there now)
    with command_session(run_dir, "run", again=None if run_dir.exists() else config.as_command(str(run_dir.root))):
        try:
            log.info("run_shards %s: %s", __version__, files_shown(config.fasta))
            started = command_began()   # (the process's start for the CLI: its imports are the command's time too)
            # Workers import and set up their devices while this plans; none where the run's result is already
            # there (the same command again computes nothing, and a changed one is refused).
            early = start_early(config, run_dir) if _finished_rows(run_dir) is None else WaitingWorkers()
            try:
                with previewing(dry_run):   # (a refusal's suggested commands preview too)
                    planned = plan(config, on_model=early.load_ahead, progress=show_progress)
                    with planned.index as index:
                        manifest = planned.record(run_dir)
                        options = dict(dry_run=dry_run, wait=wait, early=early)
                        return _reported(run_dir, lambda: _run_shards(run_dir, manifest, index, None, show_progress,
                                                                      started, options), "run")
            finally:
                early.close()
        except BaseException:
            if not run_dir.exists():   # undone under the lock, so no command can have started there meanwhile
                run_dir.discard_unstarted(remove_root=not existed)
            raise


def rerun(out: str, shards: Sequence[int | range] | None = None, show_progress: bool = True, dry_run: bool = False,
          wait: bool = False, worker_timeout: float | None = None, ray_address: str | None = None,
          sbatch: str | None = None, merge_sbatch: str | None = None) -> Path | Submitted | NotMerged:
    """Re-run failed or unfinished shards (all, or those in `shards`: numbers, or ranges of them) from their
    checkpoints, locally or resubmitted to the run's scheduler, then merge. `worker_timeout`, `ray_address`,
    `sbatch` and `merge_sbatch` replace the run's settings, for this command and later ones."""
    began = command_began()   # (its time split counts the index's load too: seconds for a run of millions)
    run_dir = RunDir(out)
    run_dir.read_manifest()   # a clear error for a wrong directory before creating a lock file there
    # (as run's: a --dry-run's refusals, a FASTA or checkpoint changed since, suggest commands that preview too)
    with command_session(run_dir, "rerun"), previewing(dry_run):
        # (run.log holds every command's lines: this one marks where the rerun's begin)
        log.info("run_shards %s: rerun %s%s", __version__, run_dir.root,
                 f" --shards {array_ranges(shards)}" if shards else "")
        manifest = run_dir.read_manifest()
        config = RunConfig.from_manifest(manifest)
        launch = {k: v for k, v in (("worker_timeout", worker_timeout), ("ray_address", ray_address),
                                    ("sbatch", sbatch), ("merge_sbatch", merge_sbatch)) if v is not None}
        wrong = misplaced([*launch, *(k for k, v in (("dry_run", dry_run), ("wait", wait)) if v)],
                          {"task": config.task, "launcher": config.launcher})
        if wrong:
            raise UserError(wrong)
        if config.launcher == "local":
            overlap_setting()
        world, asked = manifest["world"], merged_ranges(shards or [])
        bad = merged_ranges(part for r in asked for part in (range(r.start, min(r.stop, 0)),
                                                             range(max(r.start, world), r.stop)))
        if bad:   # (before the ranges are counted out: `--shards 0-20000000` of a 1-shard run)
            raise UserError(f"--shards {array_ranges(bad)}: this run has shards 0..{world - 1}")
        shards = [k for r in asked for k in r] or None
        manifest = _in_its_place(run_dir, manifest)
        changed = with_launch_settings(manifest, launch, "this command's")
        if changed is not manifest:
            run_dir.write_manifest(changed)
            manifest = run_dir.read_manifest()
        with load_run_index(run_dir, manifest, refresh_copies=True, progress=show_progress) as index:
            return _reported(run_dir, lambda: _run_shards(run_dir, manifest, index, shards, show_progress,
                                                          began, dict(dry_run=dry_run, wait=wait,
                                                                      copies_unchecked=True)), "rerun")


def merge(out: str, allow_partial: bool = False, lock_wait: float = 0.0) -> Path:
    """`run_shards merge`: merge and validate the shards of OUT into OUT/result.h5. `lock_wait`: how long to
    wait for another command working in OUT and for shards being computed (a SLURM merge job waits)."""
    run_dir = RunDir(out)
    run_dir.read_manifest()   # a clear error for a wrong directory before creating a lock file there
    # (run.log keeps what the merge says, a SLURM merge job's too)
    with command_session(run_dir, "merge", lock_wait) as lock:
        manifest = run_dir.read_manifest()
        if lock.waited and _finished_rows(run_dir) is not None:
            log.info("%s was merged meanwhile by the command this one waited for", run_dir.result_path)
            return run_dir.result_path
        wait_for_running_shards(run_dir, manifest["world"], lock_wait, *(["--allow-partial"] if allow_partial else []))
        manifest = _in_its_place(run_dir, manifest)
        with load_run_index(run_dir, manifest) as index:
            check_plan(run_dir, manifest)   # (`rerun` builds it again)
            return _reported(run_dir, lambda: result_merge.merge_result(run_dir, manifest, index, allow_partial),
                             "merge")


def _in_its_place(run: RunDir, manifest: dict) -> dict:
    """The manifest of a run directory moved or copied since its plan (mv, cp -a, rsync) with --out where it
    is now: result.h5's `config` attribute and the commands its messages suggest named the old place."""
    if manifest["config"].get("out") == str(run.root):
        return manifest
    placed = with_launch_settings(manifest, {"out": str(run.root)}, "the run directory's new place:")
    try:   # (kept for later commands; on a full disk this one goes on with it in memory: it must not stop one)
        run.write_manifest(placed)
        return run.read_manifest()
    except OSError as e:
        log.info("could not record the run directory's new place in %s (%s)", run.manifest_path, e.strerror or e)
        return placed


def _finished_rows(run: RunDir) -> int | None:
    """The rows of the run's merged result when it is complete (a result.h5 exists only once merged and
    validated: output/result.py renames it into place), else None."""
    try:
        with Reader(run.result_path) as r:
            return r.rows if r.attrs.get("complete") else None
    except (OSError, CorruptFile):
        return None


def _run_shards(run: RunDir, manifest: dict, index: SequenceIndex, only: list[int] | None,
                show_progress: bool, started: float, options: dict) -> Path | Submitted | NotMerged:
    """Verify what is on disk, hand the unfinished shards to the run's launcher, merge when they are done."""
    from .models import checkpoint
    config = RunConfig.from_manifest(manifest)
    finished = _finished_rows(run)
    if finished is not None:   # the same command again: the result stands (merging again would rewrite it)
        log.info("%s is complete: %s holds all %s rows; nothing was computed or merged again", run.root,
                 run.result_path.name, f"{finished:,}")
        # but the CSV copy of a variants table is written where this command asks (--variants-out, maybe a
        # new name, or the old file deleted since): it is only a copy of the result's table
        if not options.get("dry_run") and variants_output.export(run, manifest):
            log.info("wrote the variants table to %s", manifest["config"]["variants_out"])
        return run.result_path
    checkpoint.check_unchanged(manifest["model"], "start a new run on the checkpoint as it is now: "
                               f"`{config.as_command(free_out(run.root))}`")
    if run.copies_path.exists():   # the results it reuses rows of: still there, before any compute
        plan = CopyPlan(run.copies_path)
        try:
            copy_plan.check_sources(run, manifest, plan)
        finally:
            plan.close()
    states = _settled_states(run, index, config.world)
    ranks = [r for r in (only or range(config.world)) if states[r].state != "complete"]
    for r in (only or []):
        if states[r].state == "complete":
            log.info("shard %d is already complete", r)
    timings = None
    if ranks:
        if options.get("copies_unchecked"):   # (a rerun: `run` checked while planning, before workers loaded ahead)
            check_model_copies(config, manifest["model"]["path"], len(ranks), planned=True)
        continued = _continued_line(states, ranks)
        if continued:
            log.info("%s", continued)
        job = ShardJob(run, manifest, index, ranks, {r: states[r].expected - states[r].durable for r in ranks},
                       show_progress, dry_run=bool(options.get("dry_run")), wait=bool(options.get("wait")),
                       early=options.get("early"))
        outcome = launchers.launch(job)
        if isinstance(outcome, Submitted):
            return outcome
        if outcome.busy:   # another process computes them: nothing to merge yet, nothing failed
            raise RunFailed("\n".join(outcome.busy_lines(run)))
        timings = outcome.timings
    left = [r for r in range(config.world) if r not in ranks and states[r].state != "complete"]
    if only and left:   # what was asked is done; the merge needs the rest
        return NotMerged(f"shard(s) {', '.join(map(str, only))} complete; shard(s) {', '.join(map(str, left))} not "
                         f"finished, so nothing was merged: `{command('rerun', run.root)}` computes them and merges")
    changed = records_changed(index)   # edited after the last shard's last check: the result would not describe it
    if changed:
        raise UserError(f"the input FASTA changed during the run ({changed}); nothing was merged. "
                        f"{start_over_advice(run, manifest)}")
    path = result_merge.merge_result(run, manifest, index, allow_partial=False)
    for warn, text in row_status_lines(run):
        log.log(logging.WARNING if warn else logging.INFO, "%s", text)
    _log_timings(run, timings, started)
    return path


def _continued_line(states: dict, ranks: list[int]) -> str | None:
    """What a command continuing a run starts from, since its bar and summary lines count only what is left:
    the rows durable from earlier commands and the shards it computes. None for a run starting afresh."""
    durable = sum(s.durable for s in states.values())
    if not durable:
        return None
    total = sum(s.expected for s in states.values())
    left = sum(states[r].expected - states[r].durable for r in ranks)
    complete = sum(s.state == "complete" for s in states.values())
    return (f"continuing: {durable:,} of the {total:,} sequences to compute are durable from earlier commands "
            f"({complete:,} of {len(states):,} shard(s) complete); {left:,} left, in shard(s) "
            f"{', '.join(map(str, ranks))}")


def _settled_states(run: RunDir, index: SequenceIndex, world: int) -> dict:
    """Each shard's state, found before any work, after setting aside every shard file that cannot be used
    (so one `rerun` computes every damaged shard) and putting back any set aside earlier that holds exactly
    its shard's rows and reads back intact."""
    states = {}
    for r in range(world):
        expected = index.stride_shard(r, world)
        s = shard_state.inspect(run, expected, r, verify_shard=True)
        aside = _set_aside(run, r) if s.state == "corrupt" else None
        restored = shard_state.restore_set_aside(run, expected, r) if s.state != "complete" else None
        if aside:
            log.warning("shard %d cannot be used (%s); set aside as %s%s", r, s.detail.split(";")[0], aside.name,
                        "" if restored else " and computed again")
        if restored:
            log.info("shard %d: %s holds exactly this shard's rows and reads back intact: put back in place", r,
                     restored.name)
        if aside or restored:
            s = shard_state.inspect(run, expected, r, verify_shard=False)
        states[r] = s
    return states


def _set_aside(run: RunDir, rank: int) -> Path | None:
    """Set shard `rank`'s damaged file aside, under the shard's lock (never under a worker finishing it:
    then None, and its worker replaces the file)."""
    aside: list[Path] = []
    ShardLock(run, rank).if_free(lambda: aside.append(shard_state.set_aside(run.shard_path(rank))))
    return aside[0] if aside else None


def _log_timings(run: RunDir, timings, started: float) -> None:
    """The run's time split, in run.log for people and as a `timings` event for the report."""
    if not timings or not timings[1]:
        return
    spawned, (first, last) = timings
    end = time.monotonic()
    split = {"prepare": spawned - started, "start_and_load": first - spawned, "compute": last - first,
             "finish_and_merge": end - last}
    log.info("timings: prepare %.1f s, start workers and load model %.1f s, compute %.1f s, finish shards and "
             "merge %.1f s; total %.1f s, %.1f%% outside model compute", *split.values(), end - started,
             100.0 * (1 - (last - first) / max(end - started, 1e-9)))
    events.append(run.run_events_path, "timings", **split)   # unrounded: the page rounds as this line


def _reported(run_dir: RunDir, work, command: str):
    """Run `work`, then record how the command ended (an `ended` event: its error, its seconds) and write
    OUT/report.html however it ended, with the error that ended it (not for a submission to a scheduler,
    whose jobs have not run yet). RUN_SHARDS_REPORT=0 leaves the page out (scripted runs, the tests)."""
    outcome, error, began = None, None, time.monotonic()
    try:
        outcome = work()
        return outcome
    except (UserError, FastaError, RunInterrupted) as e:
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
            events.append(run_dir.run_events_path, "ended", command=command, error=error,
                          seconds=round(time.monotonic() - began, 3), slurm_job=os.environ.get("SLURM_JOB_ID", ""))
            if os.environ.get("RUN_SHARDS_REPORT", "1") != "0":
                with previewing(False):   # (the page outlives a --dry-run: its commands are plain ones)
                    write_report(run_dir, error)


def write_report(run_dir: RunDir, error: str | None = None) -> None:
    """OUT/report.html; a failure to write it, or a Ctrl-C while it is written, is a warning, never the run's
    failure (a merged result stays a success: the command does not end as interrupted for its page)."""
    try:
        from .reporting import report
        log.info("report: %s", report.write(run_dir.root, error))
    except (Exception, KeyboardInterrupt) as e:   # noqa: BLE001 - the run's outcome stands whatever the report does
        why = "interrupted" if isinstance(e, KeyboardInterrupt) else f"{type(e).__name__}: {e}"
        log.warning("could not write %s (%s); `%s` tries again", run_dir.root / "report.html", why,
                    command("report", run_dir.root))


def report_path(result: Path) -> Path | None:
    """The report beside a merged result, when one was written."""
    path = Path(result).parent / "report.html"
    return path if path.exists() else None
