#!/usr/bin/env python3
"""`--reuse` end to end (#28): a run over a FASTA, then a second run over the same FASTA plus 1% new
records reusing the first: what each computed (run.log's `copies` line, the shards' rows) and took.

    python bench/bench_reuse.py [--n 2000] [--work /tmp/scale/reuse] [--out bench/out/reuse.md]

Both runs use the demo model (materialised in the cache under --work) on 2 CPU workers, `--per-residue`.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import h5py

REPO = Path(__file__).resolve().parents[1]


def run(fasta: Path, out: Path, env: dict, *extra: str) -> tuple[float, str, int]:
    """Wall seconds, the `copies` line of run.log and the rows the shards computed."""
    t = time.perf_counter()
    subprocess.run([sys.executable, str(REPO / "bin" / "run_shards"), str(fasta), "--out", str(out), "--model",
                    "demo", "--gpus", "0", "--workers", "2", "--per-residue", "--no-progress", *extra],
                   check=True, capture_output=True, env=env)
    wall = time.perf_counter() - t
    line = re.search(r"copies: (.*)", (out / "logs" / "run.log").read_text()).group(1)
    rows = 0
    for path in (out / "shards").glob("shard_*.h5"):
        with h5py.File(path) as f:
            rows += len(f["index"])
    return wall, line, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--work", default="/tmp/scale/reuse")
    ap.add_argument("--out", default=str(REPO / "bench" / "out" / "reuse.md"))
    args = ap.parse_args()
    work = Path(args.work)
    for name in ("a", "b", "warm"):
        shutil.rmtree(work / f"out_{name}", ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, RUN_SHARDS_CACHE=str(work / "cache"), RUN_SHARDS_REPORT="0")
    env.pop("TRITON_INTERPRET", None)
    base, new, both = work / "base.fasta", work / "new.fasta", work / "plus1pct.fasta"
    make = [sys.executable, str(REPO / "tools" / "make_fasta.py"), "--min-len", "20", "--max-len", "200"]
    subprocess.run(make + ["--n", str(args.n), "--seed", "1", str(base)], check=True, capture_output=True)
    subprocess.run(make + ["--n", str(max(1, args.n // 100)), "--seed", "2", str(new)], check=True, capture_output=True)
    both.write_text(base.read_text() + new.read_text().replace(">SYN", ">NEW"))
    run(new, work / "out_warm", env)   # materialises the demo model, so the timed runs do not pay for it
    a = run(base, work / "out_a", env)
    b = run(both, work / "out_b", env, "--reuse", str(work / "out_a"))
    text = "\n".join([f"{args.n:,} records, then the same plus {max(1, args.n // 100):,} new; {os.cpu_count()} cores, "
                      f"load average {os.getloadavg()[0]:.2f} at the end (a shared machine)", "",
                      "| run | wall s | rows computed | run.log |", "| --- | ---: | ---: | --- |",
                      f"| first | {a[0]:.1f} | {a[2]:,} | {a[1]} |",
                      f"| second, `--reuse` the first | {b[0]:.1f} | {b[2]:,} | {b[1]} |"])
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as fh:
        fh.write(text + "\n\n")


if __name__ == "__main__":
    main()
