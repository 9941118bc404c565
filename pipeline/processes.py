"""Whether a process on this host still runs: the one check behind every leftover that names its owner's pid
(the run lock's holder record, the demo model's half-written builds)."""
from __future__ import annotations

import os


def process_alive(pid: int) -> bool:
    """True while a process with this pid exists on this host (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
