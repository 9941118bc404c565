#!/usr/bin/env python3
"""End to end on CPU workers: 20k synthetic sequences with the demo model, 1 vs 2 workers.

    python bench/bench_e2e.py [--n 20000] [--engine auto] [--configs 1x1,2x1,1xall] [--out bench/out/e2e.md]

Each configuration WxT runs the real CLI (`run_shards FASTA --gpus 0 --workers W --threads T`) into a
fresh directory, after one warm-up run that materialises the demo model and the index cache. Reported:
tokens processed, total wall time, tok/s over the whole run, and the share of wall time outside model
compute (index and checks, worker start and model load, shard finalisation and merge), read from the
`timings:` line the parent writes to run.log.
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


def run(fasta: Path, out: Path, workers: int, threads: int, engine: str, extra: list[str]) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    t = time.perf_counter()
    subprocess.run([sys.executable, str(REPO / "bin" / "run_shards"), str(fasta), "--out", str(out), "--gpus", "0",
                    "--workers", str(workers), "--threads", str(threads), "--engine", engine, "--no-progress",
                    "-q", *extra], check=True, env=env)
    wall = time.perf_counter() - t
    with h5py.File(out / "result.h5") as f:
        tokens = int(f["num_tokens"][:].sum())
        engine_used = f.attrs["engine"]
    timing = re.findall(r"timings: .*", (out / "logs" / "run.log").read_text())[-1]
    outside = float(re.search(r"([0-9.]+)% outside", timing).group(1))
    compute = float(re.search(r"compute ([0-9.]+) s", timing).group(1))
    return {"tokens": tokens, "wall": wall, "outside": outside, "compute": compute, "timing": timing,
            "engine": engine_used}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--engine", default="auto")
    ap.add_argument("--configs", default="1x1,2x1,1xall")
    ap.add_argument("--work", default=str(REPO / "bench" / "out" / "e2e_work"))
    ap.add_argument("--out", default=str(REPO / "bench" / "out" / "e2e.md"))
    ap.add_argument("extra", nargs="*", help="more run_shards options, after --")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    fasta = work / f"synthetic_{args.n}.fasta"
    if not fasta.exists():
        subprocess.run([sys.executable, str(REPO / "tools" / "make_fasta.py"), "--n", str(args.n), "--seed", "5",
                        str(fasta)], check=True)
    warm = work / "warm.fasta"
    warm.write_text(">w\nMKV\n")
    run(warm, work / "warmup", 1, 1, args.engine, args.extra)

    results = []
    for spec in args.configs.split(","):
        w, t = spec.split("x")
        threads = (os.cpu_count() or 1) // int(w) if t == "all" else int(t)
        r = run(fasta, work / f"run_{spec}", int(w), threads, args.engine, args.extra)
        r["spec"] = f"{w} worker(s) x {threads} thread(s)"
        results.append(r)
        print(r["spec"], r["timing"], flush=True)
    base = results[0]["tokens"] / results[0]["wall"]
    lines = [
        f"End to end, {args.n:,} synthetic sequences (tools/make_fasta.py --seed 5), demo model, engine "
        f"{results[0]['engine']}, {os.cpu_count()} CPU cores",
        "",
        "| workers x threads | tokens | wall s | tok/s (whole run) | vs first | compute s | outside model compute |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        tps = r["tokens"] / r["wall"]
        lines.append(f"| {r['spec']} | {r['tokens']:,} | {r['wall']:.1f} | {tps:,.0f} | {tps / base:.2f}x | "
                     f"{r['compute']:.1f} | {r['outside']:.1f}% |")
    text = "\n".join(lines)
    print(text)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
