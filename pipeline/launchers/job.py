"""What the runner hands a launcher (ShardJob), what a scheduler launcher hands back (Submitted), and the
command that runs this run_shards on another node."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from index import SequenceIndex

from ..rundir.layout import RunDir


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


def self_command() -> list[str]:
    """The command that runs this very run_shards on another node of a shared file system: this Python,
    and the checkout's bin/run_shards (or the installed package)."""
    script = Path(__file__).resolve().parents[2] / "bin" / "run_shards"
    return [sys.executable, str(script)] if script.exists() else [sys.executable, "-m", "pipeline.cli"]
