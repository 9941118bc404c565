"""Whether a local CPU run's workers can each hold a copy of the model: each worker loads the whole model into its
own memory, at the run's dtype, as it starts. Where the copies cannot fit in the memory available (host_memory.py:
the free RAM, or a cgroup limit's room), every worker was started, read the weights and the kernel's OOM killer
ended some of them mid-load; the run is refused before any loads instead, naming a worker count that fits."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..config import RunConfig
from ..errors import UserError, human_bytes
from ..host_memory import available_ram
from ..models.checkpoint_facts import weight_values

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def check_model_copies(config: RunConfig, path: str | Path, shards: int | None = None, planned: bool = False) -> None:
    """UserError where the run's CPU workers (as many at once as it has workers and shards to compute: `shards`,
    else all of the run's) would together hold more model than there is memory available now, before any worker
    loads it. `planned`: the run exists already (its dtype is fixed). Runs on GPUs (their copies are in GPU memory),
    on a cluster (other machines) and of checkpoints whose size cannot be told from their headers (.bin files) are
    not checked."""
    if config.launcher != "local" or config.on_gpu:
        return
    values = weight_values(Path(path))
    free, where = available_ram()
    if not values or free is None:
        return
    dtype = config.torch_dtype_name
    one = values * DTYPE_BYTES.get(dtype, 4)
    workers = min(config.workers, shards or config.world)
    if workers * one <= free:
        return
    text = (f"{workers} CPU worker(s) would each hold a copy of the model ({human_bytes(one)} in {dtype}): "
            f"{human_bytes(workers * one)} in all, and {human_bytes(free)} of {where} is free, so the kernel's "
            "out-of-memory killer would end workers as they load it")
    fit = free // one
    if fit >= 1:
        raise UserError(f"{text}. Run it with {fit} worker(s): `{replace(config, workers=fit).as_command()}`")
    if dtype == "float32" and values * 2 <= free and not planned:   # (one worker in bfloat16: half the memory)
        raise UserError(f"{text}; one copy alone does not fit in float32. In bfloat16 (half the memory; values in "
                        "16-bit, and not batch-invariant on CPU) one worker fits: "
                        f"`{replace(config, workers=1, dtype='bfloat16').as_command()}`")
    raise UserError(f"{text}; one copy alone does not fit: free memory, or run it on a machine with more")
