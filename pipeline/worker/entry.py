"""A worker process: shards of a run on one device, one at a time, from the run directory alone.

Started by `torch.multiprocessing.spawn`; it pins itself to its GPU with CUDA_VISIBLE_DEVICES before
anything touches CUDA (CPU workers hide every GPU), logs to its own `worker_N.log`, reports progress to
the parent over its own pipe, and stops cleanly (final checkpoint, exit code 75) on SIGTERM / SIGINT /
SIGHUP / SIGUSR1 or when the parent goes away. It takes the shard's lock before it writes anything, so a
second process for the same shard steps aside (exit code 3) without touching its log, record or events.
A local run starts its workers while it plans (launchers/early_workers.py): such a worker prepares what
every worker needs, then waits for the number of its shard. A worker that has finished its shard waits in
the same way for the next (launchers/supervisor.py), its model kept; one that did not finish it exits with the
shard's code. The shard itself is computed by shard_run.ShardRun.
"""
from __future__ import annotations

import gc
import logging
import logging.handlers
import os
import signal
import sys
import time

from index import FastaError

from ..errors import RunDirError, SettingsRefused, UserError
from ..models.transformers_imports import keep_import_structure
from ..exits import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, EXIT_SHARD_BUSY, EXIT_USER_ERROR, explain_exit
from ..output import heap
from ..rundir import events
from ..rundir.layout import RunDir
from ..rundir.locks import ShardLock
from .parent_death import on_parent_death
from .process_setup import say_again, set_up
from .shard_run import PARENT_GONE, Reporter, ShardRun, StopFlag

# The signals that ask a worker to stop at its next batch with a final checkpoint (SIGUSR1: the SLURM batch
# script's warning before the time limit, forwarded by `work`); the parent spawns workers with them blocked.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)

log = logging.getLogger("run_shards.worker")


def worker_entry(_process: int, root: str, rank: int | None, conn, device: str | None, threads: int, parent: int,
                 orders) -> None:
    """Entry point for torch.multiprocessing.spawn (one process, `_process` 0): compute shard `rank` of the
    run in `root` on GPU `device` (None: CPU); `parent` is the pid of the process that started it, which
    the worker watches. With `rank` None the worker was started while the parent plans: it prepares what
    every worker needs, then computes the shard `orders` names (or exits, unused, at the pipe's end). Having
    finished a shard, it says so ("ended") and waits on `orders` for the next, with its model kept
    (launchers/supervisor.py); a shard that did not finish ends the process, with the shard's exit code."""
    os.environ["CUDA_VISIBLE_DEVICES"] = device if device is not None else ""   # before anything touches CUDA
    keep_import_structure()   # before transformers is imported: 1.5-3 CPU s less at each worker's start
    run = RunDir(root)
    # Nothing is written for a shard before its lock is held; what is logged until then (a stop signal that came
    # while it spawned, held back until here) goes to the shard's log then, never to the user's terminal.
    held, waited = _hold_logs(), ""
    stop = StopFlag()
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda s, f: stop.set(f"received {signal.Signals(s).name}"))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)   # held back by the parent while it spawned this
    # torch's spawn asks for SIGINT on the parent's death, which reads like a Ctrl-C and arrives while the
    # parent's other threads still hold its pid; SIGUSR2 says only this (the batch loop also checks getppid).
    signal.signal(signal.SIGUSR2, lambda s, f: stop.set(PARENT_GONE))
    if not on_parent_death(parent, signal.SIGUSR2):
        stop.set(PARENT_GONE)
    if rank is None:
        began = time.monotonic()
        try:
            prepare_worker(device is not None)
        except Exception as e:   # noqa: BLE001 - the shard's own load meets it again and reports it in the shard's log
            log.warning("preparing before the shard was known failed (%s: %s)", type(e).__name__, e)
        rank = _wait_for_shard(orders, parent, lambda order: _load_ahead(order, run, device is not None, threads))
        if rank is None:   # the parent needs no worker here, or is gone
            os._exit(EXIT_OK)
        waited = f"; started {time.monotonic() - began:.1f} s before its shard was known, while the run was planned"
    previous = None   # the shard this process computed before (its setup and model are that shard's)
    while True:
        if previous is not None:
            waited = f"; the process that computed shard {previous}, its model kept"
        code = _compute_shard(run, rank, conn, device, threads, parent, stop, held, waited, first=previous is None)
        if code != EXIT_OK or stop:
            break
        _give_back_memory(device is not None)
        Reporter(conn, rank, stop).send("ended", code=code)
        held = _hold_logs()   # (what is logged while it waits goes to its next shard's log)
        following = _wait_for_shard(orders, parent)
        if following is None:   # no shard left for it, or the parent is gone
            break
        previous, rank = rank, following
    # Leave without interpreter teardown: everything is durable or reported by now, and after a failed
    # write HDF5's exit-time cleanup can crash, which would turn a clear exit code into a segfault.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _compute_shard(run: RunDir, rank: int, conn, device: str | None, threads: int, parent: int, stop: StopFlag,
                   held: logging.handlers.MemoryHandler | None, waited: str, first: bool) -> int:
    """Shard `rank`, from its lock to its outcome recorded and its lock released; its exit code. `held`: the
    log records kept while the process waited for it; `waited`: how it came to this process (the log's first
    line); `first`: the process's first shard."""
    reporter = Reporter(conn, rank, stop)
    lock = _lock_or_leave(run, rank, reporter, stop)
    _setup_logging(run.worker_log(rank), held)   # only the lock's holder writes the shard's log
    where = f"GPU {device}" if device is not None else "CPU"
    log.info("worker for shard %d started (pid %d, %s, %d threads%s)", rank, os.getpid(), where, threads, waited)
    if not first:
        say_again()
    run.clear_failure(rank)   # this attempt's outcome replaces the last one's (the events keep them all)
    shard = ShardRun(run, rank, reporter, stop, threads, parent, lock, where)
    code, message, refused = EXIT_ERROR, "", False
    try:
        try:
            code = shard.run()
        except (UserError, FastaError) as e:
            log.error("%s", e)
            code, message, refused = EXIT_USER_ERROR, str(e), isinstance(e, SettingsRefused)
            reporter.send("error", message=message, rerun_repeats=refused)
    except Exception as e:
        log.exception("worker failed")
        code, message = EXIT_ERROR, f"{type(e).__name__}: {e}"
        reporter.send("error", message=message)
    finally:
        if code == EXIT_OK and not stop:
            shard.keep_model()
            log.info("worker for shard %d ends with code 0; its process may be given another shard of the run", rank)
        else:
            log.info("worker for shard %d exits with code %d", rank, code)
        _record_outcome(run, rank, code, message or (stop.reason or ""), shard.stats, refused)
        logging.shutdown()
        lock.release()
    return code


