"""The two batch scripts of a SLURM run, written into OUT/slurm/ as plain, commented text a user can read
and edit: `shards.sbatch` (one array task per shard, or per group of shards) and `merge.sbatch`.

Array indices and dependencies are given on the sbatch command line, not in the scripts, so `rerun`
submits the same scripts again with other `--array` lists. A task's shards are its array index plus an
offset the command line passes (`--export=ALL,RUN_SHARDS_OFFSET=N`), because a cluster's MaxArraySize
caps the index values: arrays of more tasks are split into several array jobs.
"""
from __future__ import annotations

import shlex
from pathlib import Path

# SLURM sends USR1 to the batch shell this many seconds before the time limit: enough to finish a batch and
# write a checkpoint.
SIGNAL_SECONDS = 120


def array_ranges(tasks: list[int]) -> str:
    """`0-63`, `3,17,20-22`: the --array list of task indices."""
    tasks = sorted(set(tasks))
    parts, start = [], None
    for i, t in enumerate(tasks):
        if start is None:
            start = t
        if i + 1 == len(tasks) or tasks[i + 1] != t + 1:
            parts.append(str(start) if start == t else f"{start}-{t}")
            start = None
    return ",".join(parts)


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


def _for_merge(group: list[str]) -> bool:
    """Whether the merge job, which needs no GPU (nor other generic resources) and is no array, keeps it."""
    name = _option_name(group)
    return not (asks_for_gpus(group) or name.startswith("--gres") or name in ("--array", "-a"))


def _directives(groups: list[list[str]]) -> list[str]:
    # sbatch reads #SBATCH lines with shell-like quoting, so quoted words survive spaces (paths, --comment).
    return [f"#SBATCH {_quote(g)}" for g in groups]


def shard_script(out: Path, command: list[str], sbatch_args: list[str], shards_per_task: int,
                 gpus_per_task: int) -> str:
    """The array job's script: `run_shards work OUT` for this task's shard(s), checkpointing and requeueing
    itself when SLURM warns of its time limit or preemption."""
    directives = [[f"--job-name=run_shards:{out.name}"], [f"--output={out}/logs/slurm_%A_%a.out"],
                  ["--open-mode=append"], ["--requeue"], [f"--signal=B:USR1@{SIGNAL_SECONDS}"]]
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
        "# --requeue          SLURM may requeue this task (node failure; preemption, which first sends SIGTERM:",
        "#                    run_shards then writes a final checkpoint); it continues from its checkpoints",
        "# --open-mode=append a requeued task appends to its output file instead of overwriting it",
        f"# --signal=B:USR1@{SIGNAL_SECONDS} USR1 to this script {SIGNAL_SECONDS} s before the time limit: the trap below",
        "#                    asks run_shards to write a final checkpoint, then requeues the task",
    ]
    lines += _directives(directives + user)
    lines += [
        "",
        "set -u",
        f"shard_command=({_quote(command)} work {shlex.quote(str(out))})",
        "",
        "checkpoint_and_requeue() {",
        "    echo \"run_shards: USR1 from SLURM (the time limit is near): checkpointing, then requeueing\"",
        "    kill -TERM \"$pid\" 2>/dev/null   # run_shards writes a final checkpoint and exits with 130",
        "    wait \"$pid\"",
        "    scontrol requeue \"${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}\"",
        "    exit 0",
        "}",
        "trap checkpoint_and_requeue USR1",
        "",
        "\"${shard_command[@]}\" &",
        "pid=$!",
        "wait \"$pid\"   # returns early when USR1 arrives; the trap then runs",
        "exit $?",
        "",
    ]
    return "\n".join(lines)


def merge_script(out: Path, command: list[str], sbatch_args: list[str]) -> str:
    """The merge job's script, submitted to start once every shard task has succeeded (afterok)."""
    keep = [g for g in option_groups(sbatch_args) if _for_merge(g)]
    lines = [
        "#!/bin/bash",
        f"# run_shards: merge the shards of the run in {out} into {out}/result.h5",
        "# Submitted with --dependency=afterok:<shard array jobs> --kill-on-invalid-dep=yes: it starts once",
        "# every shard task has succeeded, and is cancelled if one failed (then `run_shards rerun` resubmits",
        "# the failed shards and a new merge job). Needs no GPU.",
    ]
    lines += _directives([[f"--job-name=run_shards-merge:{out.name}"], [f"--output={out}/logs/slurm_merge_%j.out"],
                          ["--open-mode=append"]] + keep)
    lines += ["", f"exec {_quote(command)} merge {shlex.quote(str(out))}", ""]
    return "\n".join(lines)
