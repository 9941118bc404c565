"""Whether a process on this host still runs: the one check behind every leftover that names its owner's pid
(the run lock's holder record, the demo model's half-written builds)."""
from __future__ import annotations

import os


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


def process_start(pid: int | None = None) -> str | None:
    """`BOOT_ID:TICKS`, what tells this process (or `pid`) from a later one with the same pid, on Linux (/proc);
    None elsewhere."""
    return _state_and_start(os.getpid() if pid is None else pid)[1]


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
