"""The Ray launcher: one Ray task per shard, each running `run_shards work OUT --shard K` where Ray places it.

Each task asks Ray for one GPU (a GPU run) or none, and --threads CPUs. Ray retries a task whose worker or
node died, and one whose shard failed, up to MAX_RETRIES times; the shard's `work` process dies with the
task's worker (SIGTERM: a final checkpoint, then its lock is free for the retry). The driver follows the run
directory with a progress bar and returns once every task has ended; the runner then merges. `rerun`
submits the unfinished shards again as tasks. Ray is an optional extra (setup.cfg's `ray`: RAY_REQUIREMENT).
"""
from __future__ import annotations

import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..advice import command
from ..config import RunConfig
from ..errors import RunFailed, RunInterrupted, UserError
from ..exits import EXIT_COMMAND_USER_ERROR, EXIT_OK, explain_exit
from ..rundir import events
from ..rundir.locks import ShardLock
from .job import Launched, ShardJob, follow_run_dir, self_command, shards_summary
from .progress import ProgressBoard

log = logging.getLogger("run_shards")

MAX_RETRIES = 3            # Ray retries of a shard's task: its worker or node died, or the shard failed
POLL_SECONDS = 2.0         # how often the progress bar reads the run directory
STOP_SECONDS = 120.0       # after Ctrl-C: how long to wait for the shards' final checkpoints
FORCE_SECONDS = 5.0        # after Ctrl-C: how long a cancelled task has to stop before its Ray worker is killed
# What a shard's computation reads from the environment, passed to its task as sbatch --export=ALL would;
# never CUDA_VISIBLE_DEVICES or PATH, which belong to the node Ray picked.
FORWARDED_ENV = ("RUN_SHARDS_", "HF_", "TRANSFORMERS_", "HDF5_")
# Names the command that submitted a task, for its `work`: a task attempt Ray starts after that command cancelled
# its tasks (a retry racing the cancel; under load one started after the driver had left and computed its shard
# for a minute, holding the lock `rerun` then met) finds the command's `cancelled` event and computes nothing.
SUBMISSION_VARIABLE = "RUN_SHARDS_RAY_SUBMISSION"


def launch(job: ShardJob) -> Launched:
    """Run every shard of `job` as a Ray task; once all succeeded, what the caller needs to merge; else
    RunFailed. Shards another process computes now (their locks are held) are not submitted again."""
    running = [r for r in job.ranks if ShardLock(job.run, r).held_elsewhere()]
    busy = {r: ShardLock(job.run, r).holder() for r in running}
    if running:
        log.info("shard(s) %s are being computed now (their lock is held); not submitted again",
                 _ranges(running))
        job.ranks = [r for r in job.ranks if r not in busy]
    outcomes = []
    if job.ranks:
        ray = _import_ray(job.run.root)
        config = RunConfig.from_manifest(job.manifest)
        connected_here = _connect(ray, config.ray_address)
        try:
            refs, submission = _submit(ray, job, config)
            outcomes = _follow(ray, job, config, refs, submission)
        finally:
            if connected_here:   # stops a local Ray started here; a cluster's driver only disconnects
                ray.shutdown()
    failed = [o for o in outcomes if o.exit_code != EXIT_OK]
    if failed:
        raise RunFailed(_failure_report(job, failed))
    for o in outcomes:   # `work` stepped aside: another process holds the shard
        if job.state(o.rank).state != "complete":
            busy[o.rank] = ShardLock(job.run, o.rank).holder()
    return Launched(busy=busy)


# ------------------------------------------------------------------------------------------ driver side
RAY_REQUIREMENT = "ray>=2.9"   # setup.cfg's `ray` extra (tests/test_ray_launcher.py holds them equal)


def _import_ray(root: Path):
    try:
        import ray
    except ImportError as e:
        # What the extra installs, into this interpreter's environment: it works whether run_shards came from a
        # checkout or a path (`pip install "run_shards[ray]"` would ask an index for a package it does not hold).
        install = f"{shlex.quote(sys.executable)} -m pip install {shlex.quote(RAY_REQUIREMENT)}"
        raise UserError(f"--launcher ray needs Ray, which {sys.executable} cannot import ({e}): install it with "
                        f"`{install}`, then `{command('rerun', root)}`") from None
    return ray


