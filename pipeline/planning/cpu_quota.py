"""The CPU time a cgroup grants this process: a CPU quota (docker --cpus, a Kubernetes pod's CPU limit, systemd's
CPUQuota), which its CPU affinity does not show. In a pod limited to 4 CPUs on a 64-core node the affinity names
64, and workers sized by it would run 64 threads on 4 CPUs' worth of time, throttled (and libgomp's waiting
threads spin: docs/BENCHMARKS.md, "Threads that spin"). Read from the cgroup files, as the JVM does: cgroup v2's
`cpu.max` and v1's `cpu.cfs_quota_us` / `cpu.cfs_period_us`, at this process's cgroup and every cgroup above it
(a parent's quota bounds its children), the smallest of them."""
from __future__ import annotations

import math
from pathlib import Path, PurePosixPath


def quota_cpus(proc: Path = Path("/proc/self")) -> float | None:
    """How many CPUs' worth of time the cgroup quotas of this process allow (e.g. 1.5), or None where none
    limits it (no quota, no cgroup file system, files that cannot be read)."""
    try:
        mounts = (proc / "mountinfo").read_text().splitlines()
        groups = (proc / "cgroup").read_text().splitlines()
    except OSError:
        return None
    limits = [limit for folder, read in _cpu_cgroup_folders(mounts, groups)
              for limit in _limits_up_to_mount(folder, read)]
    return min(limits) if limits else None


def usable_cpus(affinity: int, proc: Path = Path("/proc/self")) -> int:
    """The CPUs this process's threads can keep busy: its affinity's count, fewer where a cgroup's quota grants
    less time (rounded up: 1.5 CPUs of time is two threads, each throttled to three quarters)."""
    quota = quota_cpus(proc)
    return max(1, min(affinity, math.ceil(quota))) if quota is not None else max(1, affinity)


def _cpu_cgroup_folders(mounts: list[str], groups: list[str]):
    """(folder of this process's cgroup, reader of its limit) for the cgroup v2 hierarchy and v1's cpu controller,
    each where it is mounted here (a container sees its own cgroup at the mount's root)."""
    v2_path = next((line.split(":", 2)[2] for line in groups if line.startswith("0::")), None)
    v1_path = next((line.split(":", 2)[2] for line in groups
                    if line.count(":") >= 2 and "cpu" in line.split(":", 2)[1].split(",")), None)
    for line in mounts:
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        after = line.split(" - ", 1)[1].split()
        if len(after) < 3:
            continue
        fstype, options, root, mountpoint = after[0], after[2].split(","), fields[3], _unescape(fields[4])
        if fstype == "cgroup2" and v2_path is not None:
            yield _folder(mountpoint, root, v2_path), _v2_limit
        elif fstype == "cgroup" and "cpu" in options and v1_path is not None:
            yield _folder(mountpoint, root, v1_path), _v1_limit


def _folder(mountpoint: str, root: str, path: str) -> tuple[Path, Path]:
    """(the cgroup's folder, the mount point): `path` (from /proc/self/cgroup, relative to the hierarchy's root)
    under the mount of the hierarchy's `root`; the mount point itself where the path is not under that root (a
    cgroup namespace shows the container's own cgroup as `/`)."""
    relative = PurePosixPath(path).relative_to(root) if PurePosixPath(path).is_relative_to(root) else PurePosixPath()
    return Path(mountpoint) / relative, Path(mountpoint)


def _limits_up_to_mount(folders: tuple[Path, Path], read) -> list[float]:
    folder, mountpoint = folders
    limits = []
    while True:
        limit = read(folder)
        if limit is not None:
            limits.append(limit)
        if folder == mountpoint or folder.parent == folder or mountpoint not in folder.parents:
            return limits
        folder = folder.parent


def _v2_limit(folder: Path) -> float | None:
    """cgroup v2's `cpu.max`: "QUOTA PERIOD" in microseconds, or "max PERIOD" for none."""
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
        return int(quota) / int(period) if quota != "max" and int(period) > 0 and int(quota) > 0 else None
    except (OSError, ValueError):
        return None


def _v1_limit(folder: Path) -> float | None:
    """cgroup v1's `cpu.cfs_quota_us` (-1: none) over `cpu.cfs_period_us`."""
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def _unescape(field: str) -> str:
    """A mountinfo path field: spaces, tabs, newlines and backslashes are written as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field
