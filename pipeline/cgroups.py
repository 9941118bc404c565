"""What this process's cgroups grant it, which the CPU affinity and /proc/meminfo do not show: a CPU quota
(docker --cpus, a Kubernetes pod's CPU limit, systemd's CPUQuota) and a memory limit (docker --memory, a pod's
memory limit, a SLURM job's --mem under cgroup enforcement). In a pod limited to 4 CPUs and 16 GiB on a 64-core,
512 GiB node the affinity names 64 cores and MemAvailable ~500 GiB: workers sized by them ran 64 threads on 4
CPUs' worth of time, throttled, and planned caches the limit's OOM killer ended.

Read from the cgroup files as the kernel writes them (as the JVM does), at this process's cgroup and every cgroup
above it up to the mount (a parent's limit bounds its children), the smallest: cgroup v2's `cpu.max` and
`memory.max` / `memory.current`, v1's `cpu.cfs_quota_us` / `cpu.cfs_period_us` and `memory.limit_in_bytes` /
`memory.usage_in_bytes`. A container in its own cgroup namespace sees its cgroup at the mount's root."""
from __future__ import annotations

import math
from pathlib import Path, PurePosixPath
from typing import Callable, Iterator

PROC = Path("/proc/self")
# cgroup v1 writes "no limit" as the largest multiple of the page size below 2**63
_V1_UNLIMITED = 2**62


def quota_cpus(proc: Path = PROC) -> float | None:
    """How many CPUs' worth of time the cgroup quotas of this process allow (e.g. 1.5), or None where none
    limits it (no quota, no cgroup file system, files that cannot be read)."""
    limits = [limit for limit in _limits("cpu", _v2_cpu, _v1_cpu, proc) if limit is not None]
    return min(limits) if limits else None


def usable_cpus(affinity: int, proc: Path = PROC) -> int:
    """The CPUs this process's threads can keep busy: its affinity's count, fewer where a cgroup's quota grants
    less time (rounded up: 1.5 CPUs of time is two threads, each throttled to three quarters)."""
    quota = quota_cpus(proc)
    return max(1, min(affinity, math.ceil(quota))) if quota is not None else max(1, affinity)


def memory_available(proc: Path = PROC) -> int | None:
    """Bytes this process's cgroups let it allocate yet: each limit less what its cgroup uses, the file cache the
    kernel would reclaim first (inactive files) counted as free, the smallest over the cgroups; None where no
    limit applies."""
    room = [r for r in _limits("memory", _v2_memory, _v1_memory, proc) if r is not None]
    return max(0, min(room)) if room else None


def _limits(controller: str, v2: Callable[[Path], float | None], v1: Callable[[Path], float | None],
            proc: Path) -> Iterator[float | None]:
    """`v2` or `v1` read at each folder from this process's cgroup up to its hierarchy's mount point, for the
    cgroup v2 hierarchy and v1's `controller` hierarchy, where mounted here."""
    try:
        mounts = (proc / "mountinfo").read_text().splitlines()
        groups = (proc / "cgroup").read_text().splitlines()
    except OSError:
        return
    v2_path = next((line.split(":", 2)[2] for line in groups if line.startswith("0::")), None)
    v1_path = next((line.split(":", 2)[2] for line in groups
                    if line.count(":") >= 2 and controller in line.split(":", 2)[1].split(",")), None)
    for line in mounts:
        fields = line.split()
        after = line.split(" - ", 1)[1].split() if " - " in line else []   # (fstype, source, super options)
        if len(fields) < 5 or len(after) < 3:
            continue
        fstype, options, root, mountpoint = after[0], after[2].split(","), fields[3], Path(_unescape(fields[4]))
        if fstype == "cgroup2" and v2_path is not None:
            read, path = v2, v2_path
        elif fstype == "cgroup" and controller in options and v1_path is not None:
            read, path = v1, v1_path
        else:
            continue
        # the process's path is from the hierarchy's root; the mount shows the hierarchy from `root` down (a
        # path outside it: a cgroup namespace, whose own cgroup is the mount point)
        inside = PurePosixPath(path).is_relative_to(root)
        folder = mountpoint / PurePosixPath(path).relative_to(root) if inside else mountpoint
        while True:
            yield read(folder)
            if folder == mountpoint or mountpoint not in folder.parents:
                break
            folder = folder.parent


def _v2_cpu(folder: Path) -> float | None:
    """cgroup v2's `cpu.max`: "QUOTA PERIOD" in microseconds, or "max PERIOD" for none."""
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
        return int(quota) / int(period) if quota != "max" and int(period) > 0 and int(quota) > 0 else None
    except (OSError, ValueError):
        return None


def _v1_cpu(folder: Path) -> float | None:
    """cgroup v1's `cpu.cfs_quota_us` (-1: none) over `cpu.cfs_period_us`."""
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def _v2_memory(folder: Path) -> int | None:
    """cgroup v2's `memory.max` ("max": none) less `memory.current`, plus `memory.stat`'s inactive_file."""
    try:
        limit = (folder / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((folder / "memory.current").read_text()) + _stat(folder, "inactive_file")
    except (OSError, ValueError):
        return None


def _v1_memory(folder: Path) -> int | None:
    """cgroup v1's `memory.limit_in_bytes` (about 2**63: none) less `memory.usage_in_bytes`, plus `memory.stat`'s
    total_inactive_file (this cgroup's and its children's)."""
    try:
        limit = int((folder / "memory.limit_in_bytes").read_text())
        if limit >= _V1_UNLIMITED:
            return None
        return limit - int((folder / "memory.usage_in_bytes").read_text()) + _stat(folder, "total_inactive_file")
    except (OSError, ValueError):
        return None


def _stat(folder: Path, key: str) -> int:
    """A counter of the cgroup's `memory.stat`, 0 where it has none."""
    try:
        for line in (folder / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _unescape(field: str) -> str:
    """A mountinfo path field: spaces, tabs, newlines and backslashes are written as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field
