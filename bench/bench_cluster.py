#!/usr/bin/env python3
"""What running through SLURM costs beside a local run, and how planning, submission and `status` scale
with the shard count. Runs a real SLURM on this machine (tests/slurm_cluster.py: slurmctld and one slurmd
per node, on localhost; needs root and the Debian packages that `make test-deps` installs).

    python bench/bench_cluster.py [--n 20000] [--shards 1000,10000] [--complete 64] [--out bench/out/cluster.md]

1. End to end: the demo model on N synthetic sequences, `--workers 2 --threads 1` locally against
   `--launcher slurm --shards 2 --wait` on a 2-node cluster of 1 CPU per node (one task per node, one
   thread each: the same compute). Wall time from the command to the merged result, and the results
   compared bit for bit.
2. Planning and submission at W shards: `run --launcher slurm --shards W --dry-run` (index, checks,
   manifest, scripts), and the same submitted for real to a cluster with MaxArraySize=1001 (W/1000 arrays
   plus the merge job), held (`--sbatch --hold`) and cancelled afterwards: what a user waits for on the login node.
3. `status` at W shards planned and not started, and on a run of C complete shards with and without
   verifying their checksums (per shard, to scale to W).
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.slurm_cluster import LocalSlurm, unavailable_reason  # noqa: E402  (the tests' cluster, reused)


def cli(*args: str, env: dict | None = None) -> float:
    """Run the real CLI; its wall seconds (it must succeed)."""
    environ = {**(env or os.environ)}
    environ.pop("TRITON_INTERPRET", None)
    t = time.perf_counter()
    done = subprocess.run([sys.executable, str(REPO / "bin" / "run_shards"), *args], env=environ,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t
    if done.returncode != 0:
        raise SystemExit(f"run_shards {' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return wall


def datasets(path: Path) -> dict[str, np.ndarray]:
    out = {}
    with h5py.File(path) as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
    return out


def identical(a: Path, b: Path) -> bool:
    x, y = datasets(a), datasets(b)
    return sorted(x) == sorted(y) and all(np.array_equal(x[k], y[k], equal_nan=x[k].dtype.kind == "f") for k in x)


def make_fasta(path: Path, n: int, seed: int, max_len: int | None = None) -> Path:
    if not path.exists():
        extra = ["--max-len", str(max_len)] if max_len else []
        subprocess.run([sys.executable, str(REPO / "tools" / "make_fasta.py"), "--n", str(n), "--seed", str(seed),
                        *extra, str(path)], check=True, capture_output=True)
    return path


def end_to_end(work: Path, n: int, slurm_root: Path) -> list[str]:
    fasta = make_fasta(work / f"synthetic_{n}.fasta", n, 5)
    common = [str(fasta), "--gpus", "0", "--no-progress", "-q"]
    local = work / "local"
    shutil.rmtree(local, ignore_errors=True)
    cli(str(make_fasta(work / "warm.fasta", 20, 1)), "--out", str(work / "warm"), "--gpus", "0", "-q",
        "--no-progress")   # materialises the demo model once, outside the timings
    t_local = cli(*common, "--out", str(local), "--workers", "2", "--threads", "1")
    with LocalSlurm(slurm_root) as cluster:
        slurm = work / "slurm"
        shutil.rmtree(slurm, ignore_errors=True)
        t_slurm = cli(*common, "--out", str(slurm), "--launcher", "slurm", "--shards", "2", "--wait",
                      env=cluster.env)
    same = identical(local / "result.h5", slurm / "result.h5")
    timing = re.findall(r"compute ([0-9.]+) s", (local / "logs" / "run.log").read_text())
    with h5py.File(local / "result.h5") as f:
        tokens = int(f["num_tokens"][:].sum())
    return [f"### End to end: {n:,} sequences ({tokens:,} tokens), demo model, 2 x 1 CPU thread", "",
            "| launcher | wall s | tok/s | vs local |", "| --- | ---: | ---: | ---: |",
            f"| local, --workers 2 --threads 1 | {t_local:.1f} | {tokens / t_local:,.0f} | 1.00x |",
            f"| slurm, --shards 2 --wait, 2 nodes x 1 CPU | {t_slurm:.1f} | {tokens / t_slurm:,.0f} | "
            f"{t_local / t_slurm:.2f}x |", "",
            f"SLURM overhead {t_slurm - t_local:+.1f} s; local compute (run.log) {timing[-1] if timing else '?'} s; "
            f"results bit-identical: {same}.", ""]


def planning(work: Path, shard_counts: list[int], slurm_root: Path) -> list[str]:
    n = max(shard_counts)
    fasta = make_fasta(work / f"short_{n}.fasta", n, 7, max_len=200)
    rows = ["### Planning, submission and status at W shards (" f"{n:,}-sequence FASTA, MaxArraySize=1001)", "",
            "| W | plan + scripts (--dry-run) s | plan + real sbatch s | arrays + merge job | status (nothing run) s |",
            "| ---: | ---: | ---: | ---: | ---: |"]
    # MaxJobCount counts every array task, and ended jobs stay for MinJobAge: room for both sizes at once.
    with LocalSlurm(slurm_root, max_array_size=1001, max_job_count=4 * max(shard_counts)) as cluster:
        for w in shard_counts:
            dry, real = work / f"dry_{w}", work / f"real_{w}"
            for d in (dry, real):
                shutil.rmtree(d, ignore_errors=True)
            common = [str(fasta), "--gpus", "0", "-q", "--no-progress", "--launcher", "slurm", "--shards", str(w)]
            t_dry = cli(*common, "--out", str(dry), "--dry-run", env=cluster.env)
            t_real = cli(*common, "--out", str(real), "--sbatch", "--hold", env=cluster.env)
            jobs = len(cluster.run("squeue", "--noheader", "--format=%F").split())   # pending arrays: one line each
            t_status = cli("status", str(real), env=cluster.env)
            cluster.cancel_all(timeout=120)
            rows.append(f"| {w:,} | {t_dry:.2f} | {t_real:.2f} | {jobs} | {t_status:.2f} |")
    return rows + [""]


def status_seconds(out: Path, verify: bool) -> float:
    """`status` itself, timed inside a fresh process (without Python's and h5py's start-up)."""
    code = ("import sys, time; from pipeline.reporting.status import status; t = time.perf_counter(); "
            f"status({str(out)!r}, {verify}); print(time.perf_counter() - t)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    return float(done.stdout.split()[-1])


def status_complete(work: Path, complete: int) -> list[str]:
    fasta = make_fasta(work / f"complete_{complete}.fasta", 4 * complete, 9, max_len=100)
    out = work / f"complete_{complete}"
    if not (out / "result.h5").exists():   # a run of many small shards takes minutes: kept between runs
        shutil.rmtree(out, ignore_errors=True)
        cli(str(fasta), "--out", str(out), "--gpus", "0", "--workers", "2", "--threads", "1", "-q",
            "--no-progress", "--shards", str(complete))
    rows = [f"### status on {complete} complete shards (a local run of {4 * complete} sequences)", "",
            "| status | command s (median of 3) | inside status() s | per shard ms | at W = 10,000 (arithmetic) s |",
            "| --- | ---: | ---: | ---: | ---: |"]
    for flag, verify, what in (("--verify", True, "every shard's checksums read"),
                               ("--no-verify", False, "headers only")):
        wall = float(np.median([cli("status", str(out), flag) for _ in range(3)]))
        inside = float(np.median([status_seconds(out, verify) for _ in range(3)]))
        per = inside / complete
        rows.append(f"| {flag} ({what}) | {wall:.2f} | {inside:.3f} | {1000 * per:.2f} | "
                    f"{wall - inside + per * 10000:.0f} |")
    return rows + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=20000, help="sequences of the end-to-end run (0 skips it)")
    ap.add_argument("--shards", default="1000,10000", help="shard counts for planning and submission")
    ap.add_argument("--complete", type=int, default=64, help="complete shards for the status timing (0 skips)")
    ap.add_argument("--work", default=str(REPO / "bench" / "out" / "cluster_work"))
    ap.add_argument("--out", default=str(REPO / "bench" / "out" / "cluster.md"))
    args = ap.parse_args()
    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"bench_cluster needs a local SLURM: {reason} (run `make test-deps` as root)")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    lines = [f"Machine: {os.cpu_count()} cores, {cpu}; {time.strftime('%Y-%m-%d')}", ""]
    # slurmd's job-step socket paths must stay short: the cluster lives in a short temporary directory.
    with tempfile.TemporaryDirectory(prefix="bc") as root:
        if args.n:
            lines += end_to_end(work, args.n, Path(root) / "e2e")
            print("\n".join(lines), flush=True)
        shard_counts = [int(w) for w in args.shards.split(",") if w]
        if shard_counts:
            lines += planning(work, shard_counts, Path(root) / "plan")
            print("\n".join(lines[-len(shard_counts) - 5:]), flush=True)
    if args.complete:
        lines += status_complete(work, args.complete)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
