"""The local launcher: one worker process per GPU of this machine (or per CPU worker slot), spawned and
supervised until every shard has finished or stopped; an aggregate progress bar; a report of every
shard that did not finish, with the one command that continues the run.
"""
from __future__ import annotations

import logging

from ..config import RunConfig
from ..errors import UserError, run_stopped
from ..exits import EXIT_INTERRUPTED, EXIT_OK, EXIT_SHARD_BUSY, EXIT_USER_ERROR
from ..planning import devices
from .job import Launched, ShardJob, shards_summary
from .progress import ProgressBoard
from .supervisor import ShardProcess, Supervisor

log = logging.getLogger("run_shards")


def slots_for(config: RunConfig) -> list[str]:
    """Where workers run: the run's GPUs (or as many visible ones), or CPU worker slots."""
    slots = config.devices if config.on_gpu else [str(k) for k in range(config.workers)]
    if config.on_gpu:
        visible = devices.visible_gpus()
        missing = [d for d in slots if d not in visible]
        if missing and len(visible) >= len(slots):
            slots = visible[:len(slots)]
        elif missing:
            raise UserError(f"this run used GPUs {','.join(config.devices)}, and only {len(visible)} are "
                            "visible now; expose enough GPUs (CUDA_VISIBLE_DEVICES) and rerun")
    return slots


def launch(job: ShardJob) -> Launched:
    """Run the shards here. RunFailed (after recording why) when some did not finish; shards another process
    computes (it holds their locks) are left to it, and named in what it returns."""
    run, config = job.run, RunConfig.from_manifest(job.manifest)
    slots = slots_for(config)
    running = min(len(slots), len(job.ranks))
    where = f"{running} GPU(s)" if config.on_gpu else f"{running} CPU worker(s)"
    board = ProgressBoard(sum(job.remaining[r] for r in job.ranks), where, config.summary_seconds,
                          show_bar=job.show_progress)
    for r in job.ranks:
        board.expect(r, job.remaining[r])
    supervisor = Supervisor(run, job.ranks, slots, config.on_gpu, config.threads_per_worker, board,
                            config.worker_timeout, job.early)
    try:
        results = supervisor.wait()
    finally:
        board.close()
    if board.workers:
        log.info("per-shard summary:\n%s", board.table())
    launched = Launched(timings=(supervisor.started_at, board.compute_window()),
                        busy={p.rank: p.holder for p in results if p.exitcode == EXIT_SHARD_BUSY})
    for line in launched.busy_lines(run)[:-1]:
        log.info("%s", line)
    stopped = [p for p in results if p.exitcode not in (EXIT_OK, EXIT_SHARD_BUSY)]
    for p in stopped:
        run.record_failure(p.rank, run.new_failure(
            p.rank, p.exitcode, p.reason, p.signalled_for,
            interrupted=p.exitcode == EXIT_INTERRUPTED or bool(supervisor.interrupted),
            explanation=p.explanation if p.unlogged else "", rerun_repeats=p.rerun_repeats))
    if stopped or supervisor.interrupted:
        raise run_stopped(failure_report(job, supervisor, stopped, launched), bool(supervisor.interrupted))
    if board.workers:
        board.note(board.summary_line())
    return launched


def failure_report(job: ShardJob, supervisor: Supervisor, stopped: list[ShardProcess], launched: Launched) -> str:
    """What happened to every shard that did not finish, and the one command that continues the run."""
    run = job.run
    lines, failed, advised = [], [], []
    for p in stopped:
        if p.exitcode == EXIT_INTERRUPTED:
            s = job.state(p.rank)
            # A worker may finish its final checkpoint between the two signals: then it was not killed.
            if p.rank in supervisor.killed_at_once:
                why = f" (run_shards received {supervisor.interrupted} and asked it to stop)"
            else:
                why = f" ({p.killed_for})" if p.killed_for else ""
            lines.append(f"shard {p.rank} stopped at its final checkpoint{why}: {s.durable:,} of {s.expected:,} "
                         "sequences durable")
            continue
        if not supervisor.interrupted or p.rank in supervisor.killed_at_once:
            failed.append(p.rank)
            # (a worker's refusal whose message names a new run, or says which setting to change: rerunning
            # the shard cannot help)
            advised.append(p.exitcode == EXIT_USER_ERROR and ("`run_shards run " in p.reason or p.rerun_repeats))
        verb = "stopped" if supervisor.interrupted else "failed"
        lines.append(f"shard {p.rank} {verb}: {p.summary}")
        tail = run.log_tail(p.rank, 8)
        if run.gone():   # (its log went with the run directory, wherever that is now)
            pass
        elif (p.exitcode == EXIT_USER_ERROR and p.reason) or supervisor.interrupted:   # the message says it all
            lines.append(f"  log: {run.worker_log(p.rank)}")
        elif tail:
            lines.append(f"  last lines of {run.worker_log(p.rank)}:")
            lines += [f"    {t}" for t in tail]
    lines += launched.busy_lines(job.run)[:-1]
    if supervisor.pending:
        lines.append(f"shard(s) {', '.join(map(str, supervisor.pending))} were not started")
    if supervisor.interrupted and not stopped:   # (it came between shards, or as the last one finished)
        lines.append(f"{supervisor.interrupted} came while no shard was being computed: "
                     + ("the shards not started are left to do." if supervisor.pending else
                        "every shard had finished, and the result was not merged."))
    elif supervisor.interrupted:
        killed = [p.rank for p in stopped if p.rank in supervisor.killed_at_once and p.exitcode != EXIT_INTERRUPTED]
        # (and those that ended otherwise: a crash while stopping, a kill from outside, named above)
        other = [p.rank for p in stopped if p.rank not in killed and p.exitcode != EXIT_INTERRUPTED]
        lines.append(f"interrupted by {supervisor.interrupted}: " + (
            f"shard(s) {', '.join(map(str, killed))} were killed at once by the second signal, losing the rows "
            "since their last checkpoint; everything checkpointed is kept." if killed else
            f"shard(s) {', '.join(map(str, other))} ended without a final checkpoint (above), losing the rows since "
            "their last one; everything checkpointed is kept." if other else
            "every running worker wrote a final checkpoint."))
    return "\n".join(lines + shards_summary(job, bool(supervisor.interrupted), failed,
                                             advised=bool(advised) and all(advised)))
