"""The SLURM launcher: a job array computes the shards, a merge job runs once every task has succeeded.

`run` and `rerun` write OUT/slurm/shards.sbatch and merge.sbatch (see sbatch_scripts), submit the array
(split over MaxArraySize) and the merge job (afterok, --kill-on-invalid-dep=yes), record the job ids in
OUT/slurm/jobs.json and return; `--dry-run` writes the scripts and prints the sbatch commands instead;
`--wait` follows the run directory with a progress bar until the result is merged or a shard failed.
SLURM places, retries and requeues; run_shards never asks sacct: the run directory says what is done.
"""
from __future__ import annotations

import json
import logging
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path

from ..output import shard_state
from ..config import RunConfig
from ..errors import RunFailed, UserError
from .progress import ProgressBoard
from ..rundir.layout import RunDir, RunLock, write_atomic
from .job import ShardJob, Submitted, self_command
from .sbatch_scripts import array_ranges, merge_script, shard_script, split_arrays

log = logging.getLogger("run_shards")

DEFAULT_MAX_ARRAY_SIZE = 1001      # SLURM's default MaxArraySize
NODE_LOCAL_FILE_SYSTEMS = {"tmpfs", "ramfs", "overlay"}


def slurm_dir(run: RunDir) -> Path:
    return run.root / "slurm"


