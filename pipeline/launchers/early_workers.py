"""Workers started while the parent plans: a local run spawns one process per slot (GPU, or CPU worker slot)
before it plans; each imports torch, transformers and the engine and, on a GPU, creates its CUDA context,
then waits for the shard the supervisor gives it (worker/entry.py), which it computes as any worker does.
Planning and a worker's start then take the time of the longer, not of both. As soon as the parent has chosen a
model, each waiting worker also loads it (`load_ahead`, models/preload.py), so the weights come off the
disk and onto the device while the parent finishes planning. A process no shard needs (the
plan refused the run, fewer shards than slots were left) is killed before it has written anything; the same
command on a run whose result is there starts none.

RUN_SHARDS_EARLY_WORKERS=0 starts every worker only once its shard is known, as before.
"""
from __future__ import annotations

import os

from ..config import RunConfig
from ..errors import UserError
from ..rundir.layout import RunDir
from .supervisor import spawn_worker
from .waiting_workers import WaitingWorkers


def start_early(config: RunConfig, run: RunDir) -> WaitingWorkers:
    """One waiting worker per slot of a local run (as many as it has shards), spawned now; none for other
    launchers, with RUN_SHARDS_EARLY_WORKERS=0, or when the slots cannot be told yet (the launcher then says
    why)."""
    if config.launcher != "local" or os.environ.get("RUN_SHARDS_EARLY_WORKERS", "1") == "0":
        return WaitingWorkers()
    from .local import slots_for
    try:
        slots = slots_for(config)[:config.world]
    except UserError:
        return WaitingWorkers()
    return WaitingWorkers({slot: spawn_worker(run, None, slot, config.on_gpu, config.threads_per_worker)
                           for slot in slots})
