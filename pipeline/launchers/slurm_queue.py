"""What SLURM says about a run's jobs: its submissions (OUT/slurm/jobs.json) and, from squeue, the state,
reason, node and restarts of each array task and merge job, mapped back to the shards each task computes.

`run` and `rerun` read it before submitting (never a shard twice, one merge job at a time), `--wait`
follows it, and `status` and report.html show it. squeue forgets a job MinJobAge (300 s by default) after
it ended; the run directory remains the record of what is done.
"""
from __future__ import annotations

import json
import logging
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..rundir.layout import RunDir, write_atomic
from .sbatch_scripts import expand_ranges

log = logging.getLogger("run_shards")

# Job states in which SLURM will still run (or is running) the job, or has not yet said whether it will:
# COMPLETING is the time of the node's epilog after the batch script ended, and a task being requeued (the
# batch script's trap ran `scontrol requeue`) shows it too, with its restart count already raised, before it is
# PENDING again; squeue shows no flag that tells the two apart. STOPPED (SIGSTOP from `scancel --signal=STOP`)
# keeps its allocation, and SUSPENDED its place. The others of squeue's states (BOOT_FAIL, CANCELLED, COMPLETED,
# DEADLINE, FAILED, NODE_FAIL, OUT_OF_MEMORY, PREEMPTED, REVOKED, TIMEOUT) mean it ended.
ENDING_STATE = "COMPLETING"
LIVE_JOB_STATES = {"PENDING", "RUNNING", "CONFIGURING", "SUSPENDED", "STOPPED", "REQUEUED", "REQUEUE_HOLD",
                   "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD", "SPECIAL_EXIT", ENDING_STATE}
RUNNING_STATES = {"RUNNING", "CONFIGURING", "SIGNALING", "STAGE_OUT"}
FIELDS = ("JobArrayID", "State", "Reason", "NodeList", "RestartCnt", "SubmitTime", "StartTime", "EndTime")


@dataclass
class Task:
    """One array task (`123_4`) or job (`125`) as squeue shows it."""
    job_id: str
    state: str
    reason: str = ""
    node: str = ""
    restarts: int = 0
    submitted: str = ""
    started: str = ""
    ended: str = ""

    @property
    def live(self) -> bool:
        """SLURM will still run it (pending: waiting for a node or a dependency; running), or may (ending: it
        is requeued, or it ends, once it leaves COMPLETING)."""
        return self.state in LIVE_JOB_STATES and self.reason != "DependencyNeverSatisfied"

    @property
    def ending(self) -> bool:
        """Its batch script ended; SLURM finishes the task, and then requeues it or says how it ended."""
        return self.state == ENDING_STATE

    @property
    def running(self) -> bool:
        return self.state in RUNNING_STATES

    @property
    def phase(self) -> str:
        """A live task's state in one word: running, ending, requeued, suspended, stopped or pending."""
        if self.running:
            return "running"
        if self.ending:
            return "ending"
        if self.requeued:
            return "requeued"
        return self.state.lower() if self.state in ("SUSPENDED", "STOPPED") else "pending"

    @property
    def requeued(self) -> bool:
        return self.state.startswith("REQUEUE") or (self.state == "PENDING" and self.restarts > 0)

    def words(self) -> str:
        """`RUNNING on n1`, `PENDING (Priority)`, `FAILED (JobLaunchFailure)`, `PENDING, requeued 2 time(s)`."""
        text = self.state + (f" on {self.node}" if self.running and self.node else "")
        if self.restarts:
            text += f", requeued {self.restarts} time(s)"
        if self.reason and self.reason != "None":
            text += f" ({self.reason})"
        return text


def slurm_dir(run: RunDir) -> Path:
    return run.root / "slurm"


def submissions(run: RunDir) -> list[dict]:
    """Every submission of this run, oldest first (OUT/slurm/jobs.json)."""
    path = slurm_dir(run) / "jobs.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        log.warning("cannot read %s (%s); earlier submissions are not known", path, e)
        return []


def append_submission(run: RunDir, record: dict) -> None:
    write_atomic(slurm_dir(run) / "jobs.json", json.dumps(submissions(run) + [record], indent=1))


def job_ids(subs: list[dict]) -> list[str]:
    """Every array and merge job id of these submissions."""
    ids = [a["job_id"] for s in subs for a in s["arrays"]] + [s["merge_job_id"] for s in subs]
    return list(dict.fromkeys(i for i in ids if i))


def query(ids: list[str]) -> dict[str, Task] | None:
    """{task or job id: Task} of these jobs (every array task apart, ended ones squeue still keeps); None
    when squeue cannot answer (not installed here, or no word from the controller, which must not read as
    every job being gone)."""
    if not ids:
        return {}
    found = _squeue(["--states=all", "--jobs=" + ",".join(ids)])
    return None if found is None else {task.job_id: task for task, _ in found}


