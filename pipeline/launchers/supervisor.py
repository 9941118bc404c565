"""Start shard workers with torch.multiprocessing.spawn and watch them until each has exited.

Each worker process has its own pipes (its messages, and its orders: which shard to compute). Workers are
symmetric and independent: one that dies, hangs or finishes early never blocks the others. At most one worker
runs per slot (a GPU, or a CPU worker slot); shards beyond the slots wait for one to free, and a worker that has
finished its shard is given the next one waiting (it keeps its process, its device and its model: only the
shard's files and log are new), while one that failed or was stopped leaves its slot to a fresh process. The
parent never touches CUDA.
"""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import time
import types
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing import resource_tracker

import torch.multiprocessing

from ..exits import EXIT_INTERRUPTED, EXIT_SHARD_BUSY, explain_exit, signal_name
from ..rundir import events
from ..rundir.layout import RunDir
from ..rundir.locks import ShardLock
from ..worker.entry import STOP_SIGNALS, worker_entry
from .progress import ProgressBoard
from .waiting_workers import Spawned, WaitingWorkers, stop

log = logging.getLogger("run_shards")

KILL_GRACE_SECONDS = 10.0


@dataclass
class ShardProcess:
    """A shard's attempt in a worker process (one process may compute several shards, one after another)."""
    rank: int
    slot: str
    context: object
    conn: multiprocessing.connection.Connection
    orders: multiprocessing.connection.Connection
    pid: int = 0
    exitcode: int | None = None
    ended: int | None = None     # the worker said the shard ended (exit code 0), and it waits for another
    reason: str = ""            # the worker's own error message, or why run_shards stopped it
    rerun_repeats: bool = False  # its message was a SettingsRefused: running it again stops the same way
    killed_for: str = ""        # why run_shards signalled it, if it did
    sent: set = field(default_factory=set)   # the signals run_shards sent it
    kill_at: float | None = None
    holder: dict = field(default_factory=dict)   # EXIT_SHARD_BUSY: who holds the shard's lock
    unlogged: bool = False      # it ended before writing its log (while starting)
    log_size: int = -1          # its log's size when it was started (-1: none yet; a rerun's holds earlier attempts')

    @property
    def process(self):
        return self.context.processes[0]

    @property
    def explanation(self) -> str:
        if self.unlogged and (self.exitcode or 0) > 0:   # ("see its log" would send the user to no file)
            return (f"exit code {self.exitcode} while starting, before it wrote its log: what it printed is in "
                    "run_shards' standard error (the terminal, or the job's output file)")
        return explain_exit(self.exitcode, self.signalled_for)

    @property
    def signalled_for(self) -> str:
        """Why run_shards sent the signal that ended the worker; "" where another signal ended it (a kill from
        outside, the kernel's out-of-memory killer) or none did."""
        return self.killed_for if (self.exitcode or 0) < 0 and -self.exitcode in self.sent else ""

    def send(self, sig: int) -> None:
        """Send the worker `sig`, recorded as run_shards' own."""
        self.sent.add(sig)
        _kill(self.pid, sig)

    @property
    def summary(self) -> str:
        """How it ended and why, the reason left out where the explanation already says it."""
        if not self.reason or self.reason in self.explanation:
            return self.explanation
        return f"{self.explanation} - {self.reason}"


