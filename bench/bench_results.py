#!/usr/bin/env python3
"""Results at scale: merge, `get` by id (cold and warm), export, and `status` over many finished shards,
on results written by the merge code from synthetic shards (no model run), with peak RSS per step.

    python bench/bench_results.py FASTA [--shards 4] [--dim 32] [--work /tmp/scale/results]
                                  [--steps merge,get,export,per-id,status] [--status-shards 10000]
                                  [--out bench/out/results.md] [--keep-shards]

FASTA: e.g. `tools/make_fasta.py --n 1000000 --min-len 20 --max-len 60`. The run directory is planned the
way `run` plans it (the index with its stride table, a manifest), then each of --shards stride shards is
written by the pipeline's own writer: the base columns and a --dim float32 embedding per row. `merge` is
`run_shards merge` (validation, the id index) beside a plain copy of the shard files (cp, then fsync).
`get` opens the result in a new process after evicting it from the page cache (posix_fadvise DONTNEED on
its files only: the machine is shared) and looks up one id (cold), then 200 random ids one at a time
(warm); beside it, what finding an id took before the id index: reading the whole ids dataset; and
`run_shards get RESULT ID` as a user runs it, a new process on the evicted result. The merge's memory is
also given as its peak anonymous RSS (sampled): mapped file pages count in RSS but the kernel drops them. `status`
builds a second run of --status-shards finished shards (their verified state recorded, as a worker does).
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

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from index import SequenceIndex  # noqa: E402
from pipeline.config import RunConfig  # noqa: E402
from pipeline.output import shard_state  # noqa: E402
from pipeline.output.h5io import Writer  # noqa: E402
from pipeline.rundir.layout import fsync_path  # noqa: E402
from pipeline.output.schema import BASE_COLUMNS, Column, RowBlock, Schema  # noqa: E402
from pipeline.rundir.layout import RunDir  # noqa: E402


def plan(fasta: Path, root: Path, shards: int, dim: int) -> tuple[RunDir, SequenceIndex]:
    index = SequenceIndex.build([fasta])
    run = RunDir(root)
    shutil.rmtree(root, ignore_errors=True)
    run.create()
    index.save(run.index_path, world=shards)
    index = SequenceIndex.load(run.index_path, verify=False)
    schema = Schema(BASE_COLUMNS + (Column("embeddings/mean", "float32", dim),))
    config = RunConfig(fasta=[str(fasta)], out=str(run.root), workers=shards)
    attrs = {"task": "embed", "model": "bench", "model_fingerprint": "bench", "dtype": "float32", "engine": "native",
             "index_fingerprint": index.fingerprint()}
    run.write_manifest({"config": json.loads(config.to_json()), "model": {"fingerprint": "bench"}, "engine": "native",
                        "schema": schema.to_json(), "max_tokens": None, "world": shards,
                        "index": {"fingerprint": index.fingerprint(), "count": len(index)}, "attrs": attrs})
    return run, index


def write_shards(run: RunDir, index: SequenceIndex, shards: int, dim: int, rows_per_block: int = 50000) -> None:
    manifest = run.read_manifest()
    schema = Schema.from_json(manifest["schema"])
    rng = np.random.default_rng(0)
    for r in range(shards):
        positions = np.sort(index.stride_shard(r, shards))
        path = run.shard_path(r)
        w = Writer(path, schema, dict(manifest["attrs"], shard=r, world=shards), rows_hint=len(positions))
        for a in range(0, len(positions), rows_per_block):
            p = positions[a:a + rows_per_block]
            lengths = np.asarray(index.lengths[p]).astype(np.int32)
            w.append(RowBlock(schema, {
                "ids": np.array([index.id_bytes(int(i)) for i in p], dtype=object), "index": p,
                "lengths": lengths, "num_tokens": lengths + 2, "truncated": np.zeros(len(p), bool),
                "status": np.zeros(len(p), np.int8),
                "sequence_digest": np.zeros((len(p), 16), np.uint8),
                "embeddings/mean": rng.standard_normal((len(p), dim), dtype=np.float32)}))
            index.release()
        w.finish()
        shard_state.record_verified(path, len(positions))


# Run first in a timed child: samples its own RssAnon (its heap: what memory bounds) and RssFile (pages of
# files it maps, which the kernel may drop) every 50 ms, and prints their peaks when it exits.
WATCH = r"""
import atexit, re as _re, threading, time as _time
_peak = {"anon": 0, "file": 0}
def _watch():
    while True:
        text = open("/proc/self/status").read()
        for key, name in (("RssAnon", "anon"), ("RssFile", "file")):
            _peak[name] = max(_peak[name], int(_re.search(key + r":\s+(\d+)", text).group(1)) * 1024)
        _time.sleep(0.05)
