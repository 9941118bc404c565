#!/usr/bin/env python3
"""The default number of CPU workers for a small input (README, "Devices"; docs/BENCHMARKS.md, "Default CPU
workers for a small input").

    python bench/bench_small_input.py [--records 10,40,200] [--rounds 3]

For each size, a `tools/make_fasta.py --seed 1` FASTA of that many records runs on the demo model twice a round:
with `--workers N`, N being the default for a large input on this machine (one per core, at most 4: what every
input got before the default followed the input's size), and with the default. Prints each run as it ends (wall
seconds, and the CPU seconds of the command and its workers), then the medians. Each run is a fresh
`run_shards` process with its own --out; the two settings alternate, so a machine's load falls on both alike.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.planning import devices  # noqa: E402


def one_run(fasta: Path, out: Path, workers: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the command and its workers) of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    subprocess.run([sys.executable, str(REPO / "bin" / "run_shards"), str(fasta), "--out", str(out), "--quiet",
                    *workers], check=True, capture_output=True, env={**os.environ, "RUN_SHARDS_REPORT": "0"})
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", default="10,40,200", help="comma-separated record counts")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    large = min(devices.DEFAULT_MAX_CPU_WORKERS, devices.cpu_count())
    settings = {f"--workers {large}": ["--workers", str(large)], "default": []}
    with tempfile.TemporaryDirectory() as tmp:
        inputs = {}
        for n in map(int, args.records.split(",")):
            inputs[n] = Path(tmp) / f"records{n}.fa"
            subprocess.run([sys.executable, str(REPO / "tools" / "make_fasta.py"), "--n", str(n), "--seed", "1",
                            str(inputs[n])], check=True, capture_output=True)
            one_run(inputs[n], Path(tmp) / f"warm{n}", [])   # the index cache and the demo model, once
        times: dict[tuple[int, str], list[tuple[float, float]]] = {}
        for r in range(args.rounds):
            for n, fasta in inputs.items():
                for name, extra in settings.items():
                    wall, cpu = one_run(fasta, Path(tmp) / f"out{r}_{n}_{len(extra)}", extra)
                    times.setdefault((n, name), []).append((wall, cpu))
                    print(f"round {r + 1}: {n} records ({fasta.stat().st_size:,} bytes), {name}: {wall:.2f} s wall, "
                          f"{cpu:.2f} CPU s", flush=True)
        print(f"\nmedians over {args.rounds} round(s), load average now {os.getloadavg()[0]:.1f}:")
        for (n, name), runs in times.items():
            print(f"{n:6d} records, {name:12s}: {statistics.median(w for w, _ in runs):.2f} s wall, "
                  f"{statistics.median(c for _, c in runs):.2f} CPU s")


if __name__ == "__main__":
    main()
