#!/usr/bin/env python3
"""More shards than local workers (README, "Devices"; docs/BENCHMARKS.md, "More shards than workers").

    python bench/bench_many_shards.py [--records 1000] [--shards 2,16,64] [--workers 2] [--rounds 1]

A `tools/make_fasta.py --seed 1` FASTA of --records records runs on the demo model with `--workers W --shards S` for
each S, each run a fresh `run_shards` process with its own --out. Prints each run as it ends (wall seconds, the CPU
seconds of the command and its workers, and how many worker processes the run started, from the shards' `start`
events), then the medians. A worker that finishes its shard is given the next one waiting (launchers/supervisor.py),
so shards beyond the workers cost a shard's opening and finishing, not a process's start and a model's load.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def one_run(fasta: Path, out: Path, workers: int, shards: int) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds of the command and its workers, worker processes) of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    subprocess.run([sys.executable, str(REPO / "bin" / "run_shards"), str(fasta), "--out", str(out), "--quiet",
                    "--workers", str(workers), "--shards", str(shards)],
                   check=True, capture_output=True, env={**os.environ, "RUN_SHARDS_REPORT": "0"})
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    pids = set()
    for events in (out / "logs").glob("events_*.jsonl"):
        for line in events.read_text().splitlines():
            event = json.loads(line)
            if event.get("event") == "start" and event.get("pid"):
                pids.add(event["pid"])
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, len(pids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=1000)
    parser.add_argument("--shards", default="2,16,64", help="comma-separated shard counts")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fasta = Path(tmp) / "records.fa"
        subprocess.run([sys.executable, str(REPO / "tools" / "make_fasta.py"), "--n", str(args.records), "--seed",
                        "1", str(fasta)], check=True, capture_output=True)
        one_run(fasta, Path(tmp) / "warm", args.workers, args.workers)   # the index cache and the demo model, once
        times: dict[int, list[tuple[float, float, int]]] = {}
        for r in range(args.rounds):
            for shards in map(int, args.shards.split(",")):
                wall, cpu, processes = one_run(fasta, Path(tmp) / f"out{r}_{shards}", args.workers, shards)
                times.setdefault(shards, []).append((wall, cpu, processes))
                print(f"round {r + 1}: {args.records} records, --workers {args.workers} --shards {shards}: "
                      f"{wall:.2f} s wall, {cpu:.2f} CPU s, {processes} worker process(es)", flush=True)
        print(f"\nmedians over {args.rounds} round(s), load average now {os.getloadavg()[0]:.1f}:")
        for shards, runs in times.items():
            print(f"--shards {shards:4d}: {statistics.median(w for w, _, _ in runs):.2f} s wall, "
                  f"{statistics.median(c for _, c, _ in runs):.2f} CPU s, {runs[0][2]} worker process(es)")


if __name__ == "__main__":
    main()
