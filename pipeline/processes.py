"""Whether a process on this host still runs: the one check behind every leftover that names its owner's pid
(the run lock's holder record, the demo model's half-written builds); and when this command began, which a run's
time split counts from."""
from __future__ import annotations

import os
import time

_command_began: float | None = None   # (time.monotonic() of a `run_shards` process's start: mark_command_start)


def process_alive(pid: int, start: str | None = None) -> bool:
    """True while a process with this pid exists on this host (one we may not signal counts as alive).

    A zombie (killed, not yet reaped by a parent that never will: a container's init, a script that does not
    wait) is gone. With `start` (the owner's process_start(), as a lock record keeps it), a process whose own
    start differs only reuses the pid of one that died: after a reboot, or pids wrapped around. (The start is
    the boot's id and the clock ticks since boot, not a time of day: a clock set forward, or a VM resumed, does
    not make a live owner look newer than its record.)"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    state, started = _state_and_start(pid)
    if state in ("Z", "X"):
        return False
    return start is None or started is None or started == start


def process_stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP, Ctrl-Z, a debugger): alive, but computing nothing until continued."""
    return _state_and_start(pid)[0] in ("T", "t")


def process_start(pid: int | None = None) -> str | None:
    """`BOOT_ID:TICKS`, what tells this process (or `pid`) from a later one with the same pid, on Linux (/proc);
    None elsewhere."""
    return _state_and_start(os.getpid() if pid is None else pid)[1]


def mark_command_start() -> None:
    """Count this command from its process's start (the `run_shards` script's entry, once): Python's start and
    the imports before the first log line (torch's among them, seconds on a GPU machine) belong to the command's
    time. Where /proc cannot tell the start, from now."""
    global _command_began
    age = process_age()
    _command_began = time.monotonic() - (age or 0.0)


def command_began() -> float:
    """When this command began, in time.monotonic(): its process's start, as marked by the script (once: a
    second command in the same process counts from its own call), else now (a Python API call)."""
    global _command_began
    began, _command_began = _command_began, None
    return time.monotonic() if began is None else min(began, time.monotonic())


def process_age() -> float | None:
    """Seconds since this process started (an exec keeps its start: bin/run_shards' switch to the checkout's
    .venv is counted), from /proc's clock ticks since boot; None where they cannot be read."""
    try:
        with open("/proc/self/stat", "rb") as f:
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return age if 0.0 <= age < 86400.0 else None   # (a clock read oddly: not trusted)


def _state_and_start(pid: int) -> tuple[str | None, str | None]:
    """The process's state letter and process_start, from /proc; (None, None) where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()   # (the name, in parentheses, may hold spaces)
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return fields[0].decode(), f"{boot}:{int(fields[19])}"
    except (OSError, ValueError, IndexError):
        return None, None
