"""How a process stops when the one that started it dies, even by SIGKILL: the kernel's parent-death signal
(Linux), asked for by the child itself after exec; a worker of the local launcher, and `run_shards work`
under a Ray task (whose worker has threads, where a preexec_fn could deadlock)."""
from __future__ import annotations

import logging
import os

log = logging.getLogger("run_shards.worker")


def on_parent_death(parent: int, sig: int) -> bool:
    """Ask the kernel for `sig` when the process that started this one dies (PR_SET_PDEATHSIG, Linux); False
    when `parent` is gone already (a death before this call sends nothing). The caller handles `sig`."""
    import ctypes
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig))   # PR_SET_PDEATHSIG
    except (OSError, AttributeError) as e:
        log.debug("no parent-death signal on this system (%s); only getppid() checks remain", e)
    return os.getppid() == parent
