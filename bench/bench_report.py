#!/usr/bin/env python3
"""What OUT/report.html costs a command at its end: `report.write` called in-process on finished run
directories, the first call in a fresh process (what a `run` pays: the charts' imports included), the
median of the next calls, and of those the part that gathers the facts from the run directory (not charts).

    python bench/bench_report.py OUT [OUT ...] [--repeat 5]

Make the run directories first, e.g. `bin/run_shards examples/demo.fasta --out /tmp/x --workers 1`.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.reporting import report  # noqa: E402  (imported before timing, as a run has it imported)
from pipeline.rundir.layout import RunDir  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="+", type=Path, help="finished run directories")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    print(f"| run directory | shards | first call (s) | median of next {args.repeat} (s) | of which gathering the "
          "facts (s) | report.html (KiB) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for out in args.out:
        times, gathering = [], []
        for _ in range(args.repeat + 1):
            t = time.perf_counter()
            path = report.write(out)
            times.append(time.perf_counter() - t)
        for _ in range(args.repeat):
            t = time.perf_counter()
            report.gather(RunDir(str(out)), None)
            gathering.append(time.perf_counter() - t)
        shards = len(list((out / "shards").glob("shard_*.h5")))
        print(f"| {out} | {shards} | {times[0]:.3f} | {statistics.median(times[1:]):.3f} | "
              f"{statistics.median(gathering):.3f} | {path.stat().st_size / 1024:.0f} |")


if __name__ == "__main__":
    main()