def _give_back_memory(gpu: bool) -> None:
    """What the finished shard held (its engine's caches, its buffers), given back before the next shard sizes
    its caches against the free memory: its objects collected, and the memory they held handed back, on a CPU
    the heap's free blocks (malloc keeps them: cpu_setup.keep_freed_memory), on a GPU torch's cached blocks
    (free memory as CUDA reports it counts them as used)."""
    gc.collect()
    if gpu:
        import torch
        torch.cuda.empty_cache()
    else:
        heap.trim()


def _lock_or_leave(run: RunDir, rank: int, reporter: Reporter, stop: StopFlag) -> ShardLock:
    """The shard's lock, taken before anything is written for the shard; a process that cannot have it exits
    at once, writing nothing: EXIT_SHARD_BUSY when another process computes the shard (the parent says who),
    EXIT_USER_ERROR when the run directory cannot be written here."""
    lock = ShardLock(run, rank)
    try:
        holder = lock.acquire(stop=lambda: bool(stop))
    except RunDirError as e:
        reporter.send("error", message=str(e))
        os._exit(EXIT_USER_ERROR)
    if holder is not None:
        reporter.send("busy", holder=holder)
        os._exit(EXIT_INTERRUPTED if stop else EXIT_SHARD_BUSY)
    return lock


def _record_outcome(run: RunDir, rank: int, code: int, reason: str, stats: dict, rerun_repeats: bool) -> None:
    """How this attempt ended, as the shard's `end` event; and, when it did not finish, why, in
    `shard_N.failed.json` for `status` (the parent, when there is one, adds what only it saw, such as a
    kill). Not fatal when the disk is full."""
    events.append(run.events_path(rank), "end", code=code, explanation=explain_exit(code), reason=reason,
                  by="worker", **stats)
    if code == EXIT_OK:
        run.clear_failure(rank)
    else:
        run.record_failure(rank, run.new_failure(rank, code, reason, rerun_repeats=rerun_repeats))