def launch(job: ShardJob) -> Submitted:
    run = job.run
    config = RunConfig.from_manifest(job.manifest)
    per_task = config.shards_per_task
    tasks = sorted({r // per_task for r in job.ranks})
    user_args = shlex.split(config.sbatch)
    folder = slurm_dir(run)
    folder.mkdir(exist_ok=True)
    shards_sbatch, merge_sbatch = folder / "shards.sbatch", folder / "merge.sbatch"
    command = self_command()
    gpus = per_task if config.on_gpu else 0
    write_atomic(shards_sbatch, shard_script(run.root, command, user_args, per_task, gpus))
    write_atomic(merge_sbatch, merge_script(run.root, command, user_args))
    for script in (shards_sbatch, merge_sbatch):
        script.chmod(0o755)
    warn_if_node_local(run.root)
    dry_run = job.options.get("dry_run", False)
    if not dry_run and shutil.which("sbatch") is None:
        raise UserError("--launcher slurm needs SLURM's sbatch, which is not on PATH here: run on a login node of "
                        f"the cluster, or pass --dry-run to write the scripts ({folder}) and print the commands")
    arrays = split_arrays(tasks, max_array_size(dry_run))
    array_commands = _array_commands(arrays, config.array_throttle, shards_sbatch)
    if not dry_run:
        _check_job_count(len(tasks), per_task)
    if dry_run:
        return Submitted(f"wrote {shards_sbatch} and {merge_sbatch}; nothing was submitted. To submit:\n"
                         + _by_hand(array_commands, merge_sbatch, "  ", "\n  "))
    ids = []
    try:
        for cmd in array_commands:
            ids.append(_sbatch(cmd))
        merge_id = _sbatch(_merge_command(ids, merge_sbatch))
    except UserError as e:
        if ids:   # never leave half a submission behind: arrays without their merge job would never merge
            subprocess.run(["scancel", *ids], capture_output=True)
            raise UserError(f"{e} (job array(s) {', '.join(ids)}, already submitted, were cancelled)") from None
        raise
    record = {"submitted": time.strftime("%Y-%m-%dT%H:%M:%S"), "arrays": [
        {"job_id": i, "offset": off, "array": array_ranges(idx)} for i, (off, idx) in zip(ids, arrays)],
        "merge_job_id": merge_id, "shards": job.ranks, "shards_per_task": per_task}
    _append_jobs(run, record)
    log.info("submitted %d shard task(s) as job array(s) %s and merge job %s", len(tasks), ", ".join(ids), merge_id)
    return Submitted("\n".join([
        f"submitted shards {array_ranges(job.ranks)} as job array(s) {', '.join(ids)} ({len(tasks)} task(s)); merge "
        f"job {merge_id} runs once they all succeed",
        f"follow with:  run_shards status {run.root}",
        f"result (once merged): {run.result_path}"]),
        follow=(lambda: follow(job, record)) if job.options.get("wait") else None)


def _array_commands(arrays: list[tuple[int, list[int]]], throttle: int, shards_sbatch: Path) -> list[list[str]]:
    limit = f"%{throttle}" if throttle else ""
    return [["sbatch", "--parsable", f"--array={array_ranges(indices)}{limit}",
             f"--export=ALL,RUN_SHARDS_OFFSET={offset}", str(shards_sbatch)] for offset, indices in arrays]


def _by_hand(array_commands: list[list[str]], merge_sbatch: Path, first: str, sep: str) -> str:
    """The shell lines that submit the arrays and the merge job after them, as --dry-run prints them."""
    ids = [f"$ARRAY{k + 1}" for k in range(len(array_commands))]
    lines = [f"ARRAY{k + 1}=$({_show(c)})" for k, c in enumerate(array_commands)]
    return first + sep.join(lines + [_show(_merge_command(ids, merge_sbatch))])


def _merge_command(array_ids: list[str], merge_sbatch: Path) -> list[str]:
    return ["sbatch", "--parsable", "--dependency=afterok:" + ":".join(array_ids), "--kill-on-invalid-dep=yes",
            str(merge_sbatch)]


def _show(cmd: list[str]) -> str:
    return " ".join(c if c.startswith("--dependency") else shlex.quote(c) for c in cmd)


def _sbatch(cmd: list[str]) -> str:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        said = res.stderr.strip() or res.stdout.strip()
        if "temporarily unable to accept job" in said or "Resource temporarily unavailable" in said:
            hint = ("The controller is full or busy: it holds at most MaxJobCount jobs, every array task "
                    "counting as one, and keeps ended jobs for MinJobAge. Wait for the queue to drain, or put "
                    "more shards in each task (--shards-per-task), and run the command again.")
        else:
            hint = "Fix the --sbatch options (or the cluster's limits it names) and run the command again."
        raise UserError(f"sbatch refused the job ({_show(cmd)}): {said}. {hint}")
    job_id = res.stdout.strip().split(";")[0]
    if not re.fullmatch(r"\d+", job_id):
        raise UserError(f"sbatch printed no job id ({_show(cmd)}): {res.stdout.strip()} {res.stderr.strip()}")
    return job_id


def max_array_size(dry_run: bool) -> int:
    """The cluster's MaxArraySize (array indices must stay below it), from `scontrol show config`."""
    value = _config_value("MaxArraySize")
    if value is None:
        if not dry_run and shutil.which("scontrol") is not None:
            log.warning("could not read MaxArraySize from `scontrol show config`; assuming %d",
                        DEFAULT_MAX_ARRAY_SIZE)
        return DEFAULT_MAX_ARRAY_SIZE
    return max(1, value)


def _config_value(name: str) -> int | None:
    """An integer setting of the cluster's slurm.conf, from `scontrol show config`; None when unknown."""
    if shutil.which("scontrol") is None:
        return None
    try:
        res = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(rf"^{name}\s*=\s*(\d+)", res.stdout, re.M)
    return int(m.group(1)) if m else None


def _check_job_count(tasks: int, per_task: int) -> None:
    """SLURM's controller holds at most MaxJobCount jobs, and every array task counts as one (pending ones
    too): a submission above it would be refused after sbatch's retries, with a vaguer message."""
    limit = _config_value("MaxJobCount")
    if limit is not None and tasks + 1 > limit:
        raise UserError(f"{tasks:,} array tasks and a merge job are more than this cluster's controller holds "
                        f"(MaxJobCount = {limit:,}; every array task counts as one job). Put more shards in each "
                        f"task: --shards-per-task {-(-(tasks * per_task) // (limit // 2))} (or fewer --shards)")


def _append_jobs(run: RunDir, record: dict) -> None:
    path = slurm_dir(run) / "jobs.json"
    history = json.loads(path.read_text()) if path.exists() else []
    write_atomic(path, json.dumps(history + [record], indent=1))


def submissions(run: RunDir) -> list[dict]:
    """Every submission of this run, oldest first (OUT/slurm/jobs.json)."""
    path = slurm_dir(run) / "jobs.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return []


def warn_if_node_local(root: Path) -> None:
    """Compute nodes must see OUT: warn when it lies on a file system private to this host."""
    fstype, mount = _file_system(root)
    if fstype in NODE_LOCAL_FILE_SYSTEMS or str(root).startswith(("/tmp/", "/var/tmp/", "/dev/shm/")):
        log.warning("%s is on a node-local file system (%s at %s): SLURM tasks on other nodes will not see it. "
                    "Use a path on shared storage (e.g. your home or project directory) for --out.",
                    root, fstype or "local", mount)


def _file_system(path: Path) -> tuple[str, str]:
    best = ("", "")
    try:
        for line in open("/proc/mounts"):
            fields = line.split()
            target = fields[1].replace("\\040", " ")
            if (str(path) == target or str(path).startswith(target.rstrip("/") + "/")) and len(target) >= len(best[1]):
                best = (fields[2], target)
    except OSError:
        pass
    return best


# ---------------------------------------------------------------------------------------------- --wait
def follow(job: ShardJob, record: dict, poll_seconds: float = 2.0) -> Path:
    """Follow the run directory until the merge job has written the result (returns its path) or it cannot
    run any more because a shard's task failed or was cancelled (RunFailed). A task that was interrupted and
    requeued (preemption, the time limit's USR1) is waited for. The tasks keep running if the user stops
    following."""
    run, world, merge_id = job.run, job.manifest["world"], record["merge_job_id"]
    submitted = time.time()
    config = RunConfig.from_manifest(job.manifest)
    board = ProgressBoard(sum(job.remaining[r] for r in job.ranks), f"SLURM ({len(job.ranks)} shard(s))",
                          config.summary_seconds, show_bar=job.show_progress)
    done = {r: 0 for r in job.ranks}
    try:
        while True:
            stopped, complete = {}, True
            for r in job.ranks:
                s = shard_state.inspect(run, job.index.stride_shard(r, world), r, verify_shard=False)
                gained = s.durable - (s.expected - job.remaining[r])
                if gained > done[r]:
                    board.bar.update(gained - done[r])
                    done[r] = gained
                complete = complete and s.state == "complete"
                # (A shard whose lock is held is being computed, whatever a refused duplicate task recorded.)
                if s.state in ("failed", "interrupted") and _recorded_after(run, r, submitted) \
                        and not RunLock.shard_running(run, r):
                    stopped[r] = s.state
            if _merged_since(run, submitted):
                return run.result_path
            merge = _queue_state(merge_id)
            if _merged_since(run, submitted):   # written while squeue answered
                return run.result_path
            if "failed" in stopped.values() or (stopped and merge == "gone"):
                raise RunFailed("\n".join(_stopped_lines(run, stopped) + [
                    f"The merge job {merge_id} cannot run now (a shard task failed or was cancelled); SLURM cancels "
                    "it. The other tasks go on.", f"Continue with:  run_shards rerun {run.root}"]))
            if merge == "gone":
                raise RunFailed(
                    f"the merge job {merge_id} ended without writing the result (see "
                    f"{run.logs_dir}/slurm_merge_{merge_id}.out).\nContinue with:  run_shards merge {run.root}"
                    if complete else
                    f"the merge job {merge_id} is no longer queued and not every shard is complete (were the jobs "
                    f"cancelled?).\nContinue with:  run_shards rerun {run.root}")
            time.sleep(poll_seconds)
    except KeyboardInterrupt:
        ids = [a["job_id"] for a in record["arrays"]] + [merge_id]
        raise RunFailed(f"stopped following; the jobs go on in SLURM. Follow them with `run_shards status {run.root}`, "
                        f"or cancel them with `scancel {' '.join(ids)}`.", exit_code=130) from None
    finally:
        board.close()


def _merged_since(run: RunDir, since: float) -> bool:
    try:
        return run.result_path.stat().st_mtime >= since - 1
    except OSError:
        return False


def _recorded_after(run: RunDir, rank: int, since: float) -> bool:
    try:
        return run.failed_path(rank).stat().st_mtime >= since - 1
    except OSError:
        return False


def _queue_state(job_id: str) -> str | None:
    """Whether SLURM will still run the job: "waiting" (pending or running), "gone" (it ended, was cancelled,
    or waits on a dependency that can never be met), or None when squeue cannot tell (not installed here, or
    no answer from the controller, which must not read as the job being gone)."""
    try:
        res = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T %r"], capture_output=True, text=True,
                             timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if res.returncode != 0:   # squeue forgets a job MinJobAge (300 s by default) after it ended
        return "gone" if "Invalid job id" in res.stderr else None
    words = res.stdout.split()
    if not words or words[:2] == ["PENDING", "DependencyNeverSatisfied"] or words[0] not in LIVE_JOB_STATES:
        return "gone"
    return "waiting"


# Job states in which SLURM will still run (or is running) the job; anything else (COMPLETING, COMPLETED,
# CANCELLED, FAILED, TIMEOUT, NODE_FAIL, ...) means it ended, which squeue shows where ended jobs are kept.
LIVE_JOB_STATES = {"PENDING", "RUNNING", "CONFIGURING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
                   "RESIZING", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD", "SPECIAL_EXIT"}


def _stopped_lines(run: RunDir, stopped: dict[int, str]) -> list[str]:
    """One line per shard that stopped: failed or interrupted, with the reason from its failure record (else
    the last warning or error of its log), and its log."""
    lines = []
    for r, state in sorted(stopped.items()):
        f = run.failure(r) or {}
        why = f.get("reason") or next((line.split(": ", 1)[-1] for line in reversed(f.get("log_tail") or [])
                                       if " ERROR " in line or " WARNING " in line), "")
        verb = "failed" if state != "interrupted" else "was interrupted"
        lines.append(f"shard {r} {verb}: {f.get('explanation', 'no record of why')}" + (f" - {why}" if why else "")
                     + f"\n  log: {run.worker_log(r)}")
    return lines


def status_lines(run: RunDir, states: list) -> list[str]:
    """What `status` adds for a SLURM run: its submissions, shards being computed now, and, when the merge
    job cannot run, why and the commands that finish the run."""
    subs = submissions(run)
    if not subs:
        return ["slurm: nothing submitted yet (a --dry-run?): the scripts are in " + str(slurm_dir(run))]
    last = subs[-1]
    merge_id = last["merge_job_id"]
    lines = [f"slurm: last submitted {last['submitted']}: job array(s) "
             f"{', '.join(a['job_id'] + ' [' + a['array'] + ']' for a in last['arrays'])}, merge job {merge_id}"]
    if run.result_path.exists():
        return lines
    running = [s.rank for s in states if s.state != "complete" and RunLock.shard_running(run, s.rank)]
    if running:
        lines.append(f"  being computed now: shard(s) {array_ranges(running)}")
    stopped = {s.rank: s.state for s in states
               if s.state in ("failed", "corrupt", "interrupted") and s.rank not in running}
    unfinished = [s.rank for s in states if s.state != "complete"]
    merge = _queue_state(merge_id)
    if stopped and ("failed" in stopped.values() or "corrupt" in stopped.values() or merge == "gone"):
        lines += ["  " + line for line in _stopped_lines(run, stopped)]
        lines += _rerun_lines(run, last, merge_id, merge, sorted(stopped))
    elif stopped and merge is None:
        lines += ["  " + line for line in _stopped_lines(run, stopped)]
        lines.append(f"  squeue gave no answer here, so whether SLURM requeues them is unknown: a task that was "
                     f"preempted or reached its time limit is requeued and continues from its checkpoints (merge "
                     f"job {merge_id} waits for it); one that was cancelled is not: then continue with:  "
                     f"run_shards rerun {run.root}")
    elif stopped:
        lines.append(f"  shard(s) {array_ranges(list(stopped))} were interrupted (preempted, or near their time "
                     f"limit); SLURM requeues their tasks, which continue from their checkpoints, and merge job "
                     f"{merge_id} waits for them")
    elif unfinished and merge == "gone":
        lines.append(f"  merge job {merge_id} is no longer queued, and shard(s) {array_ranges(unfinished)} are not "
                     "complete: their tasks were cancelled, or ended without a trace here")
        lines += _rerun_lines(run, last, merge_id, merge, unfinished)
    elif unfinished and merge == "waiting":
        lines.append(f"  {len(unfinished):,} shard(s) to go; merge job {merge_id} writes the result once every "
                     "shard is complete")
    elif unfinished:
        lines.append(f"  {len(unfinished):,} shard(s) to go; squeue gave no answer here, so whether their tasks "
                     f"and merge job {merge_id} are still queued is unknown (run status where SLURM's commands work)")
    elif merge != "waiting":
        lines.append(f"  every shard is complete; merge job {merge_id} has not written the result "
                     f"({'it failed' if merge == 'gone' else 'still queued, or it failed'}: "
                     f"{run.logs_dir}/slurm_merge_{merge_id}.out). Continue with:  run_shards merge {run.root}")
    return lines


def _rerun_lines(run: RunDir, last: dict, merge_id: str, merge: str | None, ranks: list[int]) -> list[str]:
    """The command that finishes the run, and the same submission by hand."""
    tasks = sorted({r // last.get("shards_per_task", 1) for r in ranks})
    config = RunConfig.from_manifest(run.read_manifest())
    commands = _array_commands(split_arrays(tasks, max_array_size(True)), config.array_throttle,
                               slurm_dir(run) / "shards.sbatch")
    return [f"  so merge job {merge_id} cannot run" + (" (SLURM cancels it)" if merge == "waiting" else "")
            + f". Continue with:  run_shards rerun {run.root}",
            f"  (the same by hand: {_by_hand(commands, slurm_dir(run) / 'merge.sbatch', '', '; ')})"]