def _connect(ray, address: str) -> bool:
    """Connect to the cluster at `address` (empty: Ray's own choice: RAY_ADDRESS, a `ray start` cluster on
    this machine, else a new local Ray). False when this process was a Ray driver already."""
    if ray.is_initialized():
        return False
    where = f"the Ray cluster at {address!r}" if address else "Ray"
    advice = ("Check --ray-address (e.g. `auto` on a node of a running cluster), or leave it out to start a local "
              "Ray on this machine")
    unreachable = _unreachable(address)
    if unreachable:   # Ray itself would retry for minutes before saying so
        raise UserError(f"cannot connect to {where}: {unreachable}. {advice}")
    handlers = _stop_signal_handlers()
    try:   # the workers' output and Ray's own logs stay in its session logs (/tmp/ray), off the terminal
        ray.init(address=address or None, include_dashboard=False, log_to_driver=False,
                 logging_level=logging.ERROR)
    except Exception as e:   # ConnectionError, RuntimeError, ray's own errors: all say why in their text
        while e.__cause__ is not None:
            e = e.__cause__
        raise UserError(f"cannot connect to {where}: {_first_line(e)}. {advice}") from None
    finally:
        _restore_signal_handlers(handlers)
    _quiet_ray_messages(ray)
    return True


def _stop_signal_handlers() -> dict:
    """This command's handlers of the stop signals (SIGTERM, SIGHUP and SIGUSR1 raised like Ctrl-C)."""
    return {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)}


def _restore_signal_handlers(handlers: dict) -> None:
    """Put back the handlers that ray.init replaced: its core worker installs a crash handler for SIGTERM that
    prints a C++ stack and kills the driver, so that a SIGTERM (a scheduler stopping the job, `kill`) skipped
    the cancel-and-checkpoint path and the message that names `rerun`."""
    for sig, handler in handlers.items():
        if callable(handler):   # set again even where Python's record is unchanged: Ray replaced it below
            signal.signal(sig, _noting_the_signal(handler))
        elif handler is not None:
            signal.signal(sig, handler)


_received: list[str] = []   # the stop signals this driver received, in order


def _noting_the_signal(handler):
    """The handler, noting its signal's name first: Ray's wait turns the handler's exception into a bare
    KeyboardInterrupt, which would report a SIGTERM as SIGINT."""
    def noting(signum, frame):
        _received.append(signal.Signals(signum).name)
        return handler(signum, frame)
    return noting


def _unreachable(address: str) -> str | None:
    """Why a HOST:PORT address cannot be reached (a TCP connection within 10 s), or None."""
    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():
        return None   # "auto", ray://..., or a form Ray resolves itself
    try:
        socket.create_connection((host, int(port)), timeout=10).close()
    except OSError as e:
        return f"nothing answers at {host}:{port} ({e.strerror or e})"
    return None


def _quiet_ray_messages(ray) -> None:
    """Ray prints its task-retry notices (with the task's traceback) on the driver's stdout; our progress
    loop reports retries from the shards' events instead."""
    worker = getattr(getattr(ray, "_private", None), "worker", None)
    if worker is not None and hasattr(worker, "_worker_logs_enabled"):
        worker._worker_logs_enabled = False


def _submit(ray, job: ShardJob, config: RunConfig) -> tuple[dict, str]:
    """One task per shard; returns {object ref: shard} and the name its tasks know this submission by."""
    # The task runs stdlib code only, shipped by value: a cluster's workers need not import run_shards.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    task = ray.remote(run_shard)
    gpus, cpus = (1 if config.on_gpu else 0), max(1, config.threads_per_worker)
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV)}
    env["RUN_SHARDS_TASK_CPUS"] = str(cpus)
    submission = env[SUBMISSION_VARIABLE] = f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}"
    command = self_command()
    for kind, need in (("GPU", gpus), ("CPU", cpus)):
        most = max((n["Resources"].get(kind, 0) for n in ray.nodes() if n.get("Alive")), default=0)
        if need > most:
            log.warning("each shard's task needs %d %s(s), and no node of this Ray cluster has that many now (at "
                        "most %g): the tasks wait until one has (an autoscaler may add nodes); Ctrl-C stops them",
                        need, kind, most)
    refs = {}
    for r in job.ranks:
        options = dict(num_gpus=gpus, num_cpus=cpus, max_retries=MAX_RETRIES, retry_exceptions=[ShardTaskFailed],
                       name=f"run_shards shard {r}")
        refs[task.options(**options).remote([*command, "work", str(job.run.root), "--shard", str(r)], env)] = r
    log.info("submitted shard(s) %s as %d Ray task(s) (%s each) to the cluster at %s; Ray retries each up to "
             "%d times", _ranges(job.ranks), len(refs), f"{gpus} GPU" if gpus else f"{cpus} CPU(s)",
             ray.get_runtime_context().gcs_address, MAX_RETRIES)
    return refs, submission


@dataclass
class Outcome:
    rank: int
    exit_code: int | None     # `work`'s exit code (negative: killed by that signal); None: the task itself failed
    explanation: str
    output: list[str]         # the last lines `work` printed
    retried: bool = False     # Ray tried it 1 + MAX_RETRIES times