def _wait_for_shard(orders, parent: int, load_ahead=None) -> int | None:
    """The number of the shard `orders` gives this process; None when the pipe ends without one (the parent
    needs no worker here) or the parent is gone. A ("load", order) meanwhile (the run's model, as soon as the
    parent has chosen it: only to a worker started while the run is planned) is handed to `load_ahead`. Stop
    signals meanwhile are only recorded: the parent that sent them stops this process itself if it gives it
    no shard."""
    while True:
        try:
            if orders.poll(0.5):
                kind, what = orders.recv()
                if kind == "load" and load_ahead is not None:
                    load_ahead(what)
                    continue
                assert kind == "shard", kind
                return what
        except (EOFError, OSError):
            return None
        if os.getppid() != parent:
            return None


def _load_ahead(order: dict, run: RunDir, gpu: bool, threads: int) -> None:
    """Set this process up for the run and load its model before the shard is known (models/preload.py), as
    the parent's `order` says (waiting_workers.WaitingWorkers.load_ahead). A failure is only logged: the shard's
    own load meets it again and reports it in the shard's log."""
    import torch

    from ..engine import selection as engines
    try:
        set_up(gpu, order["batch_invariant"], run.root, threads)
        engines.load_ahead(order["engine"], order["path"], order["fingerprint"],
                           torch.device("cuda:0" if gpu else "cpu"), getattr(torch, order["dtype"]),
                           order["logprobs"], order["trust_remote_code"])
    except Exception as e:   # noqa: BLE001
        log.warning("loading the model before the shard was known failed (%s: %s)", type(e).__name__, e)


def prepare_worker(gpu: bool) -> None:
    """What every worker does before it can load a model, whatever its shard: import transformers (its
    configs and tokenizers) and the engines, and on a GPU create the CUDA context. Nothing here computes on
    the CPU: a batch-invariant run's MKL mode and the threads are set later, before the first op."""
    from ..engine import hf, native   # noqa: F401 - imported for what they import
    from ..models.hf_config import quiet_transformers
    if not gpu:   # as the hf engine does on a CPU, before transformers could import fla-core (engine/hf.py)
        hf.keep_transformers_torch_kernels()
    quiet_transformers()
    import transformers.models.auto.configuration_auto   # noqa: F401 - AutoConfig, resolved lazily otherwise
    import transformers.models.auto.tokenization_auto   # noqa: F401
    if gpu:
        # What ESM's and Llama's configs import first (transformers' activations, and through them
        # torch.distributed.tensor: 1.4 CPU s). A GPU worker has cores to spare while the parent plans; a CPU worker
        # does not (the parent plans on the same cores), and the families whose configs do not need it (Qwen3.5,
        # the demo model, T5, Qwen3) would pay it for nothing: it imports them when its model's load asks.
        import transformers.activations   # noqa: F401
        import torch
        torch.zeros(1, device="cuda")
        import triton_kernels   # a CPU worker never imports them (nor triton): each op does when a kernel runs
        try:
            triton_kernels.import_kernels()
        except ModuleNotFoundError as e:   # no triton: the hf engine runs; the native load says what to install
            if (e.name or "").split(".")[0] != "triton":
                raise


def _hold_logs() -> logging.handlers.MemoryHandler:
    """Log records (and Python warnings) kept in memory until the worker knows its shard and holds its lock,
    then written to its log (`_setup_logging`)."""
    held = logging.handlers.MemoryHandler(capacity=1 << 20, flushLevel=logging.CRITICAL + 1)
    root = logging.getLogger()
    root.handlers[:] = [held]
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)
    return held


def _setup_logging(path, held: logging.handlers.MemoryHandler | None = None) -> None:
    """Everything the worker prints goes to its own log: Python logging, and (through file descriptor 2)
    what native libraries such as HDF5 write to stderr, so the user's terminal shows only the parent.
    `held`: records kept while the worker waited for its shard, written first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    sys.stderr.flush()
    os.dup2(fd, 2)
    os.close(fd)
    handler = logging.FileHandler(path, mode="a")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)
    if held is not None:
        held.setTarget(handler)
        held.close()   # flushes what it held into the log
    # After a failed write (disk full), h5py objects can fail again while being freed; that is already
    # reported, so such late errors get one log line instead of a traceback in the log's tail.
    sys.unraisablehook = lambda u: log.warning("ignored during cleanup: %s: %s", type(u.exc_value).__name__,
                                               str(u.exc_value).splitlines()[0] if str(u.exc_value) else "")
