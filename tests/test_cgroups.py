"""A cgroup's CPU quota (docker --cpus, a Kubernetes pod's CPU limit) sizes the CPU workers and threads, as the CPU
affinity does: a run in a pod limited to 4 CPUs of a 64-core node started 4 workers of 16 threads each. A cgroup's
memory limit bounds the CPU caches, as MemAvailable does: a worker planned its caches on the node's free RAM, and
the limit's OOM killer ended it.

The cgroup files are read as the kernel writes them; the tests lay out those files for each kind of machine
(cgroup v1 and v2, a container's own view, nested limits), and two tests run the real CLI inside a cgroup they
create (a one-CPU quota, a memory limit), where the kernel lets them (root, a writable controller)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.planning import devices
from pipeline.cgroups import memory_available, quota_cpus, usable_cpus

from .tiny_models import REPO

V1_MOUNTS = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 {root} {mount} rw,relatime - cgroup cgroup rw,cpu,cpuacct
33 31 0:30 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
"""
V2_MOUNTS = "29 23 0:26 {root} {mount} rw,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw,nsdelegate\n"


def machine(tmp_path: Path, mounts: str, cgroup: str, files: dict[str, str]) -> Path:
    """A /proc/self (mountinfo, cgroup) and the cgroup files it points to, under tmp_path; mount points in
    `mounts` and keys of `files` are written relative to tmp_path as {tmp}."""
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "mountinfo").write_text(mounts.replace("{tmp}", str(tmp_path).replace(" ", "\\040")))
    (proc / "cgroup").write_text(cgroup)
    for name, text in files.items():
        path = Path(name.replace("{tmp}", str(tmp_path)))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return proc


def test_a_v2_quota_and_the_smaller_quota_above_it(tmp_path):
    """cgroup v2: cpu.max at the process's cgroup and at each cgroup above it; the smallest bounds it."""
    mount = "{tmp}/cg2"
    proc = machine(tmp_path, V2_MOUNTS.format(root="/", mount=mount), "0::/kubepods/pod1/box\n", {
        f"{mount}/kubepods/cpu.max": "max 100000\n",
        f"{mount}/kubepods/pod1/cpu.max": "250000 100000\n",
        f"{mount}/kubepods/pod1/box/cpu.max": "400000 100000\n"})
    assert quota_cpus(proc) == 2.5
    assert usable_cpus(64, proc) == 3 and usable_cpus(2, proc) == 2   # (rounded up; never above the affinity)


def test_a_container_sees_its_own_cgroup_as_the_root(tmp_path):
    """Inside a container (its own cgroup namespace) /proc/self/cgroup says `0::/` and /sys/fs/cgroup is the
    container's cgroup, whose cpu.max holds docker's --cpus."""
    mount = "{tmp}/sys/fs/cgroup"
    proc = machine(tmp_path, V2_MOUNTS.format(root="/", mount=mount), "0::/\n",
                   {f"{mount}/cpu.max": "150000 100000\n"})
    assert quota_cpus(proc) == 1.5 and usable_cpus(8, proc) == 2


def test_no_quota_is_none(tmp_path):
    """`max` (no limit), v1's -1, no cgroup file system at all, unreadable files: the affinity stands."""
    mount = "{tmp}/cg2"
    proc = machine(tmp_path, V2_MOUNTS.format(root="/", mount=mount), "0::/a\n", {f"{mount}/a/cpu.max": "max 100000\n"})
    assert quota_cpus(proc) is None and usable_cpus(6, proc) == 6
    (tmp_path / "v1").mkdir()
    proc = machine(tmp_path / "v1", V1_MOUNTS.format(root="/", mount="{tmp}/cpu"), "4:cpu,cpuacct:/a\n",
                   {"{tmp}/cpu/a/cpu.cfs_quota_us": "-1\n", "{tmp}/cpu/a/cpu.cfs_period_us": "100000\n"})
    assert quota_cpus(proc) is None
    assert quota_cpus(tmp_path / "nowhere") is None and usable_cpus(3, tmp_path / "nowhere") == 3


def test_a_v1_quota_under_a_mount_of_the_containers_own_cgroup(tmp_path):
    """cgroup v1 (the cpu controller's hierarchy): the mount's root is the container's cgroup, and the process's
    path (from the hierarchy's root) is read below it; a path with a space in its mount point too."""
    mount = "{tmp}/fs cg/cpu"
    proc = machine(tmp_path, V1_MOUNTS.format(root="/docker/abc", mount=mount.replace(" ", "\\040")),
                   "4:cpu,cpuacct:/docker/abc/job\n", {
                       f"{mount}/cpu.cfs_quota_us": "300000\n", f"{mount}/cpu.cfs_period_us": "100000\n",
                       f"{mount}/job/cpu.cfs_quota_us": "50000\n", f"{mount}/job/cpu.cfs_period_us": "100000\n"})
    assert quota_cpus(proc) == 0.5 and usable_cpus(16, proc) == 1


