"""Worker processes waiting for a shard, by slot (a GPU, or a CPU worker slot): those a local run starts while
it plans (early_workers.py), and those that have finished a shard while more wait to start (supervisor.py gives
each the next one, so a run of more shards than slots starts a process and loads the model once per slot, not
once per shard). A waiting process holds no lock and has nothing left to write: one that no shard needs is
killed at once."""
from __future__ import annotations

import logging
import multiprocessing.connection
import os
import signal
from dataclasses import dataclass

log = logging.getLogger("run_shards")


@dataclass
class Spawned:
    """A worker process as spawned: its torch ProcessContext, the read end of its messages, and the write end
    of its orders (the shard to compute; for one started while the parent planned, the model to load first)."""
    context: object
    conn: multiprocessing.connection.Connection
    orders: multiprocessing.connection.Connection

    @property
    def process(self):
        return self.context.processes[0]


class WaitingWorkers:
    """The processes waiting on their slots, until each is given a shard or is no longer needed."""

    def __init__(self, spawned: dict[str, Spawned] | None = None):
        self.waiting = dict(spawned or {})

    def put(self, slot: str, spawned: Spawned) -> None:
        """A process done with its shard, waiting on `slot` for another."""
        self.waiting[slot] = spawned

    def take(self, slot: str, rank: int) -> Spawned | None:
        """The process waiting on `slot`, now told to compute shard `rank`; None when there is none, or it died
        meanwhile (then the caller starts a worker as it would have, which shows why, if it fails too)."""
        spawned = self.waiting.pop(slot, None)
        if spawned is None:
            return None
        if spawned.process.exitcode is None:
            try:
                spawned.orders.send(("shard", rank))
                return spawned
            except OSError as e:   # it ended between the check and the order
                log.debug("the worker waiting on slot %s is gone (%s)", slot, e)
        log.info("the worker waiting on slot %s ended before it was given shard %d (exit code %s); starting "
                 "another", slot, rank, spawned.process.exitcode)
        stop(spawned)
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
                log.debug("the worker waiting on slot %s is gone (%s)", slot, e)

    def close(self) -> None:
        """Stop every process still waiting: it holds no lock and has nothing left to write, so it is killed at
        once."""
        for spawned in self.waiting.values():
            stop(spawned)
        self.waiting.clear()


def stop(spawned: Spawned) -> None:
    """Kill a waiting (or ended) worker process and release what the parent holds of it: its process object's
    pipes too (a run of many shards would otherwise run out of file descriptors, `ulimit -n`)."""
    process = spawned.process
    if process.exitcode is None:
        try:
            os.kill(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.join()
    process.close()
    for conn in (spawned.conn, spawned.orders):
        if not conn.closed:
            conn.close()
