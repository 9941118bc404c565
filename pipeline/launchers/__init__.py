"""How a planned run's shards get computed: one small interface, one module per engine.

    local  spawn one worker per GPU (or CPU slot) on this machine and supervise them (the default)
    slurm  submit a job array (a task per shard, or per group of shards) and a merge job after it
    ray    one Ray task per shard on an existing (or a local) Ray cluster

The runner plans (index, input checks, manifest) and merges; a launcher only starts the shards, watches
them and says which did not finish. The run directory is all it shares with them: any process that runs
`run_shards work OUT --shard K` computes shard K, wherever it runs.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from index import SequenceIndex

from ..rundir.layout import RunDir

NAMES = ("local", "slurm", "ray")


@dataclass
class ShardJob:
    """What a launcher is asked to do: compute the shards `ranks` of the planned run in `run`."""
    run: RunDir
    manifest: dict
    index: SequenceIndex
    ranks: list[int]
    remaining: dict[int, int]      # sequences each shard has left (the parent's count of durable rows)
    show_progress: bool = True
    options: dict = field(default_factory=dict)   # per-command options (slurm: dry_run, wait)


@dataclass
class Submitted:
    """The shards are in a scheduler's hands: the command prints `text`, then (with --wait) calls `follow`,
    once it has released the run directory's lock, which the scheduler's merge job needs."""
    text: str
    follow: Callable[[], Path] | None = None


def launch(job: ShardJob) -> Path | Submitted | None:
    """Compute or submit the shards. None: every shard is computed and the caller merges now; a Path:
    the result is already merged (by a scheduler's merge job); Submitted: a scheduler holds them. Raises
    RunFailed when shards did not finish."""
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


def self_command() -> list[str]:
    """The command that runs this very run_shards on another node of a shared file system: this Python,
    and the checkout's bin/run_shards (or the installed package)."""
    script = Path(__file__).resolve().parents[2] / "bin" / "run_shards"
    return [sys.executable, str(script)] if script.exists() else [sys.executable, "-m", "pipeline.cli"]
