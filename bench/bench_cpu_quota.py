#!/usr/bin/env python3
"""CPU workers and threads under a cgroup's CPU quota (README, "Devices"; docs/BENCHMARKS.md, "A cgroup's CPU quota
and memory limit").

    python bench/bench_cpu_quota.py [--cpus 1] [--records 1000] [--runs 2]     (as root)

Creates a cgroup whose quota is --cpus CPUs' time (cgroup v1's cpu controller, or cgroup v2 from the root cgroup)
and runs the demo model over the first RECORDS records of examples/demo.fasta inside it, each run a fresh
`run_shards` process with its own --out: with run_shards' defaults (workers and threads from the quota), and with
what the CPU affinity alone gives (run_shards' choice before it read quotas: `--workers min(4, cores) --threads
cores // workers`), and one worker of all cores' threads (`--workers 1`, then and now). Prints each run as it ends
(wall seconds, compute seconds from run.log's timings line), medians at the end.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def make_cgroup(controller: str, v1: dict[str, str], v2: dict[str, str]) -> Path | None:
    """A new cgroup with `v1`'s files written (v1's `controller` hierarchy) or `v2`'s (cgroup v2, where this process
    is in the root cgroup), or None where the kernel does not let this process make one (not root, no writable
    controller)."""
    name = f"run_shards_bench_{os.getpid()}_{time.monotonic_ns()}"
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        if " - " not in line:
            continue
        after, mount = line.split(" - ", 1)[1].split(), Path(line.split()[4])
        try:
            if after[0] == "cgroup" and controller in after[2].split(","):
                files = v1
            elif after[0] == "cgroup2" and "0::/\n" in Path("/proc/self/cgroup").read_text() and \
                    controller in (mount / "cgroup.controllers").read_text().split():
                (mount / "cgroup.subtree_control").write_text(f"+{controller}")
                files = v2
            else:
                continue
            folder = mount / name
            folder.mkdir()
            for file, text in files.items():
                (folder / file).write_text(text)
            return folder
        except OSError:
            continue
    return None


def cpu_cgroup(cpus: float) -> Path | None:
    """A new cgroup whose CPU quota is `cpus` CPUs' time (make_cgroup)."""
    quota = str(int(cpus * 100000))
    return make_cgroup("cpu", {"cpu.cfs_quota_us": quota}, {"cpu.max": f"{quota} 100000"})


def run_in(folder: Path, command: list[str], env: dict | None = None, timeout: float = 600,
           remove: bool = True) -> subprocess.CompletedProcess:
    """`command` (and every process it starts) in the cgroup `folder`, which is removed after it unless `remove`
    is false."""
    try:
        return subprocess.run(["sh", "-c", f'echo $$ > "{folder}/cgroup.procs" && exec "$@"', "sh", *command],
                              capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)
    finally:
        if remove:
            remove_cgroup(folder)


def remove_cgroup(folder: Path) -> None:
    for _ in range(50):   # (every process in it has ended; the kernel frees the cgroup a moment later)
        try:
            folder.rmdir()
            return
        except OSError:
            time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpus", type=float, default=1.0, help="the cgroup's quota, in CPUs' time")
    ap.add_argument("--records", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args(argv)
    cores = len(os.sched_getaffinity(0))
    folder = cpu_cgroup(args.cpus)
    if folder is None:
        print("bench_cpu_quota: cannot create a cgroup with a CPU quota here (run as root, with a writable cpu "
              "controller)", file=sys.stderr)
        return 2
    workers = min(4, cores)
    cases = {"defaults (from the quota)": [],
             f"--workers {workers} --threads {cores // workers} (the affinity's)": [
                 "--workers", str(workers), "--threads", str(cores // workers)],
             f"--workers 1 --threads {cores} (the affinity's)": ["--workers", "1", "--threads", str(cores)],
             "--workers 1 (threads from the quota)": ["--workers", "1"]}
    env = {**os.environ, "RUN_SHARDS_REPORT": "0"}
    results: dict[str, list[tuple[float, float]]] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            fasta = Path(tmp) / "in.fasta"
            records = (REPO / "examples" / "demo.fasta").read_text().split(">")[1:args.records + 1]
            fasta.write_text("".join(">" + r for r in records))
            print(f"{cores} cores; a cgroup with a quota of {args.cpus:g} CPUs' time ({folder}); {len(records)} "
                  "records of examples/demo.fasta, the demo model", flush=True)
            base = [sys.executable, str(REPO / "bin" / "run_shards"), str(fasta), "--model", "demo", "--gpus", "0",
                    "--no-progress"]
            run_in(folder, [*base, "--out", str(Path(tmp) / "warm")], env, remove=False)   # caches, once
            for k in range(args.runs):
                for c, (name, options) in enumerate(cases.items()):
                    out = Path(tmp) / f"{c}-{k}"
                    began = time.monotonic()
                    res = run_in(folder, [*base, "--out", str(out), *options], env, remove=False)
                    wall = time.monotonic() - began
                    if res.returncode != 0:
                        print(res.stderr, file=sys.stderr)
                        return 1
                    compute = float(re.search(r"compute ([\d.]+) s", res.stderr).group(1))
                    shards = re.search(r"shards: (\d+)", res.stderr).group(1)
                    results.setdefault(name, []).append((wall, compute))
                    print(f"run {k + 1}  {name:45s}  {shards} worker(s): {wall:5.1f} s, compute {compute:5.1f} s",
                          flush=True)
    finally:
        remove_cgroup(folder)
    print("\nmedians (wall s, compute s):")
    for name, rows in results.items():
        print(f"  {name:45s}  {statistics.median(w for w, _ in rows):5.1f}  "
              f"{statistics.median(c for _, c in rows):5.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
