"""The two batch scripts of a SLURM run, written into OUT/slurm/ as plain, commented text a user can read
and edit: `shards.sbatch` (one array task per shard, or per group of shards) and `merge.sbatch`.

Array indices and dependencies are given on the sbatch command line, not in the scripts, so `rerun`
submits the same scripts again with other `--array` lists. A task's shards are its array index plus an
offset the command line passes (`--export=ALL,RUN_SHARDS_OFFSET=N`), because a cluster's MaxArraySize
caps the index values: arrays of more tasks are split into several array jobs.
"""
from __future__ import annotations

import re
import shlex
from collections.abc import Iterable
from pathlib import Path

# SLURM sends USR1 to the batch shell this many seconds before the time limit (enough to finish a batch and
# write a checkpoint), or a tenth of a shorter limit, at least MIN_SIGNAL_SECONDS: a 120 s warning under a
# one-minute limit would requeue every task at once.
SIGNAL_SECONDS = 120
MIN_SIGNAL_SECONDS = 10
# What the merge job keeps of the shard tasks' --sbatch options: who pays for it. Its partition, time limit
# and anything else come from --merge-sbatch (a GPU partition may refuse a job that asks for no GPU).
MERGE_KEEPS = ("--account", "-A", "--qos", "-q")


def signal_seconds(time_limit: int | None) -> int:
    """How long before the time limit (seconds, None: unknown) USR1 comes: SIGNAL_SECONDS, or a tenth of a
    limit shorter than ten times that."""
    if time_limit is None:
        return SIGNAL_SECONDS
    return max(MIN_SIGNAL_SECONDS, min(SIGNAL_SECONDS, time_limit // 10))


def parse_time(value: str) -> int | None:
    """Seconds of a SLURM time limit: `MM`, `MM:SS`, `HH:MM:SS`, `D-HH`, `D-HH:MM`, `D-HH:MM:SS`; None for
    `UNLIMITED`/`INFINITE`/`NONE` or anything else it cannot read."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", value.strip())
    if not m:
        return None
    days, a, b, c = m.groups()
    if days is not None:   # D-HH[:MM[:SS]]
        return int(days) * 86400 + int(a) * 3600 + int(b or 0) * 60 + int(c or 0)
    if c is not None:      # HH:MM:SS
        return int(a) * 3600 + int(b) * 60 + int(c)
    return int(a) * 60 + int(b or 0)   # MM[:SS]


def option_value(args: list[str], names: tuple[str, ...]) -> str | None:
    """The value of the last of these options among sbatch arguments (`--time=10`, `--time 10`, `-t10`,
    `-t 10`), or None."""
    found = None
    for group in option_groups(args):
        name = _option_name(group)
        if name not in names:
            continue
        word = " ".join(group)
        found = word.split("=", 1)[1] if "=" in group[0] else (" ".join(group[1:]) or word[len(name):])
    return found


def array_ranges(tasks: Iterable[int | range]) -> str:
    """`0-63`, `3,17,20-22`: the --array list of task indices (numbers, or ranges of them)."""
    return ",".join(str(r.start) if r.stop - r.start == 1 else f"{r.start}-{r.stop - 1}" for r in merged_ranges(tasks))


def merged_ranges(tasks: Iterable[int | range]) -> list[range]:
    """The fewest ascending ranges that hold `tasks`, numbers or ranges of step 1, each range taken whole
    (`rerun --shards 0-20000000` is bounded by the run's shards before it is counted out)."""
    spans = sorted((t.start, t.stop) if isinstance(t, range) else (t, t + 1) for t in tasks)
    merged: list[list[int]] = []
    for start, stop in spans:
        if start >= stop:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    return [range(start, stop) for start, stop in merged]


def expand_ranges(ranges: str) -> list[int]:
    """The task indices of an --array list (`0-3,7` -> 0, 1, 2, 3, 7): array_ranges read back."""
    found = []
    for part in ranges.split("%")[0].split(","):
        if part:
            first, _, last = part.partition("-")
            found += range(int(first), int(last or first) + 1)
    return found


def split_arrays(tasks: list[int], max_array_size: int) -> list[tuple[int, list[int]]]:
    """[(offset, indices)]: task numbers grouped so that every index (task - offset) stays below
    MaxArraySize, as SLURM requires. Tasks below MaxArraySize keep their number as index (offset 0: `rerun`
    submits --array=3,17); each further array starts at the first task the ones before leave out, so a
    rerun of tasks 1500-2500 with MaxArraySize 1001 is one array, not two."""
    assert max_array_size >= 1
    groups: list[tuple[int, list[int]]] = []
    for t in sorted(set(tasks)):
        if not groups or t - groups[-1][0] >= max_array_size:
            groups.append((0 if t < max_array_size else t, []))
        groups[-1][1].append(t - groups[-1][0])
    return groups


def _quote(words: list[str]) -> str:
    return " ".join(shlex.quote(str(w)) for w in words)


def option_groups(args: list[str]) -> list[list[str]]:
    """The user's sbatch options, each with its value: `--partition gpu` is one option of two words (one
    #SBATCH line), as is `--partition=gpu` of one."""
    groups: list[list[str]] = []
    for word in args:
        if word.startswith("-") or not groups:
            groups.append([word])
        else:
            groups[-1].append(word)
    return groups


def _option_name(group: list[str]) -> str:
    name = group[0].split("=", 1)[0]
    return name if name.startswith("--") else name[:2]   # -G1, -G 1


def asks_for_gpus(group: list[str]) -> bool:
    """--gres=gpu:1, --gres gpu:a100:1, --gpus 2, -G 2, --gpus-per-node, --cpus-per-gpu, --mem-per-gpu, ...:
    options that ask for GPUs or only make sense with them."""
    name = _option_name(group)
    value = " ".join(group)[len(name):]
    return name == "-G" or "gpu" in name or (name == "--gres" and "gpu" in value)


def _directives(groups: list[list[str]]) -> list[str]:
    # sbatch reads #SBATCH lines with shell-like quoting, so quoted words survive spaces (paths, --comment).
    return [f"#SBATCH {_quote(g)}" for g in groups]


def shard_script(out: Path, command: list[str], sbatch_args: list[str], shards_per_task: int,
                 gpus_per_task: int, lead: int = SIGNAL_SECONDS) -> str:
    """The array job's script: `run_shards work OUT` for this task's shard(s), checkpointing and requeueing
    itself when SLURM warns of its time limit (USR1, `lead` seconds before it) or stops it (TERM)."""
    directives = [[f"--job-name=run_shards:{out.name}"], [f"--output={out}/logs/slurm_%A_%a.out"],
                  ["--open-mode=append"], ["--requeue"], [f"--signal=B:USR1@{lead}"]]
    user = option_groups(sbatch_args)
    if gpus_per_task and not any(asks_for_gpus(g) for g in user):
        directives.append([f"--gres=gpu:{gpus_per_task}"])
    lines = [
        "#!/bin/bash",
        f"# run_shards: compute the shards of the run in {out}",
        "# Written by `run_shards run --launcher slurm`; `run_shards rerun` submits it again for unfinished",
        "# shards. The array index plus RUN_SHARDS_OFFSET (set on the sbatch command line) is the task number;",
        ("# task t computes shard t." if shards_per_task == 1 else
         f"# task t computes shards {shards_per_task}t .. {shards_per_task}t+{shards_per_task - 1}, one worker per GPU."),
        "#",
        "# --requeue          SLURM may requeue this task (node failure, preemption); it continues from its",
        "#                    checkpoints",
        "# --open-mode=append a requeued task appends to its output file instead of overwriting it",
        f"# --signal=B:USR1@{lead} USR1 to this script {lead} s before the time limit (a tenth of a limit under",
        f"#                    {10 * SIGNAL_SECONDS} s)",
        "# On USR1 (the time limit is near) or TERM (preemption, `scancel --signal=TERM`), the trap below passes",
        "# the signal on to run_shards, waits for its final checkpoint, and requeues this task, which continues",
        "# from there; a task SLURM itself is ending (scancel, the time limit) is not requeued: it ends, its",
        "# checkpoints kept.",
    ]
    lines += _directives(directives + user)
    lines += [
        "",
        "set -u",
        # The grouping goes with the submitted script: a later command may change the run's --shards-per-task
        # while this array's tasks wait in the queue, and they must still compute the shards they were sent for.
        f"shard_command=({_quote(command)} work {shlex.quote(str(out))} --shards-per-task {shards_per_task})",
        "",
        "checkpoint_and_requeue() {   # $1: the signal, $2: why",
        "    echo \"run_shards: $1 from SLURM ($2): asking for a final checkpoint, then requeueing this task\"",
        "    trap '' USR1 TERM        # once: nothing more interrupts the wait for its checkpoint",
        "    kill \"-$1\" \"$pid\" 2>/dev/null",
        "    wait \"$pid\"",
        "    code=$?",
        "    [ \"$code\" = 0 ] && exit 0  # it finished its shards meanwhile",
        "    # TERM from SLURM ending the job itself (scancel, the time limit) leaves it COMPLETING: no requeue",
        "    task=\"${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}\"",
        "    state=$(scontrol show job \"$task\" -o 2>/dev/null | grep -o 'JobState=[A-Z_]*')",
        "    if [ \"$1\" = TERM ] && [ \"$state\" != JobState=RUNNING ]; then",
        "        echo \"run_shards: not requeued: SLURM is ending this task (${state:-its state unknown})\"",
        "        exit \"$code\"",
        "    fi",
        "    scontrol requeue \"$task\" && exit 0",
        "    exit \"$code\"              # not requeued: the task ends, its checkpoints kept",
        "}",
        "trap 'checkpoint_and_requeue USR1 \"the time limit is near\"' USR1",
        "trap 'checkpoint_and_requeue TERM \"the job is being stopped\"' TERM",
        "",
        "\"${shard_command[@]}\" &",
        "pid=$!",
        "wait \"$pid\"   # returns early when a trapped signal arrives; the trap then runs",
        "exit $?",
        "",
    ]
    return "\n".join(lines)


def merge_options(sbatch_args: list[str], merge_args: list[str], time_minutes: int) -> list[list[str]]:
    """The merge job's sbatch options: the account and QOS of --sbatch (who pays), then --merge-sbatch's
    (partition, time, memory, ...); a time limit from the data's size unless --merge-sbatch sets one. Never
    --exclusive, a GPU or an array: a merge is one process that reads the shards and writes one file."""
    keep = [g for g in option_groups(sbatch_args) if _option_name(g) in MERGE_KEEPS]
    own = option_groups(merge_args)
    if option_value(merge_args, ("--time", "-t")) is None:
        own.append([f"--time={time_minutes}"])
    return keep + own


def merge_script(out: Path, command: list[str], options: list[list[str]], lock_wait: int) -> str:
    """The merge job's script, submitted to start once every shard task has succeeded (afterok)."""
    lines = [
        "#!/bin/bash",
        f"# run_shards: merge the shards of the run in {out} into {out}/result.h5",
        "# Submitted with --dependency=afterok:<shard array jobs> --kill-on-invalid-dep=yes: it starts once",
        "# every shard task has succeeded, and is cancelled if one failed (then `run_shards rerun` resubmits",
        "# the failed shards and a new merge job). It is one process that needs no GPU: it keeps only the",
        "# account and QOS of --sbatch, and takes its partition, time limit and other options from",
        "# --merge-sbatch (its time limit, when not given, from the size of the data to merge).",
        f"# --lock-wait {lock_wait}: it waits up to that many seconds for another command using the run (a merge",
        "# by hand) and for shards still being computed, instead of failing at once.",
    ]
    lines += _directives([[f"--job-name=run_shards-merge:{out.name}"], [f"--output={out}/logs/slurm_merge_%j.out"],
                          ["--open-mode=append"]] + options)
    lines += ["", f"exec {_quote(command)} merge {shlex.quote(str(out))} --lock-wait {lock_wait}", ""]
    return "\n".join(lines)
