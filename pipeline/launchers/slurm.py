"""The SLURM launcher: a job array computes the shards, a merge job runs once every task has succeeded.

`run` and `rerun` write OUT/slurm/shards.sbatch and merge.sbatch (see sbatch_scripts), read the run's
earlier submissions and the queue (slurm_queue), submit arrays only for shards no task is queued for or
computing (split over MaxArraySize), keep one merge job per run (afterok, --kill-on-invalid-dep=yes; an
older pending one is replaced), record the job ids in OUT/slurm/jobs.json and return; submitting a run whose
tasks are all queued is a no-op that says where things stand. `--dry-run` writes the scripts and prints the
sbatch commands instead; `--wait` follows the run until the result is merged or a shard failed.
"""
from __future__ import annotations

import logging
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path

from ..advice import command
from ..config import RunConfig
from ..errors import RunFailed, RunInterrupted, UserError
from ..output.schema import Schema
from ..rundir import events
from ..rundir.layout import RunDir, write_atomic
from ..rundir.locks import ShardLock
from .job import ShardJob, Submitted, follow_run_dir, self_command
from .progress import ProgressBoard
from .sbatch_scripts import (array_ranges, asks_for_gpus, expand_ranges, merge_options, merge_script, option_groups,
                             shard_script, signal_seconds, split_arrays)
from .slurm_limits import check_job_count, max_array_size, time_limit, warn_if_short
from .slurm_queue import (SETTINGS_REFUSED, Queue, append_submission, slurm_dir, stopped_lines,
                          unrecorded_jobs, unrecorded_lines)

log = logging.getLogger("run_shards")

NODE_LOCAL_FILE_SYSTEMS = {"tmpfs", "ramfs", "overlay"}
MERGE_LOCK_WAIT = 1800             # seconds the merge job waits for a command holding the run (a merge by hand)
MERGE_BYTES_PER_SECOND = 50e6      # a slow client's rate (a merge reads and writes every byte once)
QUEUE_POLL_SECONDS = 10.0          # --wait asks squeue about the run's jobs at most this often


def launch(job: ShardJob) -> Submitted:
    run, config = job.run, RunConfig.from_manifest(job.manifest)
    user_args = shlex.split(config.sbatch)
    folder = slurm_dir(run)
    folder.mkdir(exist_ok=True)
    shards_sbatch, merge_sbatch = folder / "shards.sbatch", folder / "merge.sbatch"
    limit = time_limit(user_args, job.dry_run)
    lead = signal_seconds(limit)
    warn_if_short(limit, lead, config)
    gpus = config.shards_per_task if config.on_gpu else 0
    added_gres = bool(gpus) and not any(asks_for_gpus(g) for g in option_groups(user_args))
    write_atomic(shards_sbatch, shard_script(run.root, self_command(), user_args, config.shards_per_task, gpus, lead))
    write_atomic(merge_sbatch, merge_script(run.root, self_command(), merge_options(
        user_args, shlex.split(config.merge_sbatch), merge_minutes(job)), MERGE_LOCK_WAIT))
    for script in (shards_sbatch, merge_sbatch):
        script.chmod(0o755)
    warn_if_node_local(run.root)
    if job.dry_run:
        commands = array_commands(split_arrays(_tasks(job.ranks, config), max_array_size(True)),
                                   config.array_throttle, shards_sbatch)
        events.append(run.run_events_path, "dry_run")
        return Submitted(f"wrote {shards_sbatch} and {merge_sbatch}; nothing was submitted. To submit:\n"
                         + by_hand(commands, merge_sbatch, "  ", "\n  "))
    if shutil.which("sbatch") is None:
        raise UserError("--launcher slurm needs SLURM's sbatch, which is not on PATH here: run on a login node of "
                        f"the cluster, or pass --dry-run to write the scripts ({folder}) and print the commands")
    try:
        return _submit(job, config, shards_sbatch, merge_sbatch, added_gres)
    except UserError as e:
        events.append(run.run_events_path, "refused", error=str(e), option=getattr(e, "option", ""))
        raise


