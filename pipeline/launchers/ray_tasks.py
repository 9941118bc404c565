"""The Ray launcher: one Ray task per shard, each running `run_shards work OUT --shard K` where Ray places it.

Each task asks Ray for one GPU (a GPU run) or none, and --threads CPUs. Ray retries a task whose worker or
node died, and one whose shard failed, up to MAX_RETRIES times; the shard's `work` process dies with the
task's worker (SIGTERM: a final checkpoint, then its lock is free for the retry). The driver follows the run
directory with a progress bar and returns once every task has ended; the runner then merges. `rerun`
submits the unfinished shards again as tasks. Ray is an optional extra: `pip install "run_shards[ray]"`.
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

from ..output import shard_state
from ..config import RunConfig
from ..errors import RunFailed, UserError
from ..exits import signal_name
from ..planning.run_index import start_over_advice
from .progress import ProgressBoard
from ..rundir.layout import RunLock
from .job import ShardJob, self_command

log = logging.getLogger("run_shards")

MAX_RETRIES = 3            # Ray retries of a shard's task: its worker or node died, or the shard failed
POLL_SECONDS = 2.0         # how often the progress bar reads the run directory
STOP_SECONDS = 120.0       # after Ctrl-C: how long to wait for the shards' final checkpoints
# What a shard's computation reads from the environment, passed to its task as sbatch --export=ALL would;
# never CUDA_VISIBLE_DEVICES or PATH, which belong to the node Ray picked.
FORWARDED_ENV = ("RUN_SHARDS_", "HF_", "TRANSFORMERS_", "HDF5_")
EXIT_USER_ERROR, EXIT_INTERRUPTED = 2, 130   # `run_shards work`'s exit codes (pipeline/cli.py)
PR_SET_PDEATHSIG = 1


def launch(job: ShardJob) -> None:
    """Run every shard of `job` as a Ray task; None once all succeeded (the caller merges), else RunFailed."""
    ray = _import_ray(job.run.root)
    config = RunConfig.from_manifest(job.manifest)
    connected_here = _connect(ray, config.ray_address)
    try:
        refs = _submit(ray, job, config)
        outcomes = _follow(ray, job, config, refs)
    finally:
        if connected_here:   # stops a local Ray started here; a cluster's driver only disconnects
            ray.shutdown()
    failed = [o for o in outcomes if o.exit_code != 0]
    if failed:
        raise RunFailed(_failure_report(job, failed))


# ------------------------------------------------------------------------------------------ driver side
def _import_ray(root: Path):
    try:
        import ray
    except ImportError as e:
        checkout = Path(__file__).resolve().parents[2]
        local = (f" (from this checkout: `{shlex.quote(sys.executable)} -m pip install -e "
                 f"{shlex.quote(str(checkout) + '[ray]')}`)" if (checkout / "setup.cfg").exists() else "")
        raise UserError(f"--launcher ray needs Ray, which {sys.executable} cannot import ({e}): install the extra "
                        f"with `pip install \"run_shards[ray]\"`{local}, then `run_shards rerun {root}`") from None
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
    try:   # the workers' output and Ray's own logs stay in its session logs (/tmp/ray), off the terminal
        ray.init(address=address or None, include_dashboard=False, log_to_driver=False,
                 logging_level=logging.ERROR)
    except Exception as e:   # ConnectionError, RuntimeError, ray's own errors: all say why in their text
        while e.__cause__ is not None:
            e = e.__cause__
        raise UserError(f"cannot connect to {where}: {_first_line(e)}. {advice}") from None
    _quiet_ray_messages(ray)
    return True


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
    loop reports retries from the workers' logs instead."""
    worker = getattr(getattr(ray, "_private", None), "worker", None)
    if worker is not None and hasattr(worker, "_worker_logs_enabled"):
        worker._worker_logs_enabled = False


def _submit(ray, job: ShardJob, config: RunConfig) -> dict:
    """One task per shard; returns {object ref: shard}."""
    # The task runs stdlib code only, shipped by value: a cluster's workers need not import run_shards.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    task = ray.remote(run_shard)
    gpus, cpus = (1 if config.on_gpu else 0), max(1, config.threads_per_worker)
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV)}
    env["RUN_SHARDS_TASK_CPUS"] = str(cpus)
    command = self_command()
    for kind, need in (("GPU", gpus), ("CPU", cpus)):
        most = max((n["Resources"].get(kind, 0) for n in ray.nodes() if n.get("Alive")), default=0)
        if need > most:
            log.warning("each shard's task needs %d %s(s), and no node of this Ray cluster has that many now (at "
                        "most %g): the tasks wait until one has (an autoscaler may add nodes); Ctrl-C stops them",
                        need, kind, most)
    refs = {}
    for r in job.ranks:
        job.run.clear_failure(r)
        options = dict(num_gpus=gpus, num_cpus=cpus, max_retries=MAX_RETRIES, retry_exceptions=[ShardTaskFailed],
                       name=f"run_shards shard {r}")
        refs[task.options(**options).remote([*command, "work", str(job.run.root), "--shard", str(r)], env)] = r
    log.info("submitted shard(s) %s as %d Ray task(s) (%s each) to the cluster at %s; Ray retries each up to "
             "%d times", _ranges(job.ranks), len(refs), f"{gpus} GPU" if gpus else f"{cpus} CPU(s)",
             ray.get_runtime_context().gcs_address, MAX_RETRIES)
    return refs