@contextmanager
def signals_deferred(signals: tuple[int, ...]):
    """Hold these signals back (blocked, not ignored) for the block's duration: one that arrives meanwhile is
    delivered when it ends, instead of being lost. A process started inside inherits them blocked, and
    unblocks them once its own handlers are in place (worker/entry.py)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)


@contextmanager
def main_module_hidden():
    """Hide the program's `__main__` from processes spawned in the block. spawn otherwise runs the main
    script's top level again in each child before the child's own function: a script that calls
    `run_shards.run(...)` without an `if __name__ == "__main__":` guard (docs/python.md's examples, as
    written) would start a second run inside every worker, and whatever else the script does at its top level
    (writing files, removing a directory) would happen there again. A worker needs nothing from `__main__`:
    its function and arguments are run_shards' own."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")   # no __file__ and no __spec__: nothing to re-run
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def spawn_worker(run: RunDir, rank: int | None, slot: str, gpu: bool, threads: int) -> Spawned:
    """Start a worker process for shard `rank` on `slot` (a GPU id, or a CPU worker slot); with `rank` None, one
    that prepares itself and waits for its shard on its orders pipe. Either waits there for another shard once
    it has finished one."""
    context = multiprocessing.get_context("spawn")
    # Python's resource tracker, which a spawn starts on first use, unblocks SIGINT and SIGTERM in the spawning
    # thread once it is started: inside the block below, the first worker of a run was spawned with them open,
    # and a Ctrl-C while it imported torch killed it with SIGTERM, before it could checkpoint. Started here.
    resource_tracker.ensure_running()
    recv, send = context.Pipe(duplex=False)
    orders_recv, orders = context.Pipe(duplex=False)
    # The worker starts with the stop signals blocked, until it installs its own handlers, so a Ctrl-C
    # while it imports torch cannot print a traceback on the terminal; here, one that arrives while it
    # spawns reaches the parent's handler (after, or at once through another thread), never lost.
    with signals_deferred(STOP_SIGNALS), main_module_hidden():
        process = torch.multiprocessing.start_processes(
            worker_entry, args=(str(run.root), rank, send, slot if gpu else None, threads, os.getpid(), orders_recv),
            nprocs=1, join=False, daemon=False, start_method="spawn")
    send.close()   # the child holds the only write end: EOF here means it is gone
    orders_recv.close()
    return Spawned(process, recv, orders)