def _tasks(ranks: list[int], config: RunConfig) -> list[int]:
    return sorted({r // config.shards_per_task for r in ranks})


def _submit(job: ShardJob, config: RunConfig, shards_sbatch: Path, merge_sbatch: Path, added_gres: bool
            ) -> Submitted:
    """Submit what no task is queued for or computing, and one merge job; or nothing, saying why."""
    run = job.run
    queue = Queue.read(run, job.world)
    # (the scripts a --dry-run wrote, submitted by hand: run_shards holds no record of their tasks; None where
    # squeue cannot answer)
    hand = unrecorded_jobs(run, queue.subs) if queue.answered else None
    if hand is None:
        jobs = ("this run's earlier jobs are still queued" if queue.subs else
                "jobs of this run are queued already (a --dry-run's commands submitted by hand)")
        raise UserError(f"squeue gave no answer here, so whether {jobs} is unknown; nothing was "
                        f"submitted (never a shard twice). Run the command again where SLURM's commands work "
                        f"(`{command('status', run.root)}` shows the shards)")
    if hand:
        said = unrecorded_lines(run, hand)
        log.info("%s", said[0])
        return Submitted("\n".join([f"nothing submitted (never a shard twice): {said[0]}", said[1],
                                    f"follow with:  {command('status', run.root)}"]))
    live = queue.live_shards(job.ranks)
    elsewhere = [r for r in job.ranks if r not in live and ShardLock(run, r).held_elsewhere()]
    todo = [r for r in job.ranks if r not in live and r not in elsewhere]
    notes = _left_out_lines(run, live, elsewhere)
    for line in notes:
        log.info("%s", line)
    merge = queue.merge
    if not todo and merge is not None and merge.live:
        return Submitted("\n".join(["nothing submitted: " + notes[0]] + notes[1:] + [
            f"merge job {merge.job_id} ({merge.words()}) writes the result once they succeed",
            f"follow with:  {command('status', run.root)}"]),
            follow=(lambda: follow(job, queue.merge_id)) if job.wait else None)
    tasks = _tasks(todo, config)
    arrays = split_arrays(tasks, max_array_size(False))
    if tasks:
        check_job_count(len(tasks), config.shards_per_task)
    ids: list[str] = []
    try:   # a refusal of any of them (the second of split arrays, the merge job) cancels those submitted
        for cmd in array_commands(arrays, config.array_throttle, shards_sbatch):
            ids.append(_sbatch(cmd, config.sbatch, added_gres))
        merge_id = _sbatch(_merge_command(_dependency(ids, queue), merge_sbatch), config.merge_sbatch, False,
                           "--merge-sbatch")
    except SbatchRefused as e:
        raise SbatchRefused(f"{e}{_cancelled(ids)}", e.option) from None
    if merge is not None and merge.live and merge.job_id != merge_id:   # one merge job per run
        _scancel([merge.job_id], f"the earlier merge job {merge.job_id}, which merge job {merge_id} replaces")
    record = {"submitted": time.strftime("%Y-%m-%dT%H:%M:%S"), "arrays": [
        {"job_id": i, "offset": off, "array": array_ranges(idx)} for i, (off, idx) in zip(ids, arrays)],
        "merge_job_id": merge_id, "shards": todo, "shards_per_task": config.shards_per_task}
    append_submission(run, record)
    events.append(run.run_events_path, "submitted", arrays=ids, merge_job_id=merge_id, shards=len(todo))
    what = (f"submitted shards {array_ranges(todo)} as job array(s) {', '.join(ids)} ({len(tasks)} task(s)); merge "
            f"job {merge_id} runs once they all succeed" if ids else
            f"submitted merge job {merge_id}, which runs once the queued tasks succeed")
    log.info("%s", what)
    return Submitted("\n".join([what] + notes + [f"follow with:  {command('status', run.root)}",
                                                 f"result (once merged): {run.result_path}"]),
                     follow=(lambda: follow(job, merge_id)) if job.wait else None)


def _left_out_lines(run: RunDir, live: dict, elsewhere: list[int]) -> list[str]:
    lines = []
    if live:
        states: dict[str, list[int]] = {}
        for r, t in live.items():
            states.setdefault(t.phase, []).append(r)
        lines.append("shard(s) " + "; ".join(f"{array_ranges(rs)} {s}" for s, rs in states.items())
                     + " in SLURM already (tasks " + ", ".join(sorted({t.job_id.split("_")[0] for t in live.values()}))
                     + "); not submitted again")
        if "ending" in states:   # COMPLETING: requeued (a preemption, the time limit) or ended, in seconds
            lines.append(f"shard(s) {array_ranges(states['ending'])} ending: SLURM finishes their task(s), then "
                         f"requeues them or ends them; if they end unfinished, `{command('rerun', run.root)}` "
                         "submits them then")
    if elsewhere:
        lines.append(f"shard(s) {array_ranges(elsewhere)} are being computed now by a process outside these jobs "
                     "(their lock is held); not submitted again")
    return lines


def _dependency(new_arrays: list[str], queue: Queue) -> str:
    """afterok on the new arrays; and on each earlier array whose tasks SLURM still runs, afterok when every
    one of its tasks is queued, running or succeeded, else afterany (a task of it failed or was cancelled,
    and is resubmitted now: afterok could never be met; or it is ending, and may end failed). The merge job
    checks every shard anyway, and waits for those still being computed."""
    parts = [f"afterok:{a}" for a in new_arrays]
    for array in (a for sub in queue.subs for a in sub["arrays"]):
        tasks = [(queue.tasks or {}).get(f"{array['job_id']}_{i}") for i in expand_ranges(array["array"])]
        if any(t is not None and t.live for t in tasks):
            fine = all(t is not None and (t.live and not t.ending or t.state == "COMPLETED") for t in tasks)
            parts.append(f"{'afterok' if fine else 'afterany'}:{array['job_id']}")
    return ",".join(dict.fromkeys(parts))


def array_commands(arrays: list[tuple[int, list[int]]], throttle: int, shards_sbatch: Path) -> list[list[str]]:
    limit = f"%{throttle}" if throttle else ""
    return [["sbatch", "--parsable", f"--array={array_ranges(indices)}{limit}",
             f"--export=ALL,RUN_SHARDS_OFFSET={offset}", str(shards_sbatch)] for offset, indices in arrays]


def by_hand(commands: list[list[str]], merge_sbatch: Path, first: str, sep: str) -> str:
    """The shell lines that submit the arrays and the merge job after them, as --dry-run prints them."""
    ids = [f"$ARRAY{k + 1}" for k in range(len(commands))]
    lines = [f"ARRAY{k + 1}=$({_show(c)})" for k, c in enumerate(commands)]
    return first + sep.join(lines + [_show(_merge_command(",".join(f"afterok:{i}" for i in ids), merge_sbatch))])


def _merge_command(dependency: str, merge_sbatch: Path) -> list[str]:
    after = [f"--dependency={_compact(dependency)}", "--kill-on-invalid-dep=yes"] if dependency else []
    return ["sbatch", "--parsable", *after, str(merge_sbatch)]


def _compact(dependency: str) -> str:
    """afterok:1,afterok:2 -> afterok:1:2 (the form sbatch's manual shows; both mean every one of them)."""
    kinds: dict[str, list[str]] = {}
    for part in dependency.split(","):
        kind, _, job = part.partition(":")
        kinds.setdefault(kind, []).append(job)
    return ",".join(f"{kind}:{':'.join(jobs)}" for kind, jobs in kinds.items())


def _show(cmd: list[str]) -> str:
    return " ".join(c if c.startswith("--dependency") else shlex.quote(c) for c in cmd)


def _sbatch(cmd: list[str], user_options: str, added_gres: bool, option: str = "--sbatch") -> str:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        said = res.stderr.strip() or res.stdout.strip()
        raise SbatchRefused(f"sbatch refused the job ({_show(cmd)}): {said}. "
                            f"{_refusal_hint(said, user_options, added_gres, option)}", option)
    job_id = res.stdout.strip().split(";")[0]
    if not re.fullmatch(r"\d+", job_id):
        raise UserError(f"sbatch printed no job id ({_show(cmd)}): {res.stdout.strip()} {res.stderr.strip()}")
    return job_id


class SbatchRefused(UserError):
    """sbatch refused a job; `option` names the run_shards option whose sbatch options it was given
    (--sbatch for the shard arrays, --merge-sbatch for the merge job), for `status` to name the same."""

    def __init__(self, message: str, option: str):
        super().__init__(message)
        self.option = option


def _refusal_hint(said: str, user_options: str, added_gres: bool, option: str) -> str:
    """What to change after sbatch refused: the queue's limits, the user's own options, or the GPU request
    run_shards added for --gpus (a user who gave no options has none to fix)."""
    if any(words in said for words in ("Could not establish a configuration source", "Unable to process "
                                        "configuration file", "Unable to contact slurm controller",
                                        "Socket timed out", "Zero Bytes were transmitted")):
        return ("sbatch could not reach SLURM's controller from here (no configuration, or no answer): run the "
                "command on a login node of the cluster, where `sinfo` answers.")
    if "temporarily unable to accept job" in said or "Resource temporarily unavailable" in said:
        return ("The controller is full or busy: it holds at most MaxJobCount jobs, every array task counting as "
                "one, and keeps ended jobs for MinJobAge. Wait for the queue to drain, or put more shards in each "
                "task (--shards-per-task), and run the command again.")
    gres = (" run_shards asked for a GPU per shard (--gres=gpu:N, from --gpus); if this cluster requests GPUs "
            "another way, give that request in --sbatch (e.g. --sbatch \"--gpus-per-task=1\"), or plan a CPU run "
            "(--gpus 0) in another --out.") if added_gres else ""
    if user_options:
        return (f"Fix the {option} options ({user_options!r}) or the cluster's limits it names, and run the "
                f"command again with the new {option} \"...\".{gres}")
    return (f"The cluster refused a job with only run_shards' own options: give the options it needs (a partition, "
            f"an account, a time limit) with {option} \"...\" and run the command again.{gres}")


def _scancel(ids: list[str], what: str) -> bool:
    """Cancel these jobs; False (with a warning naming them) when scancel failed."""
    res = subprocess.run(["scancel", *ids], capture_output=True, text=True)
    if res.returncode != 0:
        log.warning("could not cancel %s (scancel: %s); cancel it by hand: scancel %s", what,
                    res.stderr.strip() or res.returncode, " ".join(ids))
    return res.returncode == 0


def _cancelled(ids: list[str]) -> str:
    """Never leave half a submission behind: arrays without their merge job would never merge."""
    if not ids:
        return ""
    if _scancel(ids, f"job array(s) {', '.join(ids)}"):
        return f" (job array(s) {', '.join(ids)}, already submitted, were cancelled)"
    return (f" (job array(s) {', '.join(ids)} were submitted and could NOT be cancelled: cancel them with "
            f"`scancel {' '.join(ids)}` before running the command again)")


def merge_minutes(job: ShardJob) -> int:
    """The merge job's time limit: reading the shards and writing result.h5 at MERGE_BYTES_PER_SECOND, the
    wait for a command holding the run, and ten minutes to start; in minutes."""
    data = Schema.from_json(job.manifest["schema"]).result_bytes(job.index, job.index.lengths)
    return int(10 + (MERGE_LOCK_WAIT + 2 * data / MERGE_BYTES_PER_SECOND) // 60)


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
        with open("/proc/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                target = fields[1].replace("\\040", " ")
                if (str(path) == target or str(path).startswith(target.rstrip("/") + "/")) \
                        and len(target) >= len(best[1]):
                    best = (fields[2], target)
    except OSError as e:
        log.debug("cannot read /proc/mounts (%s); the node-local check is skipped", e)
    return best


# ---------------------------------------------------------------------------------------------- --wait
def follow(job: ShardJob, merge_id: str, poll_seconds: float = 2.0) -> Path:
    """Follow the run until merge job `merge_id` has written the result (returns its path) or cannot run any
    more because a shard's task failed or was cancelled (RunFailed). A task that was interrupted and requeued
    (preemption, the time limit's USR1) is waited for. The jobs keep running if the user stops following.
    Whether the merge ran is read from its own `ended` event (never by comparing clocks of two hosts)."""
    run = job.run
    config = RunConfig.from_manifest(job.manifest)
    board = ProgressBoard(sum(job.remaining[r] for r in job.ranks), f"SLURM ({len(job.ranks)} shard(s))",
                          config.summary_seconds, show_bar=job.show_progress)
    seen, asked = len(events.read(run.run_events_path)), float("-inf")
    try:
        for states in follow_run_dir(job, board, lambda: time.sleep(poll_seconds)):
            merged = _merge_ended(run, merge_id, seen)
            queue = None
            if merged is None and time.monotonic() - asked >= QUEUE_POLL_SECONDS:   # spare the controller
                queue, asked = Queue.read(run, job.world), time.monotonic()
                merged = _merge_ended(run, merge_id, seen)   # written while squeue answered
            if merged is not None:
                if merged.get("error"):
                    raise RunFailed(f"the merge job {merge_id} failed: {merged['error']}\n"
                                    f"Continue with:  {command('merge', run.root)}")
                return run.result_path
            if queue is not None and queue.answered:
                _check_queue(job, states, queue, merge_id)
    except KeyboardInterrupt:
        subs = Queue.read(run, job.world).subs
        ids = [a["job_id"] for s in subs[-1:] for a in s["arrays"]] + [merge_id]
        raise RunInterrupted(f"stopped following; the jobs go on in SLURM. Follow them with "
                        f"`{command('status', run.root)}`, "
                        f"or cancel them with `scancel {' '.join(ids)}`.") from None
    finally:
        board.close()
    raise AssertionError("follow_run_dir never ends by itself")


def _merge_ended(run: RunDir, merge_id: str, seen: int) -> dict | None:
    return next((e for e in events.read(run.run_events_path)[seen:]
                 if e["event"] == "ended" and e.get("command") == "merge" and e.get("slurm_job") == merge_id), None)


def _check_queue(job: ShardJob, states: dict, queue: Queue, merge_id: str) -> None:
    """RunFailed once the merge job cannot run: a shard's task ended without finishing it (failed, cancelled),
    or the merge job itself is gone."""
    run = job.run
    stopped = {}
    for r, s in states.items():
        task = queue.task_of(r)
        if s.state != "complete" and task is not None and not task.live and not ShardLock(run, r).held_elsewhere():
            stopped[r] = task
    merge = (queue.tasks or {}).get(merge_id)
    if stopped:
        then = (SETTINGS_REFUSED[0].upper() + SETTINGS_REFUSED[1:] + "." if run.settings_refused(stopped) else
                f"Continue with:  {command('rerun', run.root)}")
        raise RunFailed("\n".join(stopped_lines(run, {r: states[r].state for r in stopped}, stopped) + [
            f"The merge job {merge_id} cannot run now (a shard task failed or was cancelled); SLURM cancels it. "
            "The other tasks go on.", then]))
    if merge is None or not merge.live:
        complete = all(s.state == "complete" for s in states.values())
        log_path = run.logs_dir / f"slurm_merge_{merge_id}.out"
        raise RunFailed(
            f"the merge job {merge_id} ended without writing the result"
            + (f" (see {log_path})" if log_path.exists() else " (it never started: it left no log)")
            + f".\nContinue with:  {command('merge', run.root)}" if complete else
            f"the merge job {merge_id} is no longer queued and not every shard is complete (were the jobs "
            f"cancelled?).\nContinue with:  {command('rerun', run.root)}")
