#!/usr/bin/env python3
"""CPU workers' waiting threads on a busy machine and an idle one (README, "Batch sizes and memory").

    python bench/bench_wait_policy.py [--records 300] [--runs 2]

Runs the demo model over the first RECORDS records of examples/demo.fasta with one worker of two threads
(`--workers 1 --threads 2`), with `OMP_WAIT_POLICY` unset (libgomp's default), ACTIVE and PASSIVE, first beside a
process spinning on one core (a machine busy with other work), then on the machine as it is. Prints, as each
run ends, the workers' CPU seconds (the run's child processes, reaped) and the run's wall seconds; medians
over --runs at the end. Each run is a fresh `run_shards` process with its own --out (the index cache warmed
once first).
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
POLICIES = (None, "ACTIVE", "PASSIVE")


def _spin() -> None:
    while True:
        pass


def one_run(fasta: Path, out: Path, policy: str | None) -> tuple[float, float]:
    """(CPU seconds of the run's processes, wall seconds) of one run."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    env.setdefault("RUN_SHARDS_REPORT", "0")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.monotonic()
    subprocess.run([sys.executable, str(REPO / "bin" / "run_shards"), str(fasta), "--out", str(out), "--model",
                    "demo", "--gpus", "0", "--workers", "1", "--threads", "2", "-q"], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    wall = time.monotonic() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return cpu, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=300)
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fasta = Path(tmp) / "in.fasta"
        records = (REPO / "examples" / "demo.fasta").read_text().split(">")[1:args.records + 1]
        fasta.write_text("".join(">" + r for r in records))
        one_run(fasta, Path(tmp) / "warm", None)   # the index cache and the demo model, once
        results = {}
        for machine in ("busy", "idle"):
            spinner = multiprocessing.Process(target=_spin, daemon=True) if machine == "busy" else None
            if spinner:
                spinner.start()
            try:
                for policy in POLICIES:
                    for k in range(args.runs):
                        cpu, wall = one_run(fasta, Path(tmp) / f"{machine}-{policy}-{k}", policy)
                        results.setdefault((machine, policy), []).append((cpu, wall))
                        print(f"{machine:4s}  OMP_WAIT_POLICY={policy or 'unset':7s}  run {k + 1}: "
                              f"{cpu:5.1f} CPU s, {wall:5.1f} s", flush=True)
            finally:
                if spinner:
                    spinner.terminate()
                    spinner.join()
        print("\nmedians (CPU s of the run's processes, wall s):")
        for (machine, policy), rows in results.items():
            print(f"{machine:4s}  {policy or 'unset':7s}  {statistics.median(c for c, _ in rows):5.1f}  "
                  f"{statistics.median(w for _, w in rows):5.1f}")


if __name__ == "__main__":
    main()