def _bench():
    """bench/bench_cpu_quota.py, whose helpers make a cgroup and run a command in it."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import bench_cpu_quota
    finally:
        sys.path.remove(str(REPO / "bench"))
    return bench_cpu_quota


def test_a_run_in_a_cgroup_with_a_one_cpu_quota_starts_one_single_threaded_worker(tmp_path):
    """The real CLI inside a cgroup limited to one CPU's time, on a machine with two or more: one CPU worker of
    one thread (without the quota: one worker per core, as the run beside it shows)."""
    if devices.cpu_count() < 2:
        pytest.skip(f"this machine has {devices.cpu_count()} CPU: a one-CPU quota changes nothing here")
    bench = _bench()
    folder = bench.cpu_cgroup(1.0)
    if folder is None:
        pytest.skip("cannot create a cgroup with a CPU quota here (needs root and a writable cpu controller)")
    fasta = tmp_path / "in.fasta"
    fasta.write_text("".join(f">s{i}\n{'MKTAYIAKQR' * (3 + i)}\n" for i in range(6)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # (batches of 32 tokens: 330 residues are enough input for a worker per core by default)
    command = [sys.executable, str(REPO / "bin" / "run_shards"), str(fasta), "--model", "demo", "--gpus", "0",
               "--max-tokens-per-batch", "32", "--no-progress"]
    limited = bench.run_in(folder, [*command, "--out", str(tmp_path / "limited")], env, timeout=300)
    assert limited.returncode == 0, limited.stderr
    assert "shards: 1," in limited.stderr, limited.stderr
    logs = sorted(p.name for p in (tmp_path / "limited" / "logs").glob("worker_*.log"))
    assert logs == ["worker_0.log"]
    assert "CPU, 1 threads" in (tmp_path / "limited" / "logs" / "worker_0.log").read_text()
    free = subprocess.run([*command, "--out", str(tmp_path / "free")], capture_output=True, text=True, env=env,
                          timeout=300, cwd=REPO)
    assert free.returncode == 0 and f"shards: {min(4, devices.cpu_count())}," in free.stderr, free.stderr


def test_memory_left_under_v2_and_v1_limits(tmp_path):
    """What a limit leaves: the limit less the cgroup's usage, its inactive file cache (reclaimed first) counted as
    free; the smallest over the cgroup and those above it; no limit ("max", v1's 2**63 - 4096): None."""
    mount = "{tmp}/cg2"
    gib = 2**30
    proc = machine(tmp_path, V2_MOUNTS.format(root="/", mount=mount), "0::/job/step\n", {
        f"{mount}/job/memory.max": f"{8 * gib}\n", f"{mount}/job/memory.current": f"{5 * gib}\n",
        f"{mount}/job/memory.stat": f"anon {4 * gib}\nfile {gib}\ninactive_file {gib // 2}\n",
        f"{mount}/job/step/memory.max": "max\n", f"{mount}/job/step/memory.current": f"{5 * gib}\n"})
    assert memory_available(proc) == 3 * gib + gib // 2
    (tmp_path / "v1").mkdir()
    unlimited = str(2**63 - 4096)
    proc = machine(tmp_path / "v1", V1_MOUNTS.replace("rw,cpu,cpuacct", "rw,memory").format(root="/", mount="{tmp}/m"),
                   "5:memory:/a\n", {"{tmp}/m/memory.limit_in_bytes": unlimited, "{tmp}/m/memory.usage_in_bytes": "0",
                                     "{tmp}/m/a/memory.limit_in_bytes": f"{gib}\n",
                                     "{tmp}/m/a/memory.usage_in_bytes": f"{gib // 4}\n",
                                     "{tmp}/m/a/memory.stat": "inactive_file 5\ntotal_inactive_file 4096\n"})
    assert memory_available(proc) == gib - gib // 4 + 4096
    (tmp_path / "free").mkdir()
    proc = machine(tmp_path / "free", V2_MOUNTS.format(root="/", mount="{tmp}/cg"), "0::/\n",
                   {"{tmp}/cg/memory.max": "max\n"})
    assert memory_available(proc) is None


def test_caches_past_a_cgroup_memory_limit_are_refused_before_they_are_allocated(tmp_path):
    """The real CLI in a cgroup limited to 1.5 GiB (on a machine with more free RAM), a token budget whose caches
    need 4.79 GiB: the worker refuses them, naming the limit and a budget that fits, where it planned them on the
    machine's free RAM, allocated them and met the cgroup's OOM killer (SIGKILL)."""
    limit = 3 * 2**29
    bench = _bench()
    folder = bench.make_cgroup("memory", {"memory.limit_in_bytes": str(limit)}, {"memory.max": str(limit)})
    if folder is None:
        pytest.skip("cannot create a cgroup with a memory limit here (needs root and a writable memory controller)")
    fasta = tmp_path / "in.fasta"
    fasta.write_text("".join(f">s{i}\n{'MKTAYIAKQR' * (3 + i)}\n" for i in range(6)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, str(REPO / "bin" / "run_shards"), str(fasta), "--out", str(tmp_path / "o"), "--model",
               "demo", "--gpus", "0", "--workers", "1", "--max-tokens-per-batch", "20000000", "--no-progress"]
    res = bench.run_in(folder, command, env, timeout=300)
    assert res.returncode == 1, res.stderr
    assert "SIGKILL" not in res.stderr and "caches need" in res.stderr, res.stderr
    assert "memory under this process's cgroup memory limit" in res.stderr, res.stderr
    assert "--max-tokens-per-batch to " in res.stderr, res.stderr
