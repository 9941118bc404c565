"""What `status` adds for a SLURM run: each shard's task as the scheduler sees it (running, pending,
requeued, or ended, with SLURM's own reason), the last submission and its merge job, and, when the merge job
cannot run, why and the command that finishes the run."""
from __future__ import annotations


from ..advice import command
from ..config import RunConfig
from ..launchers.sbatch_scripts import array_ranges, split_arrays
from ..launchers.slurm import array_commands, by_hand
from ..launchers.slurm_limits import max_array_size
from ..launchers.slurm_queue import (SETTINGS_REFUSED, Queue, slurm_dir, stopped_lines,
                                     unrecorded_jobs, unrecorded_lines)
from ..output.shard_state import ShardState
from ..rundir import events
from ..rundir.layout import RunDir

UNFINISHED = ("failed", "corrupt", "interrupted")


def amend(states: list[ShardState], queue: Queue) -> None:
    """Shard states as the scheduler knows them: `running`, `pending` or `requeued` while SLURM runs or holds
    the shard's task (the run directory alone cannot tell), and SLURM's word on a task that is ending or
    ended."""
    for s in states:
        task = queue.task_of(s.rank)
        if task is None or s.state in ("complete", "corrupt"):
            continue
        said = f"SLURM task {task.job_id}: {task.words()}"
        if task.running or s.state == "running":
            s.state, s.detail = "running", said
        elif task.ending:   # requeued or ended in seconds: the run directory's word (interrupted, failed) holds
            s.detail = "; ".join(d for d in (s.detail, said) if d)
        elif task.live:
            s.state = "requeued" if task.requeued else "pending"
            s.detail = "; ".join(d for d in (said, s.detail) if d)
        elif task.state != "COMPLETED":
            s.detail = "; ".join(d for d in (s.detail, said) if d)
            if task.state != "CANCELLED" and s.state in ("pending", "partial"):
                s.state = "failed"   # it ended without a word of its own (failed to launch, its node died)


def lines(run: RunDir, states: list[ShardState], queue: Queue, writable: bool) -> list[str]:
    """The slurm section of `status`."""
    hand = unrecorded_jobs(run, queue.subs) if not run.result_path.exists() else None
    if hand:
        said = unrecorded_lines(run, hand)
        return ([] if not queue.subs else [_last_submitted(queue)]) + [f"slurm: {said[0]}", f"  {said[1]}"]
    if not queue.subs:
        return [_nothing_submitted(run)]
    out = [_last_submitted(queue)]
    if run.result_path.exists():
        return out
    refused = _last_refusal(run)
    if refused is not None:   # a later submission (rerun with new options) was refused: its advice too
        out.append(f"  then nothing more was submitted: {refused['error'].splitlines()[0]}\n  "
                   f"{_other_options(refused)}")
    by_state: dict[str, list[int]] = {}
    for s in states:
        by_state.setdefault(s.state, []).append(s.rank)
    now = [f"{array_ranges(by_state[k])} {k}" for k in ("running", "requeued", "pending") if by_state.get(k)]
    if now and queue.answered:
        out.append(f"  shard(s) {'; '.join(now)} in SLURM now")
    return out + ["  " + line for line in _next(run, states, queue, writable)]


def _last_submitted(queue: Queue) -> str:
    last, merge = queue.subs[-1], queue.merge
    shown = f" ({merge.words()})" if merge is not None else ""
    return (f"slurm: last submitted {last['submitted']}: job array(s) "
            f"{', '.join(a['job_id'] + ' [' + a['array'] + ']' for a in last['arrays']) or 'none'}, merge job "
            f"{queue.merge_id}{shown}")


def _last_refusal(run: RunDir) -> dict | None:
    """sbatch's refusal of the latest submission, if it came after the last one that was accepted."""
    last = next((e for e in reversed(events.read(run.run_events_path)) if e["event"] in ("submitted", "refused")),
                None)
    return last if last is not None and last["event"] == "refused" else None


def _other_options(refused: dict) -> str:
    option = refused.get("option") or "--sbatch"   # which job's options sbatch refused (the merge job's, too)
    return f"(`rerun {option} \"...\"` submits with other options)"


