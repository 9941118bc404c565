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

import logging
import os
import signal

from ..config import RunConfig
from ..errors import UserError
from ..rundir.layout import RunDir
from .supervisor import Spawned, spawn_worker

log = logging.getLogger("run_shards")


class EarlyWorkers:
    """The processes started for `slots` before the run's shards were known, until each is given one."""

    def __init__(self, spawned: dict[str, Spawned] | None = None):
        self.waiting = dict(spawned or {})

    def take(self, slot: str, rank: int) -> Spawned | None:
        """The process waiting on `slot`, now told to compute shard `rank`; None when there is none, or it died
        meanwhile (then the caller starts a worker as it would have, which shows why, if it fails too)."""
        spawned = self.waiting.pop(slot, None)
        if spawned is None:
            return None
        if spawned.context.processes[0].exitcode is None:
            try:
                spawned.orders.send(("shard", rank))
                spawned.orders.close()
                return spawned
            except OSError as e:   # it ended between the check and the order
                log.debug("the worker started early on slot %s is gone (%s)", slot, e)
        log.info("the worker started early on slot %s ended before its shard was given (exit code %s); "
                 "starting another", slot, spawned.context.processes[0].exitcode)
        _stop(spawned)
        return None

    def load_ahead(self, order: dict) -> None:
        """Tell every waiting worker the run's model, as the parent chose it (`planning.plan`'s on_model: engine,
        path, fingerprint, dtype, batch_invariant, logprobs, trust_remote_code): each loads it onto its device
        while the parent plans on, and its shard's engine uses it if the run's manifest asks for exactly that
        (models/preload.py)."""
        for slot, spawned in self.waiting.items():
            try:
                spawned.orders.send(("load", order))
            except OSError as e:   # it ended: `take` starts another for its shard, and says why
                log.debug("the worker started early on slot %s is gone (%s)", slot, e)

    def close(self) -> None:
        """Stop every process still waiting: it holds no lock and has written nothing, so it is killed at once."""
        for spawned in self.waiting.values():
            _stop(spawned)
        self.waiting.clear()


def start_early(config: RunConfig, run: RunDir) -> EarlyWorkers:
    """One waiting worker per slot of a local run (as many as it has shards), spawned now; none for other
    launchers, with RUN_SHARDS_EARLY_WORKERS=0, or when the slots cannot be told yet (the launcher then says
    why)."""
    if config.launcher != "local" or os.environ.get("RUN_SHARDS_EARLY_WORKERS", "1") == "0":
        return EarlyWorkers()
    from .local import slots_for
    try:
        slots = slots_for(config)[:config.world]
    except UserError:
        return EarlyWorkers()
    return EarlyWorkers({slot: spawn_worker(run, None, slot, config.on_gpu, config.threads_per_worker)
                         for slot in slots})


def _stop(spawned: Spawned) -> None:
    process = spawned.context.processes[0]
    if process.exitcode is None:
        try:
            os.kill(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.join()
    spawned.conn.close()
    if spawned.orders is not None and not spawned.orders.closed:
        spawned.orders.close()
