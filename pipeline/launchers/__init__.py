"""How a planned run's shards get computed: one small interface, one module per engine.

    local  spawn one worker per GPU (or CPU slot) on this machine and supervise them (the default)
    slurm  submit a job array (a task per shard, or per group of shards) and a merge job after it
    ray    one Ray task per shard on an existing (or a local) Ray cluster

The runner plans (index, input checks, manifest) and merges; a launcher only starts the shards, watches
them and says which did not finish. The run directory is all it shares with them: any process that runs
`run_shards work OUT --shard K` computes shard K, wherever it runs.
"""
from __future__ import annotations

from .job import Launched, ShardJob, Submitted


def launch(job: ShardJob) -> Launched | Submitted:
    """Compute or submit the shards. Launched: the shards are computed here (except those another process
    holds, which it names) and the caller merges; Submitted: a scheduler holds them. Raises RunFailed when
    shards did not finish."""
    name = job.manifest["config"].get("launcher", "local")
    if name == "local":
        from . import local
        return local.launch(job)
    if name == "slurm":
        from . import slurm
        return slurm.launch(job)
    if name == "ray":
        from . import ray_tasks
        return ray_tasks.launch(job)
    raise AssertionError(f"unknown launcher {name!r}")