def _follow(ray, job: ShardJob, config: RunConfig, refs: dict, submission: str) -> list[Outcome]:
    """Wait for every task, with a progress bar from the run directory and a line for every retry (with the
    count it resumes from); Ctrl-C cancels them (RunFailed, interrupted)."""
    board = ProgressBoard(sum(job.remaining[r] for r in job.ranks), f"Ray ({len(refs)} task(s))",
                          config.summary_seconds, show_bar=job.show_progress)
    seen = {r: len(_starts(job, r)) for r in job.ranks}   # attempts before this command's tasks
    tries = dict.fromkeys(job.ranks, 0)
    pending, outcomes = list(refs), []

    def wait():
        nonlocal pending
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_SECONDS)
        outcomes.extend(_outcome(ray, ref, refs[ref]) for ref in ready)

    try:
        for _ in follow_run_dir(job, board, wait):
            for r in job.ranks:
                for start in _starts(job, r)[seen[r]:]:
                    tries[r] += 1
                    if tries[r] > 1:
                        board.note(f"shard {r}: Ray started it again (try {tries[r]}); it resumes from its "
                                   f"checkpoints: {start.get('durable', 0):,} of {start.get('sequences', 0):,} "
                                   "sequences durable")
                seen[r] = len(_starts(job, r))
            if not pending:
                break
    except KeyboardInterrupt as e:
        board.close()
        _stop(ray, job, {ref: refs[ref] for ref in pending}, submission)
        name = str(e) or (_received[-1] if _received else "SIGINT")
        raise RunInterrupted(_interrupted_report(job, name)) from None
    finally:
        board.close()
    done = sum(1 for o in outcomes if o.exit_code == EXIT_OK)
    board.note(f"{done} of {len(outcomes)} Ray task(s) finished their shard in {time.monotonic() - board.start:.1f} s")
    return sorted(outcomes, key=lambda o: o.rank)


def cancelled_submission(run_events_path: Path, environ=os.environ) -> str | None:
    """For `work` in a Ray task: the submission that started this task (SUBMISSION_VARIABLE), where the command
    that made it has since cancelled it; else None."""
    submission = environ.get(SUBMISSION_VARIABLE)
    if not submission:
        return None
    for e in events.read(run_events_path):
        if e["event"] == "cancelled" and e.get("submission") == submission:
            return submission
    return None


def _starts(job: ShardJob, rank: int) -> list[dict]:
    """Every attempt's `start` event of this shard (one per worker that took its lock)."""
    return [e for e in events.read(job.run.events_path(rank)) if e["event"] == "start"]


def _outcome(ray, ref, rank: int) -> Outcome:
    try:
        result = ray.get(ref)
        return Outcome(rank, result["exit_code"], explain_exit(result["exit_code"]), result["output"])
    except ray.exceptions.RayTaskError as e:   # our task raised: the shard failed on its last try
        cause = getattr(e, "cause", None)
        code = getattr(cause, "exit_code", None)
        if code is None:
            return Outcome(rank, None, f"its Ray task raised {_first_line(cause or e)}", [], retried=True)
        return Outcome(rank, code, explain_exit(code), list(getattr(cause, "output", [])), retried=True)
    except ray.exceptions.RayError as e:   # its worker or node died more often than Ray retries
        return Outcome(rank, None, f"its Ray task failed ({type(e).__name__}: {_first_line(e)})", [], retried=True)


def _stop(ray, job: ShardJob, pending: dict, submission: str) -> None:
    """Cancel the unfinished tasks (their `work` gets SIGTERM and checkpoints), then wait until no shard's lock
    is held, so that `rerun` can start at once. A second Ctrl-C stops waiting. The `cancelled` event comes
    first: an attempt of these tasks that starts later (Ray's cancel missed it) computes nothing."""
    ranks = sorted(pending.values())
    if not ranks:
        return
    events.append(job.run.run_events_path, "cancelled", submission=submission, shards=ranks)
    log.warning("interrupted: cancelling %d Ray task(s); their shards write a final checkpoint", len(ranks))
    deadline = time.monotonic() + STOP_SECONDS
    try:
        _cancel(ray, list(pending), force=False)
        try:
            _, left = ray.wait(list(pending), num_returns=len(pending), timeout=FORCE_SECONDS)
            # A running task may never get the KeyboardInterrupt of a plain cancel (Ray issue 32954: a task in a
            # timed wait; in this project's suite its shard then computed to its end, 17 s): its Ray worker is
            # killed, and the kernel gives the shard's `work` its SIGTERM (RUN_SHARDS_DIE_WITH), a final checkpoint.
            if left:
                _cancel(ray, left, force=True)
                ray.wait(left, num_returns=len(left), timeout=STOP_SECONDS)
        except Exception as e:
            log.info("Ray stopped before its tasks: %s", _first_line(e))
        while time.monotonic() < deadline and any(ShardLock(job.run, r).held_elsewhere() for r in ranks):
            time.sleep(0.2)
    except KeyboardInterrupt:
        log.warning("stopped waiting for the shards' final checkpoints")