class Supervisor:
    def __init__(self, run: RunDir, ranks: list[int], slots: list[str], gpu: bool, threads: int,
                 board: ProgressBoard, worker_timeout: float, early=None):
        self.run, self.pending, self.slots = run, list(ranks), list(slots)
        self.gpu, self.threads, self.board, self.worker_timeout = gpu, threads, board, worker_timeout
        self.early = early   # WaitingWorkers started while the parent planned (early_workers.py), by slot
        self.idle = WaitingWorkers()   # processes that finished a shard, by slot, while shards wait to start
        self.started_at = time.monotonic()
        self.active: list[ShardProcess] = []
        self.finished: list[ShardProcess] = []
        self.interrupted: str | None = None     # the signal that interrupted the run
        self.killed_at_once: list[int] = []     # shards killed by a second signal, before their checkpoint

    def _start(self, rank: int, slot: str) -> None:
        log_size = _size(self.run.worker_log(rank))
        spawned, how = self.idle.take(slot, rank), ", the worker that finished the slot's last shard"
        if spawned is None and self.early is not None:
            spawned, how = self.early.take(slot, rank), ", a worker started while planning"
        if spawned is None:
            spawned, how = spawn_worker(self.run, rank, slot, self.gpu, self.threads), ""
        pid = spawned.process.pid
        self.active.append(ShardProcess(rank, slot, spawned.context, spawned.conn, spawned.orders, pid,
                                        log_size=log_size))
        if self.interrupted:   # a stop signal came while it spawned: it stops too
            self.active[-1].killed_for = f"run_shards received {self.interrupted} and asked it to stop"
            self.active[-1].send(signal.SIGTERM)
        self.board.add_worker(rank, f"GPU {slot}" if self.gpu else "CPU")
        log.info("started shard %d on %s (pid %d%s)", rank, f"GPU {slot}" if self.gpu else "CPU", pid, how)

    def _fill_slots(self) -> None:
        busy = {p.slot for p in self.active}
        for slot in self.slots:
            if not self.pending or self.interrupted:
                break
            if slot not in busy:
                self._start(self.pending.pop(0), slot)
        if not self.pending or self.interrupted:   # no shard for the processes waiting: their memory back now
            self.idle.close()

    def _interrupt(self, signum, frame) -> None:
        name = signal_name(signum)
        if self.interrupted and signum == signal.SIGINT:   # a person pressing Ctrl-C again
            self.board.note(f"{name} again: killing the workers now, without their final checkpoint")
            for p in self._computing():
                p.killed_for = f"a second stop signal ({name}): killed at once, without a final checkpoint"
                self.killed_at_once.append(p.rank)
                p.send(signal.SIGKILL)
            return
        if self.interrupted:   # schedulers repeat SIGTERM (to the batch script and to every process of the job)
            log.info("%s again: the workers are already writing their final checkpoints", name)
            return
        self.interrupted = name
        again = " (press Ctrl-C again to kill them at once)" if sys.stdin is not None and sys.stdin.isatty() else ""
        self.board.note(f"{name} received: workers are writing a final checkpoint and stopping{again}",
                        logging.WARNING)
        for p in self._computing():
            p.killed_for = f"run_shards received {name} and asked it to stop"
            events.append(self.run.events_path(p.rank), "stop", signal=name, by="parent")
            self._append_to_worker_log(p, "WARNING", f"run_shards received {name}: asking this worker (SIGTERM) "
                                                     "to write a final checkpoint and stop")
            p.send(signal.SIGTERM)

    def _computing(self) -> list[ShardProcess]:
        """The shards being computed (not those whose worker has said it ended them, not yet reaped)."""
        return [p for p in self.active if p.ended is None]

    def wait(self) -> list[ShardProcess]:
        """Run every shard; returns them with exit codes (0 = finished)."""
        # (a signal the command was started with ignored stays ignored: SIGINT of a job a script runs in the
        # background, `run_shards ... &`, which the command ignored while planning too)
        previous = {s: signal.signal(s, self._interrupt) for s in STOP_SIGNALS
                    if signal.getsignal(s) is not signal.SIG_IGN}
        self.started_at = time.monotonic()
        try:
            self.slots = self.slots[:max(1, len(self.slots))]
            self._fill_slots()
            if self.early is not None:   # every slot that will compute has its worker now
                self.early.close()
            while self.active:
                self._pump(0.5)
                self._reap()
                self._watch_timeouts()
                self._fill_slots()
                self.board.maybe_summary()
        finally:
            self.idle.close()
            for s, h in previous.items():
                signal.signal(s, h)
        return sorted(self.finished, key=lambda p: p.rank)

    def _pump(self, timeout: float) -> None:
        """Wait up to `timeout` for a worker's message or its exit (its process sentinel), so the loop notices a
        worker that ended at once, not at the next timeout: a closed pipe alone left it sleeping."""
        conns = [p.conn for p in self.active if not p.conn.closed]
        exits = {p.process.sentinel: p for p in self.active}
        for ready in multiprocessing.connection.wait(conns + list(exits), timeout=timeout):
            if ready in exits:
                exits[ready].process.join(1.0)   # it has exited: returns as soon as it is reaped
            else:
                self._drain(next(p for p in self.active if p.conn is ready))

    def _drain(self, p: ShardProcess) -> None:
        """Every message the worker has sent: progress for the board, its error or its lock's holder here."""
        while not p.conn.closed and p.conn.poll():
            try:
                kind, rank, _, data = p.conn.recv()
            except (EOFError, OSError):
                p.conn.close()
                return
            except Exception as e:  # a half-written message from a killed worker
                log.warning("unreadable message from shard %d (%s)", p.rank, e)
                p.conn.close()
                return
            if kind == "busy":
                p.holder = data.get("holder") or {}
                continue
            if kind == "ended":   # its last message for this shard: the process now waits for another
                p.ended = data["code"]
                return
            self.board.message(kind, rank, data)
            if kind == "error":
                p.reason = data.get("message", "")
                p.rerun_repeats = bool(data.get("rerun_repeats"))

    def _reap(self) -> None:
        for p in list(self.active):
            if p.ended is None and p.process.exitcode is not None:
                p.process.join()
                self._drain(p)   # its last messages say why it ended (or that it ended its shard first)
            if p.ended is not None:   # the shard ended, the process waits for another on its slot
                code = p.exitcode = p.ended
                if p.killed_for:   # (signalled as it finished: it would stop its next shard at once)
                    stop(Spawned(p.context, p.conn, p.orders))
                else:
                    self.idle.put(p.slot, Spawned(p.context, p.conn, p.orders))
            elif p.process.exitcode is not None:
                code = p.exitcode = p.process.exitcode
                # Its two spawn pipes stay open until the process object is closed: kept open, a run of many
                # shards ran out of file descriptors after about (limit - 20) / 2 of them (`ulimit -n`).
                stop(Spawned(p.context, p.conn, p.orders))
            else:
                continue
            self.active.remove(p)
            self.finished.append(p)
            if code == 0:
                self.board.workers[p.rank].finished = self.board.workers[p.rank].finished or time.monotonic()
                log.info("shard %d finished", p.rank)
            elif code == EXIT_SHARD_BUSY:   # not an attempt: another process computes the shard
                self.board.workers.pop(p.rank, None)
                self.board.expected.pop(p.rank, None)
            elif code == EXIT_INTERRUPTED:
                self.board.note(f"shard {p.rank} stopped at its final checkpoint", logging.WARNING)
            else:
                lost = self.board.lost(p.rank)
                # A C library that exits the process while the worker starts (libgomp, when `ulimit -u` leaves
                # it no thread) leaves no log, or (a rerun) only the earlier attempts' lines: the parent adds
                # how the worker ended.
                p.unlogged = (code > 0 and _size(self.run.worker_log(p.rank)) == p.log_size
                              and not self.run.gone())   # (its log moved away with the run directory)
                self.board.note(f"shard {p.rank} stopped: {p.summary}"
                                + (f"; the {lost:,} sequences it computed after its last checkpoint were lost "
                                   "with it (a rerun computes them again)" if lost else ""), logging.ERROR)
                if p.unlogged:
                    self._tell_worker_log(p)
                if code < 0:   # killed: it could not say so itself, nor remove what it was writing
                    self._tell_worker_log(p)
                    ShardLock(self.run, p.rank).if_free(lambda: self.run.remove_shard_temporaries(p.rank))

    def _tell_worker_log(self, p: ShardProcess) -> None:
        """A worker that was killed cannot say so in its own log and events (or, killed while starting, wrote
        none): the parent appends how it ended, so `worker_N.log` and `events_N.jsonl` tell the whole story."""
        self._append_to_worker_log(p, "ERROR", f"the worker (pid {p.pid}) ended: {p.summary}")
        events.append(self.run.events_path(p.rank), "end", code=p.exitcode, explanation=p.explanation,
                      reason=p.reason, by="parent", pid=p.pid)

    def _append_to_worker_log(self, p: ShardProcess, level: str, text: str) -> None:
        """One whole line (O_APPEND), so it never lands inside a line of the worker's own."""
        line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {level} run_shards (parent): {text}\n"
        try:
            with open(self.run.worker_log(p.rank), "a") as fh:
                fh.write(line)
        except OSError as e:
            log.warning("could not write to %s (%s); the terminal and run.log say it", self.run.worker_log(p.rank),
                        e.strerror or e)

    def _watch_timeouts(self) -> None:
        """Kill a worker that has sent nothing for --worker-timeout seconds, or, within a batch, for that long
        per budget's worth of the batch's tokens (a long sequence computed in chunks is slow, not hung)."""
        now = time.monotonic()
        for p in self.active:
            stats = self.board.workers[p.rank]
            quiet = now - stats.last_event
            allowed = self.worker_timeout * max(1.0, stats.batch_tokens / max(1, stats.batch_budget))
            if p.kill_at is None and quiet > allowed:
                p.reason = f"no progress for {quiet:.0f} s (--worker-timeout {self.worker_timeout:g}"
                p.reason += f", {allowed:.0f} s for this batch); killed as hung" if allowed > self.worker_timeout \
                    else "); killed as hung"
                p.killed_for = p.reason
                self.board.note(f"shard {p.rank}: {p.reason}", logging.ERROR)
                p.send(signal.SIGTERM)
                p.kill_at = now + KILL_GRACE_SECONDS
            elif p.kill_at is not None and now > p.kill_at:
                p.send(signal.SIGKILL)
                p.kill_at = float("inf")


def _size(path) -> int:
    """A file's size, -1 when there is none."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return -1


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