def _squeue(selection: list[str], extra: tuple[str, ...] = ()) -> list[tuple[Task, list[str]]] | None:
    """The array tasks and jobs squeue lists for `selection` (its options), each with the values of the `extra`
    fields; None when squeue cannot answer. A job id squeue has forgotten (ended over MinJobAge ago) is an
    error of squeue's: nothing listed."""
    try:
        res = subprocess.run(["squeue", "--noheader", "--array", *selection,
                              "--Format=" + ",".join(f"{f}:|" for f in FIELDS + extra)],
                             capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.debug("squeue gave no answer: %s", e)
        return None
    if res.returncode != 0:
        if "Invalid job id" in res.stderr:
            return []
        log.debug("squeue failed: %s", res.stderr.strip())
        return None
    found = []
    for line in res.stdout.splitlines():
        words = [w.strip() for w in line.split("|")]
        if len(words) < len(FIELDS) + len(extra):
            continue
        job, state, reason, node, restarts, submitted, started, ended = words[:len(FIELDS)]
        found.append((Task(job, state, reason, node, int(restarts) if restarts.isdigit() else 0, submitted, started,
                           ended), words[len(FIELDS):len(FIELDS) + len(extra)]))
    return found


def unrecorded_jobs(run: RunDir, subs: list[dict]) -> list[tuple[str, Task]] | None:
    """The live jobs and array tasks of this run's scripts (OUT/slurm/shards.sbatch, merge.sbatch) that no
    submission of run_shards recorded: the commands a --dry-run printed, submitted by hand. Found by the jobs'
    names (run_shards:NAME, run_shards-merge:NAME) and kept where their command is one of the scripts. None
    when squeue cannot answer. Each as ("shards" or "merge", the task)."""
    scripts = {(slurm_dir(run) / f"{kind}.sbatch").resolve(): kind for kind in ("shards", "merge")}
    listed = _squeue([f"--name=run_shards:{run.root.name},run_shards-merge:{run.root.name}"], ("WorkDir", "Command"))
    if listed is None:
        return None
    recorded = set(job_ids(subs))
    kinds = ((scripts.get((Path(workdir) / script).resolve()), task) for task, (workdir, script) in listed)
    return [(kind, task) for kind, task in kinds
            if kind is not None and task.job_id.split("_")[0] not in recorded and task.live]


def unrecorded_lines(run: RunDir, jobs: list[tuple[str, Task]]) -> list[str]:
    """What `run`, `rerun` and `status` say of jobs unrecorded_jobs found."""
    jobs = sorted(jobs, key=lambda job: [(len(part), part) for part in job[1].job_id.split("_")])
    shown = [f"{t.job_id} {t.words()}" + (" (the merge job)" if kind == "merge" else "") for kind, t in jobs[:6]]
    more = f" and {len(jobs) - 6:,} more" if len(jobs) > 6 else ""
    ids = " ".join(sorted({t.job_id.split("_")[0] for _, t in jobs}, key=lambda i: (len(i), i)))
    return [f"SLURM holds job(s) of this run's scripts ({slurm_dir(run)}) that run_shards did not submit (the "
            f"commands a --dry-run printed, submitted by hand): {'; '.join(shown)}{more}. They compute its shards "
            "and merge it.",
            f"To submit through run_shards instead, cancel them first (scancel {ids})."]


def shard_task_ids(run: RunDir, subs: list[dict], world: int) -> dict[int, str]:
    """{shard: id of the array task that computes it in the latest submission that holds it}."""
    found: dict[int, str] = {}
    for sub in subs:
        per_task = sub.get("shards_per_task", 1)
        for array in sub["arrays"]:
            for index in expand_ranges(array["array"]):
                task = array["offset"] + index
                for rank in range(task * per_task, min((task + 1) * per_task, world)):
                    found[rank] = f"{array['job_id']}_{index}"
    return found


@dataclass
class Queue:
    """A run's jobs as SLURM sees them now."""
    subs: list[dict]
    tasks: dict[str, Task] | None        # None: squeue gave no answer
    by_shard: dict[int, str]             # shard -> its latest task id

    @classmethod
    def read(cls, run: RunDir, world: int) -> "Queue":
        subs = submissions(run)
        return cls(subs, query(job_ids(subs)), shard_task_ids(run, subs, world))

    @property
    def answered(self) -> bool:
        return self.tasks is not None

    def task_of(self, rank: int) -> Task | None:
        """The task computing shard `rank` (None: never submitted, forgotten by squeue, or no answer)."""
        task_id = self.by_shard.get(rank)
        return (self.tasks or {}).get(task_id) if task_id else None

    def live_shards(self, ranks: list[int]) -> dict[int, Task]:
        return {r: t for r in ranks if (t := self.task_of(r)) is not None and t.live}

    @property
    def merge_id(self) -> str | None:
        return self.subs[-1]["merge_job_id"] if self.subs else None

    @property
    def merge(self) -> Task | None:
        return (self.tasks or {}).get(self.merge_id) if self.merge_id else None

    def merge_state(self) -> str | None:
        """"waiting" (pending or running), "gone" (it ended, was cancelled, or waits on a dependency that can
        never be met), or None when squeue cannot tell."""
        if self.tasks is None:
            return None
        merge = self.merge
        return "waiting" if merge is not None and merge.live else "gone"


SETTINGS_REFUSED = ("a rerun stops the same way: the shard(s) refused the run's settings, and the message above "
                    "names what to run instead")


def stopped_lines(run: RunDir, stopped: dict[int, str], tasks: dict[int, Task] | None = None) -> list[str]:
    """One line per shard that stopped (failed or interrupted): the reason from its failure record (else the
    last warning or error of its log), what SLURM says of its task, and its log."""
    lines = []
    for r, state in sorted(stopped.items()):
        record = run.failure(r)
        why = record.summary() if record else "no record of why"
        if record and not record.reason:
            last = next((line.split(": ", 1)[-1] for line in reversed(record.log_tail)
                         if " ERROR " in line or " WARNING " in line), "")
            why += f" - {last}" if last else ""
        task = (tasks or {}).get(r)
        slurm = f" (SLURM: task {task.job_id} {task.words()})" if task is not None else ""
        if task is not None and task.reason == "JobLaunchFailure":
            slurm += (f"; SLURM could not start it, often because the node cannot write {run.logs_dir}: is the "
                      f"run directory mounted read-write on {task.node or 'that node'}?")
        verb = "was interrupted" if state == "interrupted" else "failed"
        lines.append(f"shard {r} {verb}: {why}{slurm}\n  log: {run.worker_log(r)}")
    return lines
