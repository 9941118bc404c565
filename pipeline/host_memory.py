"""The memory this process can allocate yet: the kernel's MemAvailable (what it can give without swapping), or what
a cgroup's memory limit leaves where that is less (a container's, a pod's, a SLURM job's: cgroups.py). The CPU
workers' caches are checked against it (engine/config.py), and a local CPU run's copies of the model, one per worker,
before any is loaded (planning/model_copies.py)."""
from __future__ import annotations

from . import faults
from .cgroups import memory_available

RAM = "memory (RAM)"
LIMITED = "memory under this process's cgroup memory limit (a container's, a job's)"


def available_ram() -> tuple[int | None, str]:
    """(bytes, which memory it is, in words for a refusal): MemAvailable, or a cgroup limit's room where less;
    None where neither says (RUN_SHARDS_FAULT_FREE_RAM stands in for both in tests)."""
    injected = faults.free_ram()
    if injected is not None:
        return injected, RAM
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    limited = memory_available()
    if limited is not None and (available is None or limited < available):
        return limited, LIMITED
    return available, RAM
