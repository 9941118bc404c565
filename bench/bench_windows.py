#!/usr/bin/env python3
"""`--on-long window` beside plain runs, on sequences of 3x the window: what the overlapping windows cost.

    python bench/bench_windows.py [--n 300] [--window 512] [--workers 2] [--out bench/out/windows.md]

The demo model (no limit of its own) runs N sequences of 3 x (window - 2) residues three ways through the
real CLI: plain (each sequence whole), windowed with the default overlap (a quarter of a window), and
windowed with no overlap. Reported: wall time, residues per second, tokens the model computed (windows
overlap, so more than the residues), and the cost against the plain run.
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np

REPO = Path(__file__).resolve().parents[1]


def run(fasta: Path, out: Path, workers: int, extra: list[str]) -> tuple[float, float]:
    """Wall seconds of the whole command, and the compute seconds from run.log's timings line."""
    shutil.rmtree(out, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    t = time.perf_counter()
    subprocess.run([sys.executable, str(REPO / "bin" / "run_shards"), str(fasta), "--out", str(out), "--gpus", "0",
                    "--workers", str(workers), "--threads", "1", "--no-progress", "-q", *extra], check=True, env=env)
    wall = time.perf_counter() - t
    compute = float(re.findall(r"compute ([0-9.]+) s", (out / "logs" / "run.log").read_text())[-1])
    return wall, compute


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--work", default=str(REPO / "bench" / "out" / "windows_work"))
    ap.add_argument("--out", default=str(REPO / "bench" / "out" / "windows.md"))
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    residues = 3 * (args.window - 2)
    fasta = work / f"long_{args.n}_{residues}.fasta"
    rng = np.random.default_rng(5)
    fasta.write_text("".join(f">p{i}\n{''.join(rng.choice(list('ACDEFGHIKLMNPQRSTVWY'), residues))}\n"
                             for i in range(args.n)))
    total = args.n * residues
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    lines = [f"Machine: {os.cpu_count()} cores, {cpu}; {time.strftime('%Y-%m-%d')}. {args.n} sequences of {residues} "
             f"residues (3 windows' worth at --window {args.window}), demo model, {args.workers} worker(s) x 1 thread.",
             "", "| run | wall s | compute s | residues/s (compute) | tokens computed | compute vs plain |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    plain_compute = None
    for name, extra in [("plain (whole sequences)", []),
                        (f"--on-long window --window {args.window} (overlap default)",
                         ["--on-long", "window", "--window", str(args.window)]),
                        (f"--on-long window --window {args.window} --overlap 0",
                         ["--on-long", "window", "--window", str(args.window), "--overlap", "0"])]:
        out = work / re.sub(r"\W+", "_", name)
        wall, compute = run(fasta, out, args.workers, extra)
        with h5py.File(out / "result.h5") as f:
            windows = f["windows"][:] if "windows" in f else np.ones(args.n, int)
        size = args.window - 2
        overlap = size // 4 if "--overlap" not in extra else 0
        computed = int(windows.sum()) * args.window if windows.max() > 1 else total + 2 * args.n
        plain_compute = plain_compute or compute
        lines.append(f"| {name} | {wall:.1f} | {compute:.1f} | {total / compute:,.0f} | {computed:,} | "
                     f"{compute / plain_compute:.2f}x |")
        print(lines[-1], f"(overlap {overlap}, windows per sequence {windows.min()}-{windows.max()})", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
