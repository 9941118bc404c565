"""Every exit code run_shards gives, in one table, and how the parent, `status` and the launchers put one
into words.

A worker process (one shard, started by the local launcher) and a command (`run`, `rerun`, `merge`, `work`,
as a shell, SLURM or Ray sees it) have codes of their own; they never overlap, so one function words both.
"""
from __future__ import annotations

import signal

# A worker process (pipeline/worker/entry.py).
EXIT_OK = 0
EXIT_ERROR = 1            # it raised an error (the traceback is in its log)
EXIT_USER_ERROR = 2       # it stopped with a clear message (bad input, a damaged model): a retry stops the same way
EXIT_SHARD_BUSY = 3       # another process holds the shard's lock: it stepped aside, computing nothing
EXIT_INTERRUPTED = 75     # a stop signal: it wrote a final checkpoint (sysexits' EX_TEMPFAIL: try again later)

# A command (pipeline/cli.py). `work` exits EXIT_OK when its shards are complete or another task computes them.
EXIT_COMMAND_FAILED = 1           # shards did not finish (RunFailed), or the merge found a problem
EXIT_COMMAND_USER_ERROR = 2       # one clear message, no traceback (UserError)
EXIT_CLI_INTERRUPTED = 130        # a stop signal (128 + SIGINT); everything checkpointed is kept


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def explain_exit(code: int | None, killed_for: str = "") -> str:
    """Words for a worker's or a command's exit code; `killed_for` is why run_shards itself signalled it."""
    if code is None:
        return "still running"
    if code == EXIT_OK:
        return "finished"
    if code == EXIT_ERROR:
        return "exit code 1 (it raised an error; see its log)"
    if code == EXIT_USER_ERROR:
        return "exit code 2 (stopped with an error message)"
    if code == EXIT_SHARD_BUSY:
        return f"exit code {EXIT_SHARD_BUSY} (another process computes this shard; it stepped aside)"
    if code in (EXIT_INTERRUPTED, EXIT_CLI_INTERRUPTED):
        return f"exit code {code} (interrupted; it wrote a final checkpoint)"
    if code < 0:
        name = signal_name(-code)
        if killed_for:
            return f"killed by {name} from run_shards ({killed_for})"
        if name == "SIGKILL":
            return "killed by SIGKILL (not by run_shards: the kernel's out-of-memory killer, see `dmesg`, or by hand)"
        return f"killed by {name} (not by run_shards)"
    return f"exit code {code}"


def leave_without_teardown(code: int) -> None:
    """End a finished command with `code` the way the interpreter would (threads done, exit handlers run:
    logging flushed, multiprocessing's children joined, temporary files removed; stdout and stderr flushed),
    minus its teardown, which frees every module and object one by one: about 0.3 s after torch and
    transformers were imported, for nothing. Returns, leaving it to the interpreter, where that could differ:
    another non-daemon thread still running, a profiler or tracer attached (`python -m cProfile` writes its
    report after the script), or an output that cannot be flushed (a closed pipe)."""
    import atexit
    import os
    import sys
    import threading

    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        return
    if sys.getprofile() is not None or sys.gettrace() is not None or sys.flags.inspect:
        return
    atexit._run_exitfuncs()   # (also what multiprocessing's children run before they leave)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        return
    os._exit(code)