@dataclass
class Outcome:
    rank: int
    exit_code: int | None     # `work`'s exit code (negative: killed by that signal); None: the task itself failed
    explanation: str
    output: list[str]         # the last lines `work` printed
    retried: bool = False     # Ray tried it 1 + MAX_RETRIES times


def _follow(ray, job: ShardJob, config: RunConfig, refs: dict) -> list[Outcome]:
    """Wait for every task, with a progress bar from the run directory; Ctrl-C cancels them (RunFailed, 130)."""
    run, world = job.run, job.manifest["world"]
    board = ProgressBoard(sum(job.remaining[r] for r in job.ranks), f"Ray ({len(refs)} task(s))",
                          config.summary_seconds, show_bar=job.show_progress)
    gained = dict.fromkeys(job.ranks, 0)
    before = {r: _starts(run.worker_log(r)) for r in job.ranks}
    noted = dict.fromkeys(job.ranks, 1)
    pending, outcomes = list(refs), []
    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_SECONDS)
            outcomes += [_outcome(ray, ref, refs[ref]) for ref in ready]
            for r in job.ranks:
                s = shard_state.inspect(run, job.index.stride_shard(r, world), r, verify_shard=False)
                now = s.durable - (s.expected - job.remaining[r])
                if now > gained[r]:
                    board.bar.update(now - gained[r])
                    gained[r] = now
                tries = _starts(run.worker_log(r)) - before[r]
                if tries > noted[r]:
                    board.note(f"shard {r}: Ray started it again (try {tries}); it continues from its checkpoints "
                               f"({s.durable:,} of {s.expected:,} sequences durable)")
                    noted[r] = tries
    except KeyboardInterrupt as e:
        board.close()
        _stop(ray, job, {ref: refs[ref] for ref in pending})
        raise RunFailed(_interrupted_report(job, str(e) or "SIGINT"), exit_code=130) from None
    finally:
        board.close()
    done = sum(1 for o in outcomes if o.exit_code == 0)
    board.note(f"{done} of {len(outcomes)} Ray task(s) finished their shard in {time.time() - board.start:.1f} s")
    return sorted(outcomes, key=lambda o: o.rank)


def _starts(log_path: Path) -> int:
    """How many times a worker started on this shard (each writes one `started (pid` line to its log)."""
    try:
        return log_path.read_bytes().count(b"started (pid ")
    except OSError:
        return 0


def _outcome(ray, ref, rank: int) -> Outcome:
    try:
        result = ray.get(ref)
        return Outcome(rank, result["exit_code"], _explain(result["exit_code"]), result["output"])
    except ray.exceptions.RayTaskError as e:   # our task raised: the shard failed on its last try
        cause = getattr(e, "cause", None)
        code = getattr(cause, "exit_code", None)
        if code is None:
            return Outcome(rank, None, f"its Ray task raised {_first_line(cause or e)}", [], retried=True)
        return Outcome(rank, code, _explain(code), list(getattr(cause, "output", [])), retried=True)
    except ray.exceptions.RayError as e:   # its worker or node died more often than Ray retries
        return Outcome(rank, None, f"its Ray task failed ({type(e).__name__}: {_first_line(e)})", [], retried=True)


def _explain(code: int) -> str:
    if code == 0:
        return "finished"
    if code == EXIT_USER_ERROR:
        return "exit code 2 (stopped with an error message)"
    if code == EXIT_INTERRUPTED:
        return "interrupted (it wrote a final checkpoint)"
    if code < 0:
        return f"killed by {signal_name(-code)}"
    return f"exit code {code} (see its log)"