def _nothing_submitted(run: RunDir) -> str:
    """Why no job was submitted: a --dry-run, or sbatch refused (the run's events say which)."""
    last = next((e for e in reversed(events.read(run.run_events_path)) if e["event"] in ("dry_run", "refused")), None)
    if last is not None and last["event"] == "refused":
        return (f"slurm: nothing submitted: {last['error'].splitlines()[0]}\n  {_other_options(last)} "
                f"Continue with:  {command('rerun', run.root)}")
    why = "a --dry-run wrote the scripts" if last is not None else "the scripts are written"
    return (f"slurm: nothing submitted yet ({why}: {slurm_dir(run)}); `{command('rerun', run.root)}` submits "
            "them")


def _next(run: RunDir, states: list[ShardState], queue: Queue, writable: bool) -> list[str]:
    """What happens next, and what to run when the merge job cannot run."""
    merge_id, merge = queue.merge_id, queue.merge_state()
    stopped = {s.rank: s.state for s in states if s.state in UNFINISHED}
    unfinished = [s.rank for s in states if s.state != "complete"]
    tasks = {r: t for r in stopped if (t := queue.task_of(r)) is not None}
    if stopped and ("failed" in stopped.values() or "corrupt" in stopped.values() or merge == "gone"):
        if run.settings_refused(stopped):
            return stopped_lines(run, stopped, tasks) + [
                f"so merge job {merge_id} cannot run" + (" (SLURM cancels it)" if merge == "waiting" else "")
                + f"; {SETTINGS_REFUSED}"]
        return stopped_lines(run, stopped, tasks) + _rerun_lines(run, queue, merge, sorted(stopped), writable)
    if stopped and merge is None:
        return stopped_lines(run, stopped, tasks) + [
            f"squeue gave no answer here, so whether SLURM requeues them is unknown: a task that was preempted "
            f"or reached its time limit is requeued and continues from its checkpoints (merge job {merge_id} "
            f"waits for it); one that was cancelled is not: then continue with:  {command('rerun', run.root)}"]
    if stopped:
        ending = [r for r, t in tasks.items() if t.ending]
        return [f"shard(s) {array_ranges(list(stopped))} were interrupted (preempted, or near their time limit); "
                f"SLURM requeues their tasks, which continue from their checkpoints, and merge job {merge_id} "
                "waits for them"] + ([
                    f"shard(s) {array_ranges(ending)}: SLURM is ending their task(s) (COMPLETING), then requeues "
                    f"them; where they were cancelled instead, continue with:  {command('rerun', run.root)}"]
                    if ending else [])
    if unfinished and merge == "gone":
        return [f"merge job {merge_id} is no longer queued, and shard(s) {array_ranges(unfinished)} are not "
                "complete: their tasks were cancelled, or ended without a trace here"] + _rerun_lines(
                    run, queue, merge, unfinished, writable)
    if unfinished and merge == "waiting":
        return [f"{len(unfinished):,} shard(s) to go; merge job {merge_id} writes the result once every shard "
                "is complete"]
    if unfinished:
        return [f"{len(unfinished):,} shard(s) to go; squeue gave no answer here, so whether their tasks and "
                f"merge job {merge_id} are still queued is unknown (run status where SLURM's commands work)"]
    if merge == "waiting":
        return [f"every shard is complete; merge job {merge_id} is queued or running and writes the result"]
    log = run.logs_dir / f"slurm_merge_{merge_id}.out"
    how = (f"it failed: {log}" if log.exists() else "it never started: it left no log") if merge == "gone" else \
        (f"still queued, or it failed: {log}" if log.exists() else "still queued, or gone without a log")
    return [f"every shard is complete; merge job {merge_id} has not written the result ({how}). "
            f"{_where(writable)}Continue with:  {command('merge', run.root)}"]


def _where(writable: bool) -> str:
    return "" if writable else "Where the run directory is writable (it is not here): "


def _rerun_lines(run: RunDir, queue: Queue, merge: str | None, ranks: list[int], writable: bool) -> list[str]:
    """The command that finishes the run, and the same submission by hand."""
    config = RunConfig.from_manifest(run.read_manifest())   # what OUT/slurm/shards.sbatch was last written with
    per_task = config.shards_per_task
    commands = array_commands(split_arrays(sorted({r // per_task for r in ranks}), max_array_size(True)),
                               config.array_throttle, slurm_dir(run) / "shards.sbatch")
    return [f"so merge job {queue.merge_id} cannot run" + (" (SLURM cancels it)" if merge == "waiting" else "")
            + f". {_where(writable)}Continue with:  {command('rerun', run.root)}",
            f"(the same by hand: {by_hand(commands, slurm_dir(run) / 'merge.sbatch', '', '; ')})"]
