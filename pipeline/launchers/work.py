"""`run_shards work OUT [--shard K]`: compute shard K of a planned run, on whatever node runs it.

This is what a SLURM array task or a Ray task runs. The shard number comes from `--shard`, or from the
scheduler's array index (SLURM_ARRAY_TASK_ID, PBS_ARRAY_INDEX, LSB_JOBINDEX - 1) plus RUN_SHARDS_OFFSET;
with `--shards-per-task G` task t computes shards tG .. tG+G-1, one worker per visible GPU (or CPU slot).
The worker is the same as a local run's: same checkpoints, shard lock, log and failure record. A complete
shard is skipped; SIGTERM (preemption, or the batch script before a time limit) makes every worker write
a final checkpoint and the command exit with 130. A shard another process computes (it holds the shard's
lock: a duplicate task) is left to it, and said so, with exit code 0. A Ray task's attempt that starts after
the command that submitted it cancelled it computes nothing (exit 130). It never merges: the merge job (or
driver) does.
"""
from __future__ import annotations

import logging
import os
import signal

from ..advice import command
from ..config import RunConfig
from ..errors import RunDirError, RunFailed, RunInterrupted, UserError
from ..exits import EXIT_USER_ERROR
from ..planning.run_index import load_run_index
from ..rundir.failure import FailureRecord
from ..rundir.layout import RunDir, unwritable_reason
from ..rundir.locks import ShardLock
from ..worker.parent_death import on_parent_death
from .job import Launched, ShardJob

log = logging.getLogger("run_shards")

TASK_INDEX_VARIABLES = (("SLURM_ARRAY_TASK_ID", 0), ("PBS_ARRAY_INDEX", 0), ("PBS_ARRAYID", 0),
                        ("LSB_JOBINDEX", 1))   # LSF numbers array elements from 1


def task_number(environ=os.environ) -> int | None:
    """The array task number of this process from the scheduler's variables, plus RUN_SHARDS_OFFSET; None
    outside an array task."""
    found = task_variable(environ)
    return None if found is None else found[2]


def task_variable(environ=os.environ) -> tuple[str, int, int] | None:
    """(the scheduler's variable, its first index, the task number it gives) for this process; None outside
    an array task."""
    for name, first in TASK_INDEX_VARIABLES:
        value = environ.get(name, "")
        if not value.strip():
            continue
        try:
            index = int(value)
        except ValueError:
            raise UserError(f"{name}={value!r} is not an array index") from None
        if index < first:   # LSF sets LSB_JOBINDEX=0 in every job that is not an array element
            continue
        try:
            return name, first, index - first + int(environ.get("RUN_SHARDS_OFFSET", "0") or 0)
        except ValueError:
            raise UserError(f"RUN_SHARDS_OFFSET={environ['RUN_SHARDS_OFFSET']!r} is not a number") from None
    return None


def shards_of_task(task: int, per_task: int, world: int) -> list[int]:
    return list(range(task * per_task, min((task + 1) * per_task, world)))   # (not per_task numbers, then cut)


def work(out: str, shard: int | None = None, shards_per_task: int | None = None, show_progress: bool = False) -> str:
    """Compute the shard(s) of this task; returns what became of them, one line each. RunFailed when some did
    not finish; a shard another process computes is left to it (not a failure: exit code 0)."""
    die_with_the_task()
    run = RunDir(out)
    manifest = run.read_manifest()
    why = unwritable_reason(run.root)
    if why:
        raise RunDirError(f"cannot compute shards in {run.root}: {why}. A task must be able to write its run "
                          "directory: run it on a node that mounts it read-write")
    run.restore_folders()
    from .ray_tasks import cancelled_submission
    if cancelled_submission(run.run_events_path):
        raise RunInterrupted(f"the command that submitted this Ray task cancelled it (it was interrupted) before "
                             f"Ray started it: nothing computed. Continue with:  {command('rerun', run.root)}")
    index = load_run_index(run, manifest, verify=False)   # mapped: this task reads its shards' rows only
    ranks = _task_shards(manifest, shard, shards_per_task)
    run.check_entry_kinds(ranks)
    todo, remaining = [], {}
    for k in ranks:
        state = _prepare_shard(run, index, manifest["world"], k)
        if state is not None:
            todo.append(k)
            remaining[k] = state.expected - state.durable
    if not todo:
        return f"shard(s) {', '.join(map(str, ranks))} already complete"
    busy = _computed_elsewhere(run, todo)   # (a worker checks again, under the lock, for a race)
    todo = [k for k in todo if k not in busy]
    if not todo:
        return "\n".join(Launched(busy=busy).busy_lines(run)[:-1])
    config = RunConfig.from_manifest(manifest)
    job = ShardJob(run, dict(manifest, config=dict(manifest["config"], **_node_devices(config, len(todo)))),
                   index, todo, remaining, show_progress,
                   continue_with=f"Continue with:  {command('rerun', run.root)}  (or this task again)")
    from . import local   # torch: only a task that computes pays its import (a requeued task finds its shard done)
    try:
        launched = local.launch(job)
    except RunFailed as e:
        # Every shard stopped on a user error (bad input, a damaged model): retrying cannot help, so exit 2,
        # which schedulers that retry (Ray) take as final.
        codes = {(run.failure(k) or FailureRecord(None, "")).exit_code for k in todo}
        if codes == {EXIT_USER_ERROR}:
            raise UserError(str(e)) from None
        raise
    busy.update(launched.busy)
    done = [k for k in todo if k not in busy]
    return "\n".join(([f"shard(s) {', '.join(map(str, done))} complete"] if done else [])
                     + Launched(busy=busy).busy_lines(run)[:-1])


