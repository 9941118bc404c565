"""Start shard workers with torch.multiprocessing.spawn and watch them until each has exited.

Each shard gets its own process and its own pipe. Workers are symmetric and independent: one that dies,
hangs or finishes early never blocks the others. At most one worker runs per slot (a GPU, or a CPU worker
slot); shards beyond the slots wait for one to free. The parent never touches CUDA.
"""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import time
from dataclasses import dataclass

import torch.multiprocessing

from ..exits import EXIT_INTERRUPTED, explain_exit, signal_name
from .progress import ProgressBoard
from ..rundir.layout import RunDir, RunLock
from ..worker.entry import worker_entry

log = logging.getLogger("run_shards")

KILL_GRACE_SECONDS = 10.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass
class ShardProcess:
    rank: int
    slot: str
    context: object
    conn: multiprocessing.connection.Connection
    exitcode: int | None = None
    reason: str = ""            # the worker's own error message, or why run_shards stopped it
    killed_for: str = ""        # why run_shards signalled it, if it did
    kill_at: float | None = None

    @property
    def process(self):
        return self.context.processes[0]

    @property
    def explanation(self) -> str:
        return explain_exit(self.exitcode, self.killed_for if (self.exitcode or 0) < 0 else "")


class Supervisor:
    def __init__(self, run: RunDir, ranks: list[int], slots: list[str], gpu: bool, threads: int,
                 board: ProgressBoard, worker_timeout: float):
        self.run, self.pending, self.slots = run, list(ranks), list(slots)
        self.gpu, self.threads, self.board, self.worker_timeout = gpu, threads, board, worker_timeout
        self.active: list[ShardProcess] = []
        self.finished: list[ShardProcess] = []
        self.interrupted: str | None = None     # the signal that interrupted the run
        self.killed_at_once: list[int] = []     # shards killed by a second signal, before their checkpoint

    def _start(self, rank: int, slot: str) -> None:
        recv, send = multiprocessing.get_context("spawn").Pipe(duplex=False)
        # The worker inherits SIGINT ignored (Python keeps an inherited SIG_IGN) until it installs its own
        # handler, so a Ctrl-C while it imports torch cannot print a traceback on the terminal: the parent
        # handles Ctrl-C and asks its workers to stop.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            context = torch.multiprocessing.start_processes(
                worker_entry, args=(str(self.run.root), rank, send, slot if self.gpu else None, self.threads,
                                    os.getpid()),
                nprocs=1, join=False, daemon=False, start_method="spawn")
        finally:
            signal.signal(signal.SIGINT, previous)
        send.close()   # the child holds the only write end: EOF here means it is gone
        self.active.append(ShardProcess(rank, slot, context, recv))
        self.board.add_worker(rank, f"GPU {slot}" if self.gpu else "CPU")
        log.info("started shard %d on %s (pid %d)", rank, f"GPU {slot}" if self.gpu else "CPU",
                 context.processes[0].pid)

    def _fill_slots(self) -> None:
        busy = {p.slot for p in self.active}
        for slot in self.slots:
            if not self.pending or self.interrupted:
                break
            if slot not in busy:
                self._start(self.pending.pop(0), slot)

    def _interrupt(self, signum, frame) -> None:
        name = signal_name(signum)
        if self.interrupted:
            self.board.note(f"{name} again: killing the workers now, without their final checkpoint")
            for p in self.active:
                p.killed_for = f"a second stop signal ({name}): killed at once, without a final checkpoint"
                self.killed_at_once.append(p.rank)
                _kill(p.process.pid, signal.SIGKILL)
            return
        self.interrupted = name
        self.board.note(f"{name} received: workers are writing a final checkpoint and stopping "
                        "(press Ctrl-C again to kill them at once)", logging.WARNING)
        for p in self.active:
            p.killed_for = f"run_shards received {name} and asked it to stop"
            self._append_to_worker_log(p, "WARNING", f"run_shards received {name}: asking this worker (SIGTERM) "
                                                     "to write a final checkpoint and stop")
            _kill(p.process.pid, signal.SIGTERM)

    def wait(self) -> list[ShardProcess]:
        """Run every shard; returns them with exit codes (0 = finished)."""
        previous = {s: signal.signal(s, self._interrupt) for s in STOP_SIGNALS}
        self.started_at = time.time()
        try:
            self.slots = self.slots[:max(1, len(self.slots))]
            self._fill_slots()
            while self.active:
                self._pump(0.5)
                self._reap()
                self._watch_timeouts()
                self._fill_slots()
                self.board.maybe_summary()
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
        return sorted(self.finished, key=lambda p: p.rank)

    def _pump(self, timeout: float) -> None:
        conns = [p.conn for p in self.active if not p.conn.closed]
        if not conns:
            time.sleep(timeout)
            return
        for conn in multiprocessing.connection.wait(conns, timeout=timeout):
            p = next(p for p in self.active if p.conn is conn)
            while not conn.closed and conn.poll():
                try:
                    kind, rank, _, data = conn.recv()
                except (EOFError, OSError):
                    conn.close()
                    break
                except Exception as e:  # a half-written message from a killed worker
                    log.warning("unreadable message from shard %d (%s)", p.rank, e)
                    conn.close()
                    break
                self.board.message(kind, rank, data)
                if kind == "error":
                    p.reason = data.get("message", "")

    def _reap(self) -> None:
        for p in list(self.active):
            code = p.process.exitcode
            if code is None:
                continue
            p.process.join()
            self._pump_rest(p)
            p.exitcode = code
            p.conn.close()
            self.active.remove(p)
            self.finished.append(p)
            if code == 0:
                self.board.workers[p.rank].finished = self.board.workers[p.rank].finished or time.time()
                log.info("shard %d finished", p.rank)
            elif code == EXIT_INTERRUPTED:
                self.board.note(f"shard {p.rank} stopped at its final checkpoint", logging.WARNING)
            else:
                self.board.note(f"shard {p.rank} stopped: {p.explanation}"
                                + (f": {p.reason}" if p.reason else ""), logging.ERROR)
                if code < 0:   # killed: it could not say so itself, nor remove what it was writing
                    self._tell_worker_log(p)
                    RunLock.if_shard_free(self.run, p.rank, lambda: self.run.remove_shard_temporaries(p.rank))

    def _tell_worker_log(self, p: ShardProcess) -> None:
        """A worker that was killed cannot say so in its own log (or, killed while starting, wrote none):
        the parent appends how it ended, so `worker_N.log` always tells the whole story."""
        text = f"the worker (pid {p.process.pid}) ended: {p.explanation}"
        self._append_to_worker_log(p, "ERROR", text + (f" - {p.reason}" if p.reason and p.reason != p.killed_for
                                                       else ""))

    def _append_to_worker_log(self, p: ShardProcess, level: str, text: str) -> None:
        """One whole line (O_APPEND), so it never lands inside a line of the worker's own."""
        line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {level} run_shards (parent): {text}\n"
        try:
            with open(self.run.worker_log(p.rank), "a") as fh:
                fh.write(line)
        except OSError:
            pass   # a full disk: the terminal and run.log still say it

    def _pump_rest(self, p: ShardProcess) -> None:
        try:
            while not p.conn.closed and p.conn.poll():
                kind, rank, _, data = p.conn.recv()
                self.board.message(kind, rank, data)
                if kind == "error":
                    p.reason = data.get("message", "")
        except Exception:
            pass

    def _watch_timeouts(self) -> None:
        now = time.time()
        for p in self.active:
            quiet = now - self.board.workers[p.rank].last_event
            if p.kill_at is None and quiet > self.worker_timeout:
                p.reason = f"no progress for {quiet:.0f} s (--worker-timeout {self.worker_timeout:g}); killed as hung"
                p.killed_for = p.reason
                self.board.note(f"shard {p.rank}: {p.reason}", logging.ERROR)
                _kill(p.process.pid, signal.SIGTERM)
                p.kill_at = now + KILL_GRACE_SECONDS
            elif p.kill_at is not None and now > p.kill_at:
                _kill(p.process.pid, signal.SIGKILL)
                p.kill_at = float("inf")


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
