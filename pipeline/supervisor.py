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

from .progress import ProgressBoard
from .run_dir import RunDir
from .worker import EXIT_INTERRUPTED, worker_entry

log = logging.getLogger("run_shards")

KILL_GRACE_SECONDS = 10.0


@dataclass
class ShardProcess:
    rank: int
    slot: str
    context: object
    conn: multiprocessing.connection.Connection
    exitcode: int | None = None
    reason: str = ""
    kill_at: float | None = None

    @property
    def process(self):
        return self.context.processes[0]


def explain_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code == 0:
        return "finished"
    if code == 1:
        return "exit code 1 (the worker raised an error; see its log)"
    if code == 2:
        return "exit code 2 (stopped with an error message)"
    if code == EXIT_INTERRUPTED:
        return f"exit code {EXIT_INTERRUPTED} (interrupted; its checkpoints are kept)"
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        extra = " (out of host memory, or killed by hand)" if name == "SIGKILL" else ""
        return f"killed by {name}{extra}"
    return f"exit code {code}"


class Supervisor:
    def __init__(self, run: RunDir, ranks: list[int], slots: list[str], gpu: bool, threads: int,
                 board: ProgressBoard, worker_timeout: float):
        self.run, self.pending, self.slots = run, list(ranks), list(slots)
        self.gpu, self.threads, self.board, self.worker_timeout = gpu, threads, board, worker_timeout
        self.active: list[ShardProcess] = []
        self.finished: list[ShardProcess] = []
        self.interrupted: str | None = None

    def _start(self, rank: int, slot: str) -> None:
        recv, send = multiprocessing.get_context("spawn").Pipe(duplex=False)
        context = torch.multiprocessing.start_processes(
            worker_entry, args=(str(self.run.root), [rank], [send], [slot] if self.gpu else [], self.threads),
            nprocs=1, join=False, daemon=False, start_method="spawn")
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
        name = signal.Signals(signum).name
        if self.interrupted:
            self.board.note(f"{name} again: killing the workers now")
            for p in self.active:
                _kill(p.process.pid, signal.SIGKILL)
            return
        self.interrupted = name
        self.board.note(f"{name} received: workers are writing a final checkpoint and stopping "
                        "(press Ctrl-C again to kill them at once)", logging.WARNING)
        for p in self.active:
            _kill(p.process.pid, signal.SIGTERM)

    def wait(self) -> list[ShardProcess]:
        """Run every shard; returns them with exit codes (0 = finished)."""
        previous = {s: signal.signal(s, self._interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
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
            else:
                self.board.note(f"shard {p.rank} stopped: {explain_exit(code)}"
                                + (f": {p.reason}" if p.reason else ""), logging.ERROR)

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