def _cancel(ray, refs: list, force: bool) -> None:
    for ref in refs:
        try:
            ray.cancel(ref, force=force)
        except Exception as e:   # Ray itself may be going down with the same Ctrl-C
            log.info("could not cancel a Ray task: %s", _first_line(e))


def _failure_report(job: ShardJob, failed: list[Outcome]) -> str:
    """Each shard that did not finish, why (its failure record, written by `work` or else here), its log, and
    the command that continues the run."""
    run, lines, advised = job.run, [], []
    for o in failed:
        record = run.failure(o.rank)
        if not record or record.interrupted:   # `work` could not say why (or was only stopped)
            record = run.new_failure(o.rank, o.exit_code, _reason(o.output), interrupted=False,
                                     explanation=o.explanation)
            record.log_tail = record.log_tail or o.output
            run.record_failure(o.rank, record)
        advised.append(record.rerun_repeats)   # (it refused the run's settings: a rerun stops the same way)
        when = f" after {MAX_RETRIES} Ray retries" if o.retried else ""
        lines.append(f"shard {o.rank} failed{when}: {record.summary()}")
        tail = run.log_tail(o.rank, 8)
        if record.reason or not (tail or o.output):
            lines.append(f"  log: {run.worker_log(o.rank)}")
        elif tail:
            lines.append(f"  last lines of {run.worker_log(o.rank)}:")
            lines += [f"    {t}" for t in tail]
        else:
            lines.append("  last lines `run_shards work` printed (it wrote no worker log):")
            lines += [f"    {t}" for t in o.output[-8:]]
    return "\n".join(lines + shards_summary(job, advised=bool(advised) and all(advised)))


def _interrupted_report(job: ShardJob, name: str) -> str:
    lines = []
    for r in job.ranks:
        s = job.state(r)
        if s.state == "pending":
            lines.append(f"shard {r} was not started")
        elif s.state != "complete":
            lines.append(f"shard {r} stopped at its final checkpoint: {s.durable:,} of {s.expected:,} sequences "
                         "durable")
    lines.append(f"interrupted by {name}: the Ray tasks were cancelled.")
    return "\n".join(lines + shards_summary(job, interrupted=True))


def _reason(output: list[str]) -> str:
    """The one-line error `run_shards work` printed last, if it printed one."""
    errors = [t for t in output if t.startswith(("error: ", "interrupted: "))]
    return errors[-1].split(": ", 1)[1] if errors else ""


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _ranges(ranks: list[int]) -> str:
    return ",".join(map(str, ranks)) if len(ranks) <= 8 else f"{ranks[0]}..{ranks[-1]} ({len(ranks)})"


# --------------------------------------------------------------------------------------------- task side
# Everything below runs in a Ray worker, shipped by value: standard library only.
class ShardTaskFailed(Exception):
    """`run_shards work` ended without finishing its shard in a way a retry may fix (Ray retries it)."""

    def __init__(self, exit_code: int, output: list[str]):
        super().__init__(f"run_shards work exited with {exit_code}: " + (output[-1] if output else "no output"))
        self.exit_code, self.output = exit_code, output

    def __reduce__(self):
        return ShardTaskFailed, (self.exit_code, self.output)


def run_shard(command: list[str], env: dict[str, str]) -> dict:
    """Run `command` (`run_shards work OUT --shard K`) to its end. Returns its exit code and last lines when
    it finished, stopped with a user error (a retry would stop the same way) or was cancelled; raises
    ShardTaskFailed otherwise, for Ray to retry. The command gets exactly one SIGTERM when this task is
    cancelled, and (RUN_SHARDS_DIE_WITH: it asks the kernel itself) when this Ray worker dies."""
    with tempfile.TemporaryFile() as output:
        # A session of its own: a Ctrl-C in the driver's terminal reaches the shard only through ray.cancel.
        proc = subprocess.Popen(command, env={**os.environ, **env, "RUN_SHARDS_DIE_WITH": str(os.getpid())},
                                stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                                start_new_session=True)
        cancelled = False
        while True:
            try:
                code = proc.wait(timeout=0.2)   # a timed wait lets ray.cancel's KeyboardInterrupt through
                break
            except subprocess.TimeoutExpired:
                pass
            except KeyboardInterrupt:
                if not cancelled:
                    proc.send_signal(signal.SIGTERM)   # once: the shard writes its final checkpoint
                    cancelled = True
        output.seek(max(0, output.seek(0, os.SEEK_END) - 8192))
        lines = output.read().decode("utf-8", "replace").splitlines()[-20:]
    if code in (EXIT_OK, EXIT_COMMAND_USER_ERROR) or cancelled:
        return {"exit_code": code, "output": lines}
    raise ShardTaskFailed(code, lines)