threading.Thread(target=_watch, daemon=True).start()
atexit.register(lambda: sys.stderr.write(f"RSS_PEAKS {_peak['anon']} {_peak['file']}\n"))
"""


def timed(code: str) -> tuple[float, int, str, dict]:
    """Wall seconds and peak RSS of a Python child (GNU time -v), niced; its stdout; its sampled peaks of
    anonymous and file-backed RSS."""
    t = time.perf_counter()
    res = subprocess.run(["/usr/bin/time", "-v", "nice", "-n", "5", sys.executable, "-c",
                          f"import sys; sys.path.insert(0, {str(REPO)!r})\n" + WATCH + code],
                         capture_output=True, text=True, env=dict(os.environ, RUN_SHARDS_REPORT="0"))
    wall = time.perf_counter() - t
    if res.returncode:
        raise SystemExit(res.stderr[-3000:])
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", res.stderr).group(1)) * 1024
    anon, file = map(int, re.search(r"RSS_PEAKS (\d+) (\d+)", res.stderr).groups())
    return wall, rss, res.stdout, {"anon": anon, "file": file}


def cold_command(path: Path, ident: str) -> float:
    """Wall seconds of `run_shards get RESULT ID` in a new process, the result evicted from the page cache
    first: what a user waits for one row."""
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    t = time.perf_counter()
    subprocess.run([sys.executable, str(REPO / "bin" / "run_shards"), "get", str(path), ident, "--format", "json"],
                   check=True, capture_output=True)
    return time.perf_counter() - t


GET = r"""
import json, os, random, time, h5py
from pipeline.output.result_reader import open_result
path = sys.argv_path
def evict(p):
    fd = os.open(p, os.O_RDONLY); os.fsync(fd); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)
