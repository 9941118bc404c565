"""What the runner hands a launcher (ShardJob) and what it gets back (Launched: the shards are done here;
Submitted: a scheduler holds them), the words every launcher ends with (shards_summary), the one loop that
follows a run's progress from its directory (follow_run_dir), and the command that runs this run_shards on
another node."""
from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from index import SequenceIndex, records_changed

from ..advice import command
from ..output import shard_state
from ..planning.run_index import start_over_advice
from ..rundir.layout import RunDir
from ..rundir.locks import describe_holder
from .progress import ProgressBoard
from .sbatch_scripts import array_ranges


@dataclass
class ShardJob:
    """What a launcher is asked to do: compute the shards `ranks` of the planned run in `run`."""
    run: RunDir
    manifest: dict
    index: SequenceIndex
    ranks: list[int]
    remaining: dict[int, int]      # sequences each shard has left (the parent's count of durable rows)
    show_progress: bool = True
    dry_run: bool = False          # slurm: write the scripts and print the sbatch commands only
    wait: bool = False             # slurm: follow the submitted jobs until the result is merged
    continue_with: str = ""        # the "Continue with" line of a failure report (default: rerun the run)
    early: object = None           # local: waiting_workers.WaitingWorkers, started while the run was planned

    @property
    def world(self) -> int:
        return self.manifest["world"]

    def state(self, rank: int, verify: bool = False) -> shard_state.ShardState:
        return shard_state.inspect(self.run, self.index.stride_shard(rank, self.world), rank, verify_shard=verify)


@dataclass
class Launched:
    """The launcher is done: its shards are computed, except those another process was found computing
    (`busy`: shard -> that process's lock record), which it left to it. `timings`: (when the workers were
    started, the compute window from the first model loaded to the last batch), for the run's time split."""
    timings: tuple[float, tuple[float, float] | None] | None = None
    busy: dict[int, dict] = field(default_factory=dict)

    def busy_lines(self, run: RunDir) -> list[str]:
        """Each shard left to another process, and what to run once it is done."""
        if not self.busy:
            return []
        lines = [f"shard {r} is being computed by {describe_holder(h)}; left to it" for r, h in self.busy.items()]
        # (rerun, not merge: it merges a shard that finished, and computes one whose process stopped without)
        return lines + [f"Once it has stopped (`{command('status', run.root)}` shows it), continue with:  "
                        f"{command('rerun', run.root)}"]


@dataclass
class Submitted:
    """The shards are in a scheduler's hands: the command prints `text`, then (with --wait) calls `follow`,
    once it has released the run directory's lock, which the scheduler's merge job needs."""
    text: str
    follow: Callable[[], Path] | None = None


def shards_summary(job: ShardJob, interrupted: bool = False, failed: list[int] | None = None,
                   advised: bool = False) -> list[str]:
    """The lines every launcher ends a run that did not finish with: how many shards are complete, that
    nothing was merged and nothing durable lost, and the one command that continues (or, when the FASTA
    changed, how to start over). `advised`: every failed shard's own message names a new run as the way on (a
    worker's refusal of a run an earlier run_shards planned, or of its settings): `rerun` is not suggested, nor
    the task's `continue_with`."""
    run, world = job.run, job.world
    done = sum(1 for r in range(world) if run.shard_path(r).exists())
    lines = [f"{done:,} of {world:,} shards complete. No merged file was written; all finished and checkpointed "
             "rows are kept."]
    changed = records_changed(job.index)
    gone = run.gone()
    if gone:   # (a rerun here would find no run: the command goes where the directory is now)
        lines[0] = f"{done:,} of {world:,} shards complete. No merged file was written."
        lines.append(gone[0].upper() + gone[1:] + ".")
    elif changed:
        lines.append(f"The input FASTA changed since this run started ({changed}). "
                     f"{start_over_advice(run, job.manifest)}")
    elif advised:   # (before a task's own "Continue with": `rerun` or the task again stops the same way)
        pass
    elif job.continue_with:
        lines.append(job.continue_with)
    else:
        only = ["--shards", array_ranges(failed)] if failed and not interrupted else []
        lines.append(f"Continue with:  {command('rerun', run.root, *only)}")
    return lines


def follow_run_dir(job: ShardJob, board: ProgressBoard, wait: Callable[[], object]
                   ) -> Iterator[dict[int, shard_state.ShardState]]:
    """The one progress loop of launchers that do not see their workers (SLURM, Ray): read every shard's
    state from the run directory, move the bar by the rows made durable since, yield the states; then call
    `wait()` (a sleep, or a scheduler's own wait) and read again, until the caller stops."""
    credited = dict.fromkeys(job.ranks, 0)
    while True:
        states = {r: job.state(r) for r in job.ranks}
        for r, s in states.items():
            gained = s.durable - (s.expected - job.remaining[r])
            if gained > credited[r]:
                board.bar.update(gained - credited[r])
                credited[r] = gained
        yield states
        wait()


def self_command() -> list[str]:
    """The command that runs this very run_shards on another node of a shared file system: this Python,
    and the checkout's bin/run_shards (or the installed package)."""
    script = Path(__file__).resolve().parents[2] / "bin" / "run_shards"
    return [sys.executable, str(script)] if script.exists() else [sys.executable, "-m", "pipeline.cli"]
