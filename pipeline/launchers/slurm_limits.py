"""What a SLURM cluster allows, read from its own commands before submitting: the array size and job
count limits (`scontrol show config`), and the shard tasks' time limit (--time, else the partition's), which
sets how early USR1 comes and whether one checkpoint fits before it."""
from __future__ import annotations

import logging
import re
import shutil
import subprocess

from ..config import RunConfig
from ..errors import UserError
from .sbatch_scripts import option_value, parse_time

log = logging.getLogger("run_shards")

DEFAULT_MAX_ARRAY_SIZE = 1001      # SLURM's default MaxArraySize


def time_limit(user_args: list[str], dry_run: bool) -> int | None:
    """The shard tasks' time limit in seconds: --time of --sbatch, else the partition's own (DefaultTime,
    else MaxTime, from `scontrol show partition`); None when unlimited or unknown."""
    given = option_value(user_args, ("--time", "-t"))
    if given is not None:
        return parse_time(given)
    if dry_run or shutil.which("scontrol") is None:
        return None
    partition = option_value(user_args, ("--partition", "-p"))
    try:
        res = subprocess.run(["scontrol", "show", "partition", *([partition.split(",")[0]] if partition else [])],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.debug("scontrol show partition gave no answer: %s", e)
        return None
    blocks = [b for b in res.stdout.split("\n\n") if b.strip()]
    chosen = blocks[0] if partition else next((b for b in blocks if re.search(r"\bDefault=YES\b", b)), "")
    for key in ("DefaultTime", "MaxTime"):
        m = re.search(rf"\b{key}=(\S+)", chosen)
        if m and parse_time(m[1]) is not None:
            return parse_time(m[1])
    return None


def warn_if_short(limit: int | None, lead: int, config: RunConfig) -> None:
    """Planning's word on a time limit too short for the checkpoints: a task that reaches it before its
    first checkpoint keeps nothing, and is requeued to start over."""
    if limit is not None and limit < config.checkpoint_seconds + lead:
        log.warning("the shard tasks' time limit (%d s) is shorter than one checkpoint interval "
                    "(--checkpoint-seconds %g) plus the %d s warning before it: a task that reaches it keeps only "
                    "what it checkpointed. Give a longer --time in --sbatch, or lower --checkpoint-seconds.",
                    limit, config.checkpoint_seconds, lead)


def max_array_size(dry_run: bool) -> int:
    """The cluster's MaxArraySize (array indices must stay below it), from `scontrol show config`."""
    value = _config_value("MaxArraySize")
    if value is None:
        if not dry_run and shutil.which("scontrol") is not None:
            log.warning("could not read MaxArraySize from `scontrol show config`; assuming %d",
                        DEFAULT_MAX_ARRAY_SIZE)
        return DEFAULT_MAX_ARRAY_SIZE
    return max(1, value)


def _config_value(name: str) -> int | None:
    """An integer setting of the cluster's slurm.conf, from `scontrol show config`; None when unknown."""
    if shutil.which("scontrol") is None:
        return None
    try:
        res = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.debug("scontrol show config gave no answer: %s", e)
        return None
    m = re.search(rf"^{name}\s*=\s*(\d+)", res.stdout, re.M)
    return int(m.group(1)) if m else None


def check_job_count(tasks: int, per_task: int) -> None:
    """SLURM's controller holds at most MaxJobCount jobs, and every array task counts as one (pending ones
    too): a submission above it would be refused after sbatch's retries, with a vaguer message."""
    limit = _config_value("MaxJobCount")
    if limit is not None and tasks + 1 > limit:
        raise UserError(f"{tasks:,} array tasks and a merge job are more than this cluster's controller holds "
                        f"(MaxJobCount = {limit:,}; every array task counts as one job). Put more shards in each "
                        f"task: --shards-per-task {-(-(tasks * per_task) // (limit // 2))} (or fewer --shards)")