def _stop(ray, job: ShardJob, pending: dict) -> None:
    """Cancel the unfinished tasks (their `work` gets SIGTERM and checkpoints), then wait until no shard's lock
    is held, so that `rerun` can start at once. A second Ctrl-C stops waiting."""
    ranks = sorted(pending.values())
    if not ranks:
        return
    log.warning("interrupted: cancelling %d Ray task(s); their shards write a final checkpoint", len(ranks))
    deadline = time.time() + STOP_SECONDS
    try:
        for ref in pending:
            try:
                ray.cancel(ref)
            except Exception as e:   # Ray itself may be going down with the same Ctrl-C
                log.info("could not cancel a Ray task: %s", _first_line(e))
        try:
            ray.wait(list(pending), num_returns=len(pending), timeout=STOP_SECONDS)
        except Exception as e:
            log.info("Ray stopped before its tasks: %s", _first_line(e))
        while time.time() < deadline and any(RunLock.shard_running(job.run, r) for r in ranks):
            time.sleep(0.2)
    except KeyboardInterrupt:
        log.warning("stopped waiting for the shards' final checkpoints")


def _failure_report(job: ShardJob, failed: list[Outcome]) -> str:
    """Each shard that did not finish, why (its failure record, written by `work` or else here), its log, and
    the command that continues the run."""
    run, world = job.run, job.manifest["world"]
    lines = []
    for o in failed:
        record = run.failure(o.rank)
        if not record or record.get("interrupted"):   # `work` could not say why (or was only stopped)
            record = {"exit_code": o.exit_code, "explanation": o.explanation, "reason": _reason(o.output),
                      "interrupted": False, "log": str(run.worker_log(o.rank)), "log_tail": o.output}
            run.record_failure(o.rank, record)
        when = f" after {MAX_RETRIES} Ray retries" if o.retried else ""
        lines.append(f"shard {o.rank} failed{when}: {record.get('explanation')}"
                     + (f" - {record['reason']}" if record.get("reason") else ""))
        tail = run.log_tail(o.rank, 8)
        if record.get("reason") or not (tail or o.output):
            lines.append(f"  log: {run.worker_log(o.rank)}")
        elif tail:
            lines.append(f"  last lines of {run.worker_log(o.rank)}:")
            lines += [f"    {t}" for t in tail]
        else:
            lines.append("  last lines `run_shards work` printed (it wrote no worker log):")
            lines += [f"    {t}" for t in o.output[-8:]]
    done = sum(1 for r in range(world) if run.shard_path(r).exists())
    lines.append(f"{done} of {world} shards complete. No merged file was written; all finished and "
                 "checkpointed rows are kept.")
    changed = job.index.records_changed()
    if changed:
        lines.append(f"The input FASTA changed since this run started ({changed}). "
                     f"{start_over_advice(run, job.manifest)}")
    else:
        lines.append(f"Continue with:  run_shards rerun {run.root}")
    return "\n".join(lines)


def _interrupted_report(job: ShardJob, name: str) -> str:
    run, world = job.run, job.manifest["world"]
    lines = []
    for r in job.ranks:
        s = shard_state.inspect(run, job.index.stride_shard(r, world), r, verify_shard=False)
        if s.state == "pending":
            lines.append(f"shard {r} was not started")
        elif s.state != "complete":
            lines.append(f"shard {r} stopped at its final checkpoint: {s.durable:,} of {s.expected:,} sequences "
                         "durable")
    done = sum(1 for r in range(world) if run.shard_path(r).exists())
    lines.append(f"interrupted by {name}: the Ray tasks were cancelled. {done} of {world} shards complete. No "
                 "merged file was written; all finished and checkpointed rows are kept.")
    lines.append(f"Continue with:  run_shards rerun {run.root}")
    return "\n".join(lines)


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
    ShardTaskFailed otherwise, for Ray to retry."""
    import ctypes
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def die_with_parent():   # in the child, before exec: SIGTERM when this Ray worker dies, even by SIGKILL
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(1)

    with tempfile.TemporaryFile() as output:
        # A session of its own: a Ctrl-C in the driver's terminal reaches the shard only through ray.cancel.
        proc = subprocess.Popen(command, env={**os.environ, **env}, stdin=subprocess.DEVNULL, stdout=output,
                                stderr=subprocess.STDOUT, preexec_fn=die_with_parent, start_new_session=True)
        cancelled = False
        while True:
            try:
                code = proc.wait(timeout=0.2)   # a timed wait lets ray.cancel's KeyboardInterrupt through
                break
            except subprocess.TimeoutExpired:
                pass
            except KeyboardInterrupt:
                if not cancelled:
                    proc.send_signal(signal.SIGTERM)   # once: a second signal would kill its workers at once
                    cancelled = True
        output.seek(max(0, output.seek(0, os.SEEK_END) - 8192))
        lines = output.read().decode("utf-8", "replace").splitlines()[-20:]
    if code == 0 or code == EXIT_USER_ERROR or cancelled:
        return {"exit_code": code, "output": lines}
    raise ShardTaskFailed(code, lines)
