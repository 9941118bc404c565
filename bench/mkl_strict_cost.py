#!/usr/bin/env python3
"""What MKL's strict CNR mode (set by every CPU worker of a batch-invariant run) costs against MKL's
default mode: float32 products of real sizes, and the native engine end to end.

    python bench/mkl_strict_cost.py products --repeats 4 --threads 1,2
    python bench/mkl_strict_cost.py e2e --models demo --n 2000 --repeats 3
    python bench/mkl_strict_cost.py e2e --models qwen35-eighth --n 2000 --slice 1600:2000 --repeats 3

MKL takes its mode once per process, before it first computes, so each measurement is its own process,
the two modes alternating (strict, default, default, strict, ...) so that a shared machine's changing load
hits both alike. `products`: F.linear at each shape and --threads count, the best of 5 timings of about
0.2 s each per process; `e2e`: bench/bench_engine.py with the native engine only (batch-invariant in
both modes: --mkl-default). With 1 thread both time the process's CPU time, not wall time: on a shared
machine other processes' load stretches wall time by up to 2x, CPU time much less. Prints every run's
number, then per mode the median and the range, and the median's cost (strict over default - 1).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# (rows, in, out): an ESM-2 650M MLP at a decode-like, a short and a full step; its down projection;
# Qwen3.5-0.8B's hidden 1,024 (the defect's probe shape 1,024 -> 256 too); the 1/8 Qwen3.5's MLP; the
# demo model's MLP (hidden 64, 160) and one of its attention blocks (64 query rows against 256 keys of 16).
SHAPES = [(16, 1280, 5120), (100, 1280, 5120), (4096, 1280, 5120), (4096, 5120, 1280), (16, 1024, 256),
          (100, 1024, 256), (4096, 1024, 3584), (4096, 512, 1792), (4096, 64, 160), (4096, 160, 64), (64, 16, 256)]
# Batched products as the delta rule's chunks run them: (batch, n, n) @ (batch, n, n).
BATCHED = [(1024, 16, 16)]
MODES = ("strict", "default")


def _best_ms(product, threads: int) -> float:
    """The best of 5 timings of about 0.2 s each, in ms per call; CPU time with 1 thread."""
    clock = time.process_time if threads == 1 else time.perf_counter
    product()
    calls, start = 0, clock()
    while clock() - start < 0.05:
        product()
        calls += 1
    calls, best = max(1, calls * 4), float("inf")
    for _ in range(5):
        start = clock()
        for _ in range(calls):
            product()
        best = min(best, (clock() - start) / calls)
    return best * 1e3


def time_products(mode: str, thread_counts: list[int]) -> dict:
    """One process's timings (ms per product) for every shape at each thread count, in `mode`."""
    import torch
    import torch.nn.functional as F
    sys.path.insert(0, str(REPO))
    from pipeline.engine import mkl_cnr
    if mode == "strict":
        assert mkl_cnr.strict_matmuls().holds, mkl_cnr.current().text
    else:
        torch.ones(2, 2) @ torch.ones(2, 2)   # MKL computes first: it keeps its default mode
    out = {"mode": mkl_cnr.current().text}
    for threads in thread_counts:
        torch.set_num_threads(threads)
        for m, k, n in SHAPES:
            x, w = torch.randn(m, k), torch.randn(n, k)
            out[f"{m}x{k}->{n} t{threads}"] = _best_ms(lambda: F.linear(x, w), threads)
        for b, n, _ in BATCHED:
            x, y = torch.randn(b, n, n), torch.randn(b, n, n)
            out[f"bmm {b}x{n}x{n} t{threads}"] = _best_ms(lambda: torch.bmm(x, y), threads)
    return out


def run_e2e(mode: str, args) -> float:
    command = [sys.executable, str(REPO / "bench" / "bench_engine.py"), "cpu", "--engines", "native",
               "--models", args.models, "--n", str(args.n), "--dtype", "float32", "--threads", args.threads]
    command += ["--clock", "cpu"] if args.threads == "1" else []
    command += (["--slice", args.slice] if args.slice else []) + (["--mkl-default"] if mode == "default" else [])
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, check=True)
    tokens, rate = re.findall(r"^\| \S+ \| native \| \d+ \| (\d+) \| [\d.]+ \| ([\d,]+) \|", done.stdout, re.M)[0]
    print(f"  ({tokens} tokens)", end=" ")
    return float(rate.replace(",", ""))


def summary(values: dict[str, list[float]], higher_is_faster: bool) -> str:
    med = {mode: statistics.median(v) for mode, v in values.items()}
    fmt = "{:,.0f}" if higher_is_faster else "{:.3g}"   # tok/s or ms
    spread = {mode: f"{fmt.format(min(v))}-{fmt.format(max(v))}" for mode, v in values.items()}
    cost = (med["default"] / med["strict"] if higher_is_faster else med["strict"] / med["default"]) - 1
    return (f"{fmt.format(med['strict'])} ({spread['strict']}) | {fmt.format(med['default'])} ({spread['default']}) "
            f"| {cost:+.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["products", "e2e", "_products"])
    parser.add_argument("--mode", choices=MODES, default="strict", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=3, help="processes per mode")
    parser.add_argument("--models", default="demo", help="e2e: one of bench_engine.py's CPU models")
    parser.add_argument("--n", type=int, default=2000, help="e2e: sequences")
    parser.add_argument("--slice", default=None, help="e2e: bench_engine.py's --slice")
    parser.add_argument("--threads", default="1", help="torch threads (products: comma-separated, e.g. 1,2)")
    args = parser.parse_args()
    if args.what == "_products":
        print(json.dumps(time_products(args.mode, [int(t) for t in args.threads.split(",")])))
        return
    order = [MODES[(i // 2 + i) % 2] for i in range(2 * args.repeats)]   # strict default default strict ...
    runs: dict[str, list] = {mode: [] for mode in MODES}
    for mode in order:
        if args.what == "products":
            done = subprocess.run([sys.executable, __file__, "_products", "--mode", mode, "--threads", args.threads],
                                  capture_output=True, text=True, check=True)
            runs[mode].append(json.loads(done.stdout))
            print(mode, runs[mode][-1].pop("mode"), flush=True)
        else:
            runs[mode].append(run_e2e(mode, args))
            print(f"{mode}: {runs[mode][-1]:,.0f} tok/s", flush=True)
    if args.what == "products":
        print("\n| product | threads | strict ms (range) | default ms (range) | strict cost |")
        print("| --- | ---: | --- | --- | ---: |")
        for key in runs["strict"][0]:
            shape, threads = key.rsplit(" t", 1)
            line = summary({mode: [r[key] for r in runs[mode]] for mode in MODES}, higher_is_faster=False)
            print(f"| {shape} | {threads} | " + line + " |")
    else:
        print(f"\n{args.models}, {args.n} sequences{f' [{args.slice}]' if args.slice else ''}, {args.threads} "
              "thread(s), tok/s strict (range) | default (range) | strict cost: " + summary(runs, True))


if __name__ == "__main__":
    main()
