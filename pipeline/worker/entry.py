"""A worker process: one shard on one device, from the run directory alone.

Started by `torch.multiprocessing.spawn`; it pins itself to its GPU with CUDA_VISIBLE_DEVICES before
anything touches CUDA (CPU workers hide every GPU), logs to its own `worker_N.log`, reports progress to
the parent over its own pipe, and stops cleanly (final checkpoint, exit code 75) on SIGTERM / SIGINT /
SIGHUP or when the parent goes away. The shard itself is computed by shard_run.ShardRun.
"""
from __future__ import annotations

import logging
import os
import signal
import sys

from index import FastaError

from ..errors import UserError
from ..exits import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, EXIT_USER_ERROR, explain_exit
from ..rundir.layout import RunDir
from .shard_run import PARENT_GONE, Reporter, ShardRun, StopFlag

log = logging.getLogger("run_shards.worker")


def worker_entry(_process: int, root: str, rank: int, conn, device: str | None, threads: int, parent: int) -> None:
    """Entry point for torch.multiprocessing.spawn (one process, `_process` 0): compute shard `rank` of the
    run in `root` on GPU `device` (None: CPU); `parent` is the pid of the process that started it, which
    the worker watches."""
    os.environ["CUDA_VISIBLE_DEVICES"] = device if device is not None else ""   # before anything touches CUDA
    run = RunDir(root)
    _setup_logging(run.worker_log(rank))
    stop = StopFlag()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, f: stop.set(f"received {signal.Signals(s).name}"))
    _on_parent_death(parent, lambda: stop.set(PARENT_GONE))
    reporter = Reporter(conn, rank, stop)
    log.info("worker for shard %d started (pid %d, %s, %d threads)", rank, os.getpid(),
             f"GPU {device}" if device is not None else "CPU", threads)
    code, message = EXIT_ERROR, ""
    try:
        try:
            code = ShardRun(run, rank, reporter, stop, threads, parent).run()
        except (UserError, FastaError) as e:
            log.error("%s", e)
            code, message = EXIT_USER_ERROR, str(e)
            reporter.send("error", message=message)
    except Exception as e:
        log.exception("worker failed")
        code, message = EXIT_ERROR, f"{type(e).__name__}: {e}"
        reporter.send("error", message=message)
    finally:
        log.info("worker for shard %d exits with code %d", rank, code)
        if code != EXIT_OK:
            _record_outcome(run, rank, code, message or (stop.reason or ""))
        logging.shutdown()
    # Leave without interpreter teardown: everything is durable or reported by now, and after a failed
    # write HDF5's exit-time cleanup can crash, which would turn a clear exit code into a segfault.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _on_parent_death(parent: int, stop) -> None:
    """Call `stop` when the parent dies. torch's spawn asks the kernel for SIGINT then (PR_SET_PDEATHSIG),
    which reads like a Ctrl-C, and arrives while the parent's other threads still hold its pid; SIGUSR2 says
    only this. The batch loop also compares getppid() with `parent`, for a death before this point."""
    import ctypes
    signal.signal(signal.SIGUSR2, lambda s, f: stop())
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGUSR2))   # PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        stop()


def _record_outcome(run, rank: int, code: int, reason: str) -> None:
    """Why this shard did not finish, in `shard_N.failed.json`, for `status` (the parent, when there is one,
    adds what only it saw, such as a kill). Not fatal when the disk is full."""
    run.record_failure(rank, {"exit_code": code, "explanation": explain_exit(code), "reason": reason,
                              "interrupted": code == EXIT_INTERRUPTED, "log": str(run.worker_log(rank)),
                              "log_tail": run.log_tail(rank)})


def _setup_logging(path) -> None:
    """Everything the worker prints goes to its own log: Python logging, and (through file descriptor 2)
    what native libraries such as HDF5 write to stderr, so the user's terminal shows only the parent."""
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
    # After a failed write (disk full), h5py objects can fail again while being freed; that is already
    # reported, so such late errors get one log line instead of a traceback in the log's tail.
    sys.unraisablehook = lambda u: log.warning("ignored during cleanup: %s: %s", type(u.exc_value).__name__,
                                               str(u.exc_value).splitlines()[0] if str(u.exc_value) else "")