evict(path)
t = time.perf_counter()
with open_result(path) as res:
    opened = time.perf_counter() - t
    ids = [x.decode() for x in res.file["ids"][[0, len(res) // 2, len(res) - 1]]]
    evict(path)
    t = time.perf_counter(); res.rows([ids[1]]); cold = time.perf_counter() - t
    t = time.perf_counter(); row = res.get(ids[1]); cold_row = time.perf_counter() - t
    rng = random.Random(1)
    sample = [res.file["ids"][rng.randrange(len(res))].decode() for _ in range(200)]
    for i in sample[:20]:
        res.get(i)
    warm, rows = [], []
    for i in sample:
        t = time.perf_counter(); res.rows([i]); warm.append(time.perf_counter() - t)
        t = time.perf_counter(); res.row(int(res.rows([i])[0])); rows.append(time.perf_counter() - t)
warm.sort(); rows.sort()
evict(path)
t = time.perf_counter()
with h5py.File(path) as f:
    allids = f["ids"][:]
    found = int((allids == ids[1].encode()).nonzero()[0][0])
scan = time.perf_counter() - t
print(json.dumps({"ids": ids, "open": opened, "cold": cold, "cold_row": cold_row, "warm_median": warm[100], "warm_p99": warm[198],
                  "row_median": rows[100], "row_p99": rows[198], "scan": scan}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("fasta")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--work", default="/tmp/scale/results")
    ap.add_argument("--steps", default="merge,get,export,per-id,status")
    ap.add_argument("--status-shards", type=int, default=10000)
    ap.add_argument("--keep-shards", action="store_true", help="merge the shards an earlier call wrote in --work")
    ap.add_argument("--out", default=str(REPO / "bench" / "out" / "results.md"))
    args = ap.parse_args()
    steps, work = args.steps.split(","), Path(args.work)
    fasta = Path(args.fasta)
    lines = []
    run = RunDir(work / "run")
    if "merge" in steps:
        t = time.perf_counter()
        if args.keep_shards and run.manifest_path.exists():   # (the shards of an earlier call, merged again)
            n = len(SequenceIndex.load(run.index_path, verify=False))
            lines.append(f"synthetic run of an earlier call: {n:,} rows, {args.shards} shards")
        else:
            run, index = plan(fasta, work / "run", args.shards, args.dim)
            write_shards(run, index, args.shards, args.dim)
            n = len(index)
            lines.append(f"synthetic run: {n:,} rows, {args.shards} shards, embeddings {args.dim} x float32, "
                         f"written in {time.perf_counter() - t:.1f} s")
        shard_bytes = sum(run.shard_path(r).stat().st_size for r in range(args.shards))
        wall, rss, _, peaks = timed(f"from pipeline.api import merge; merge({str(run.root)!r})")
        lines.append(f"| `run_shards merge` (validation, id index) | {wall:.2f} s | {shard_bytes / wall / 1e9:.3f} GB/s "
                     f"| peak RSS {rss / 2**30:.2f} GiB (anonymous {peaks['anon'] / 2**20:.0f} MiB, "
                     f"{peaks['anon'] / n:.1f} B/row; file pages {peaks['file'] / 2**20:.0f} MiB) |")
        copy = work / "copy"
        copy.mkdir(exist_ok=True)
        t = time.perf_counter()
        for r in range(args.shards):
            shutil.copyfile(run.shard_path(r), copy / f"{r}.h5")
            fsync_path(copy / f"{r}.h5")
        wall = time.perf_counter() - t
        shutil.rmtree(copy)
        lines.append(f"| plain copy of the shard files (cp + fsync) | {wall:.2f} s | {shard_bytes / wall / 1e9:.3f} GB/s | |")
        lines.append(f"| result.h5 | {run.result_path.stat().st_size / 1e9:.2f} GB | | |")
    if "get" in steps:
        wall, rss, out, _ = timed(GET.replace("sys.argv_path", repr(str(run.result_path))))
        g = json.loads(out)
        command = sorted(cold_command(run.result_path, g["ids"][k % 3]) for k in range(5))
        lines.append(f"| `run_shards get RESULT ID` in a new process, result evicted (5 runs: ids at the start, "
                     f"middle, end) | median {command[2]:.2f} s (max {command[4]:.2f}) | | |")
        lines.append(f"| reader: open (cold) | {g['open'] * 1e3:.1f} ms | id to row, cold: {g['cold'] * 1e3:.1f} ms, then "
                     f"its whole row {g['cold_row'] * 1e3:.1f} ms | warm, 200 random ids: id to row median "
                     f"{g['warm_median'] * 1e3:.2f} ms (p99 {g['warm_p99'] * 1e3:.2f}), whole row median "
                     f"{g['row_median'] * 1e3:.2f} ms (p99 {g['row_p99'] * 1e3:.2f}) |")
        lines.append(f"| before the id index: read all ids, find one | {g['scan']:.2f} s | | peak RSS of the "
                     f"process {rss / 2**30:.2f} GiB |")
    size = run.result_path.stat().st_size if run.result_path.exists() else 0
    for step, fmt in (("export", "parquet"), ("per-id", "per-id-h5")):
        if step in steps:
            target = work / f"export.{fmt}"
            wall, rss, _, _ = timed(f"from pipeline.output.export import export; export({str(run.root)!r}, {fmt!r}, "
                                 f"{str(target)!r})")
            lines.append(f"| `export --format {fmt}` | {wall:.2f} s | {size / wall / 1e9:.3f} GB/s of result.h5 | "
                         f"peak RSS {rss / 2**30:.2f} GiB; file {target.stat().st_size / 1e9:.2f} GB |")
            target.unlink()
    if "status" in steps:
        w = args.status_shards
        srun, sindex = plan(fasta, work / "status_run", w, 4)
        t = time.perf_counter()
        write_shards(srun, sindex, w, 4)
        lines.append(f"status run: {len(sindex):,} rows in {w:,} finished shards (written in {time.perf_counter() - t:.0f} s)")
        for flags in ((), ("--verify",)):
            wall, rss, out, _ = timed(f"import runpy; sys.argv = ['run_shards', 'status', {str(srun.root)!r}, *{flags!r}]; "
                                   f"runpy.run_path({str(REPO / 'bin' / 'run_shards')!r}, run_name='__main__')")
            lines.append(f"| `status` {' '.join(flags) or '(default)'} at W = {w:,} finished | {wall:.2f} s | | "
                         f"peak RSS {rss / 2**30:.2f} GiB |")
    load = os.getloadavg()
    text = "\n".join([f"{fasta.name}; {os.cpu_count()} cores, load average {load[0]:.2f} at the end (shared machine)",
                      ""] + lines)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as fh:
        fh.write(text + "\n\n")


if __name__ == "__main__":
    main()