def _computed_elsewhere(run: RunDir, ranks: list[int]) -> dict[int, dict]:
    """Shards a worker elsewhere holds now (and is not about to leave: see ShardLock), with its record:
    left to it without starting a worker here."""
    busy = {}
    for k in ranks:
        lock = ShardLock(run, k)
        if lock.held_elsewhere() and not (holder := lock.holder()).get("stopping"):
            busy[k] = holder
    return busy


def _task_shards(manifest: dict, shard: int | None, shards_per_task: int | None) -> list[int]:
    """The shard(s) this process computes: --shard, else those of its array task."""
    world = manifest["world"]
    per_task = shards_per_task or manifest["config"].get("shards_per_task", 1)
    if shard is not None:
        ranks = [shard]
    else:
        found = task_variable()
        if found is None:
            raise UserError("no shard given: pass --shard K, or run this as an array task (SLURM_ARRAY_TASK_ID, "
                            "PBS_ARRAY_INDEX or LSB_JOBINDEX is set there)")
        name, first, task = found
        ranks = shards_of_task(task, per_task, world)
        if not ranks:
            tasks = -(-world // per_task)
            numbering = (f" ({name}={os.environ[name].strip()}; {name} counts from {first}, so it runs "
                         f"{first}..{tasks - 1 + first} without RUN_SHARDS_OFFSET)") if first else ""
            raise UserError(f"array task {task} has no shard: this run has shards 0..{world - 1}, "
                            f"{per_task} per task, so tasks 0..{tasks - 1}{numbering}")
    bad = [k for k in ranks if not 0 <= k < world]
    if bad:
        raise UserError(f"shard {bad[0]}: this run has shards 0..{world - 1}")
    return ranks


def _prepare_shard(run: RunDir, index, world: int, rank: int):
    """Shard `rank`'s state, or None when it is complete. A damaged shard file is set aside first, under the
    shard's lock (another task computing the shard may be finishing it this moment)."""
    from ..output import shard_state
    state = shard_state.inspect(run, index.stride_shard(rank, world), rank, verify_shard=True)
    if state.state == "complete":
        log.info("shard %d is already complete", rank)
        return None
    if state.state == "corrupt":
        def set_aside():
            again = shard_state.inspect(run, index.stride_shard(rank, world), rank, verify_shard=True)
            if again.state == "corrupt":
                log.warning("shard %d cannot be used (%s); set aside and computed again", rank, again.detail)
                shard_state.set_aside(run.shard_path(rank))
        ShardLock(run, rank).if_free(set_aside)   # else its worker steps aside, or its holder replaces it
        state = shard_state.inspect(run, index.stride_shard(rank, world), rank, verify_shard=False)
        if state.state == "complete":
            return None
    return state


def die_with_the_task() -> None:
    """Under Ray, stop (SIGTERM: a final checkpoint) when the Ray worker that started this process dies, even
    by SIGKILL. Done here, after exec, because the task's worker has threads: a preexec_fn there may deadlock
    (the subprocess module's documentation warns of it)."""
    parent = os.environ.get("RUN_SHARDS_DIE_WITH")
    if parent:
        if not on_parent_death(int(parent), signal.SIGTERM):   # gone already: stop as its death would have
            os.kill(os.getpid(), signal.SIGTERM)


def _granted_cpus(name: str) -> int | None:
    """The CPUs environment variable `name` grants this task (None where it is unset or empty)."""
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    if not (value.isascii() and value.isdigit() and int(value) >= 1):   # (int() took '٣'; 'abc' was a traceback)
        raise UserError(f"{name}={value!r} is not a number of CPUs: set it to a whole number of 1 or more, or "
                        "unset it (it says how many CPUs this task may use)")
    return int(value)


def _node_devices(config: RunConfig, shards: int) -> dict:
    """Where this node's workers run: its visible GPUs (as SLURM or Ray set CUDA_VISIBLE_DEVICES) for a GPU
    run, else CPU workers sharing the CPUs this process may use."""
    from ..planning.devices import cpu_count, visible_gpus
    if config.on_gpu:
        gpus = visible_gpus()
        if not gpus:
            raise UserError("this run was planned for GPUs, and this node shows none (CUDA_VISIBLE_DEVICES "
                            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')!r}); request GPUs for its tasks "
                            "(e.g. --sbatch '--gres=gpu:1')")
        return {"devices": gpus[:shards], "workers": min(len(gpus), shards)}
    cpus = cpu_count()
    # CPUs granted but not pinned: a Ray task's num_cpus, and a SLURM task's allocation on clusters that do
    # not bind tasks to their CPUs (TaskPlugin=task/none), where two 1-CPU tasks would otherwise both use
    # every core of the node.
    for name in ("RUN_SHARDS_TASK_CPUS", "SLURM_CPUS_ON_NODE"):
        cpus = min(cpus, _granted_cpus(name) or cpus)
    workers = max(1, min(shards, cpus))
    return {"devices": [], "workers": workers, "threads_per_worker": max(1, cpus // workers)}
