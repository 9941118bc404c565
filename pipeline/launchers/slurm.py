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

from .. import shard_state
from ..config import RunConfig
from ..errors import RunFailed, UserError
from ..progress import ProgressBoard
from ..run_dir import RunDir, write_atomic
from . import ShardJob, Submitted, self_command
from .sbatch_scripts import array_ranges, merge_script, shard_script, split_arrays

log = logging.getLogger("run_shards")

DEFAULT_MAX_ARRAY_SIZE = 1001      # SLURM's default MaxArraySize
NODE_LOCAL_FILE_SYSTEMS = {"tmpfs", "ramfs", "overlay"}


def slurm_dir(run: RunDir) -> Path:
    return run.root / "slurm"


def launch(job: ShardJob) -> Submitted:
    run = job.run
    config = RunConfig.from_json(json.dumps(job.manifest["config"]))
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
    throttle = f"%{config.array_throttle}" if config.array_throttle else ""
    array_commands = [["sbatch", "--parsable", f"--array={array_ranges(indices)}{throttle}",
                       f"--export=ALL,RUN_SHARDS_OFFSET={offset}", str(shards_sbatch)] for offset, indices in arrays]
    if dry_run:
        ids = [f"$ARRAY{k + 1}" for k in range(len(array_commands))]
        lines = [f"wrote {shards_sbatch} and {merge_sbatch}; nothing was submitted. To submit:"]
        lines += [f"  ARRAY{k + 1}=$({_show(c)})" for k, c in enumerate(array_commands)]
        lines.append(f"  {_show(_merge_command(ids, merge_sbatch))}")
        return Submitted("\n".join(lines))
    ids = []
    for cmd in array_commands:
        try:
            ids.append(_sbatch(cmd))
        except UserError:
            if ids:   # never leave half a submission behind
                subprocess.run(["scancel", *ids], capture_output=True)
            raise
    merge_id = _sbatch(_merge_command(ids, merge_sbatch))
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


def _merge_command(array_ids: list[str], merge_sbatch: Path) -> list[str]:
    return ["sbatch", "--parsable", "--dependency=afterok:" + ":".join(array_ids), "--kill-on-invalid-dep=yes",
            str(merge_sbatch)]


def _show(cmd: list[str]) -> str:
    return " ".join(c if c.startswith("--dependency") else shlex.quote(c) for c in cmd)


def _sbatch(cmd: list[str]) -> str:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise UserError(f"sbatch refused the job ({_show(cmd)}): {res.stderr.strip() or res.stdout.strip()}. Fix "
                        "the --sbatch options (or the cluster's limits it names) and run the command again.")
    job_id = res.stdout.strip().split(";")[0]
    if not re.fullmatch(r"\d+", job_id):
        raise UserError(f"sbatch printed no job id ({_show(cmd)}): {res.stdout.strip()} {res.stderr.strip()}")
    return job_id


