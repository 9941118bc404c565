"""Whether a process on this host still runs: the one check behind every leftover that names its owner's pid
(the run lock's holder record, the demo model's half-written builds)."""
from __future__ import annotations

import os

# A holder's record gives its time in whole seconds, and the boot time that a process's start is counted
# from is rounded to one: a process that started this much after the record is not the one that wrote it.
START_SLACK_SECONDS = 3.0


def process_alive(pid: int, since: float | None = None) -> bool:
    """True while a process with this pid exists on this host (one we may not signal counts as alive).

    A zombie (killed, not yet reaped by a parent that never will: a container's init, a script that does not
    wait) is gone. With `since` (epoch seconds at which the owner was known to run, as a lock record says), a
    process that started later only reuses the pid of one that died: after a reboot, or pids wrapped around."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    started, zombie = _start_and_zombie(pid)
    if zombie:
        return False
    return since is None or started is None or started <= since + START_SLACK_SECONDS


def _start_and_zombie(pid: int) -> tuple[float | None, bool]:
    """When the process started (epoch seconds) and whether it is a zombie, from Linux's /proc; (None, False)
    where that cannot be read (another system: the pid alone decides there)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        state, ticks = fields[0], int(fields[19])
        with open("/proc/stat", "rb") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK"), state in (b"Z", b"X")
    except (OSError, ValueError, IndexError, StopIteration):
        return None, False
