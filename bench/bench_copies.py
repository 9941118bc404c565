#!/usr/bin/env python3
"""What never computing a sequence twice costs at planning (#28): every record's sequence digest taken
from the FASTA and the records matched by digest (pipeline/planning/copies.py), OUT/copies.rsidx written.

    python bench/bench_copies.py FASTA [--work /tmp/scale/copies] [--out bench/out/copies.md]

The index is built first (or found in the cache under --work); the step then runs in its own niced
process: wall and CPU seconds (CPU is what a quiet machine would take: this one is shared), CPU per
record, peak RSS (GNU time -v) and the size of copies.rsidx.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

STEP = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from index.cache import load_or_build
from pipeline.planning.copies import _match
from pipeline.rundir.layout import RunDir
from pathlib import Path
index, _ = load_or_build([sys.argv[2]], Path(sys.argv[3]))
run = RunDir(Path(sys.argv[4]))
run.create()
cpu, wall = time.process_time(), time.perf_counter()
counts = _match(run, index, [])
print(json.dumps({"cpu": time.process_time() - cpu, "wall": time.perf_counter() - wall, "counts": counts,
                  "size": run.copies_path.stat().st_size}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("fasta")
    ap.add_argument("--work", default="/tmp/scale/copies")
    ap.add_argument("--out", default=str(REPO / "bench" / "out" / "copies.md"))
    args = ap.parse_args()
    work = Path(args.work)
    shutil.rmtree(work / "run", ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); from index.cache import "
                    "load_or_build; from pathlib import Path; load_or_build([sys.argv[2]], Path(sys.argv[3]))",
                    str(REPO), args.fasta, str(work / "cache")], check=True)
    t = time.perf_counter()
    res = subprocess.run(["/usr/bin/time", "-v", "nice", "-n", "5", sys.executable, "-c", STEP, str(REPO), args.fasta,
                          str(work / "cache"), str(work / "run")], capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(res.stderr[-3000:])
    r = json.loads(res.stdout.strip().splitlines()[-1])
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", res.stderr).group(1)) * 1024
    n = r["counts"]["records"]
    text = (f"{Path(args.fasta).name}: {n:,} records ({r['counts']['duplicates']:,} repeating an earlier one); "
            f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the end (process {time.perf_counter() - t:.1f} s)\n\n"
            f"| digests + matching + copies.rsidx | wall {r['wall']:.1f} s | CPU {r['cpu']:.1f} s "
            f"({r['cpu'] / n * 1e6:.2f} us/record) | peak RSS {rss / 2**30:.2f} GiB | copies.rsidx "
            f"{r['size'] / 1e9:.2f} GB |\n")
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as fh:
        fh.write(text + "\n")


if __name__ == "__main__":
    main()