def max_array_size(dry_run: bool) -> int:
    """The cluster's MaxArraySize (array indices must stay below it), from `scontrol show config`."""
    if shutil.which("scontrol") is None:
        return DEFAULT_MAX_ARRAY_SIZE
    res = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True)
    m = re.search(r"^MaxArraySize\s*=\s*(\d+)", res.stdout, re.M)
    if not m:
        if not dry_run:
            log.warning("could not read MaxArraySize from `scontrol show config`; assuming %d",
                        DEFAULT_MAX_ARRAY_SIZE)
        return DEFAULT_MAX_ARRAY_SIZE
    return max(1, int(m.group(1)))


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
    """Follow the run directory until the merge job has written the result (returns its path) or a shard
    failed for good (RunFailed). The tasks keep running if the user stops following."""
    run, world = job.run, job.manifest["world"]
    submitted = time.time()
    config = RunConfig.from_json(json.dumps(job.manifest["config"]))
    board = ProgressBoard(sum(job.remaining[r] for r in job.ranks), f"SLURM ({len(job.ranks)} shard(s))",
                          config.summary_seconds, show_bar=job.show_progress)
    done = {r: 0 for r in job.ranks}
    try:
        while True:
            failed = []
            for r in job.ranks:
                s = shard_state.inspect(run, job.index.stride_shard(r, world), r, verify_shard=False)
                gained = s.durable - (s.expected - job.remaining[r])
                if gained > done[r]:
                    board.bar.update(gained - done[r])
                    done[r] = gained
                failure = run.failure(r)
                if s.state == "failed" and failure and _recorded_after(run, r, submitted):
                    failed.append((r, failure))
            if run.result_path.exists() and run.result_path.stat().st_mtime >= submitted - 1:
                return run.result_path
            if failed:
                lines = [f"shard {r} failed: {f.get('explanation')}" + (f" - {f['reason']}" if f.get("reason") else "")
                         + f"\n  log: {run.worker_log(r)}" for r, f in failed]
                lines.append(f"The merge job {record['merge_job_id']} cannot run now (a shard task failed); SLURM "
                             "cancels it. The other tasks go on.")
                lines.append(f"Continue with:  run_shards rerun {run.root}")
                raise RunFailed("\n".join(lines))
            if not _in_queue(record["merge_job_id"]) and not run.result_path.exists():
                raise RunFailed(f"the merge job {record['merge_job_id']} ended without writing the result (see "
                                f"{run.logs_dir}/slurm_merge_{record['merge_job_id']}.out).\n"
                                f"Continue with:  run_shards rerun {run.root}")
            time.sleep(poll_seconds)
    except KeyboardInterrupt:
        ids = [a["job_id"] for a in record["arrays"]] + [record["merge_job_id"]]
        raise RunFailed(f"stopped following; the jobs go on in SLURM. Follow them with `run_shards status {run.root}`, "
                        f"or cancel them with `scancel {' '.join(ids)}`.", exit_code=130) from None
    finally:
        board.close()


def _recorded_after(run: RunDir, rank: int, since: float) -> bool:
    try:
        return run.failed_path(rank).stat().st_mtime >= since - 1
    except OSError:
        return False


def _in_queue(job_id: str) -> bool:
    """Whether the scheduler still holds the job (pending or running): `squeue`, which only lists live jobs."""
    res = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True)
    return res.returncode == 0 and bool(res.stdout.strip())


def status_lines(run: RunDir, states: list) -> list[str]:
    """What `status` adds for a SLURM run: its submissions, and the commands that finish it."""
    subs = submissions(run)
    if not subs:
        return ["slurm: nothing submitted yet (a --dry-run?): the scripts are in " + str(slurm_dir(run))]
    last = subs[-1]
    lines = [f"slurm: last submitted {last['submitted']}: job array(s) "
             f"{', '.join(a['job_id'] + ' [' + a['array'] + ']' for a in last['arrays'])}, merge job {last['merge_job_id']}"]
    failed = [s.rank for s in states if s.state in ("failed", "corrupt")]
    complete = all(s.state == "complete" for s in states)
    if failed:
        tasks = sorted({r // last.get("shards_per_task", 1) for r in failed})
        lines.append(f"  shard(s) {', '.join(map(str, failed))} failed, so merge job {last['merge_job_id']} cannot run. "
                     f"Continue with:  run_shards rerun {run.root}")
        lines.append(f"  (the same by hand: sbatch --array={array_ranges(tasks)} {slurm_dir(run) / 'shards.sbatch'}, "
                     f"then sbatch --dependency=afterok:<its job id> --kill-on-invalid-dep=yes "
                     f"{slurm_dir(run) / 'merge.sbatch'})")
    elif complete and not run.result_path.exists():
        lines.append(f"  every shard is complete; the merge job {last['merge_job_id']} has not written the result "
                     f"(still queued, or it failed: {run.logs_dir}/slurm_merge_{last['merge_job_id']}.out). "
                     f"`run_shards merge {run.root}` finishes the run")
    return lines

