"""A worker's exit codes, and how the parent and `status` put one into words."""
from __future__ import annotations

import signal

EXIT_OK, EXIT_ERROR, EXIT_USER_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 75


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def explain_exit(code: int | None, killed_for: str = "") -> str:
    """Words for a worker's exit code; `killed_for` is why run_shards itself signalled it, if it did."""
    if code is None:
        return "still running"
    if code == EXIT_OK:
        return "finished"
    if code == EXIT_ERROR:
        return "exit code 1 (the worker raised an error; see its log)"
    if code == EXIT_USER_ERROR:
        return "exit code 2 (stopped with an error message)"
    if code == EXIT_INTERRUPTED:
        return f"exit code {EXIT_INTERRUPTED} (interrupted; it wrote a final checkpoint)"
    if code < 0:
        name = signal_name(-code)
        if killed_for:
            return f"killed by {name} from run_shards ({killed_for})"
        if name == "SIGKILL":
            return "killed by SIGKILL (not by run_shards: the kernel's out-of-memory killer, see `dmesg`, or by hand)"
        return f"killed by {name} (not by run_shards)"
    return f"exit code {code}"
