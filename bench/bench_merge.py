#!/usr/bin/env python3
"""Merge throughput for a ~2 GB result, beside a plain h5py copy of the same data.

    python bench/bench_merge.py [--rows 400000] [--dim 1280] [--shards 4] [--out bench/out/merge.md]

Builds a real run directory (FASTA, index, manifest) and four stride shards written by the pipeline's
own writer (rows x dim float32 embeddings plus the base columns), then times `run_shards merge`
(the library call: k-way merge into FASTA order with every validation: counts, duplicates, missing,
ids against the FASTA, checksums, fsync, atomic rename) and a plain h5py copy that reads every dataset
of every shard in 64 MiB slabs and appends it to one new file (no reordering, no checks), also fsynced.
Both read and write the same bytes from and to the same disk, with the files in the page cache.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from index import SequenceIndex  # noqa: E402
from pipeline.config import RunConfig  # noqa: E402
from pipeline.output.h5io import Writer  # noqa: E402
from pipeline.rundir.layout import fsync_path  # noqa: E402
from pipeline.output.schema import BASE_COLUMNS, Column, RowBlock, Schema  # noqa: E402
from pipeline.rundir.layout import RunDir  # noqa: E402
from pipeline.api import merge  # noqa: E402


def build_run(root: Path, rows: int, dim: int, shards: int) -> RunDir:
    fasta = root / "in.fasta"
    if not fasta.exists():
        subprocess.run([sys.executable, str(REPO / "tools" / "make_fasta.py"), "--n", str(rows), "--seed", "3",
                        "--max-len", "400", str(fasta)], check=True)
    index = SequenceIndex.build([fasta])
    run = RunDir(root / "run")
    run.create()
    index.save(run.index_path)
    schema = Schema(BASE_COLUMNS + (Column("embeddings/mean", "float32", dim),))
    config = RunConfig(fasta=[str(fasta)], out=str(run.root), workers=shards)
    attrs = {"task": "embed", "model": "bench", "model_fingerprint": "bench", "dtype": "float32", "engine": "hf",
             "index_fingerprint": index.fingerprint()}
    run.write_manifest({"config": json.loads(config.to_json()), "model": {"fingerprint": "bench"}, "engine": "hf",
                        "schema": schema.to_json(), "max_tokens": None, "world": shards,
                        "index": {"fingerprint": index.fingerprint(), "count": len(index)}, "attrs": attrs})
    rng = np.random.default_rng(0)
    blob, offs = index.id_blob.tobytes(), index.id_offsets
    for r in range(shards):
        positions = np.sort(index.stride_shard(r, shards))
        w = Writer(run.shard_path(r), schema, dict(attrs, shard=r, world=shards), rows_hint=len(positions))
        for a in range(0, len(positions), 20000):
            p = positions[a:a + 20000]
            w.append(RowBlock(schema, {
                "ids": np.array([blob[offs[i]:offs[i + 1]] for i in p], dtype=object), "index": p,
                "lengths": index.lengths[p].astype(np.int32), "num_tokens": index.lengths[p].astype(np.int32) + 2,
                "truncated": np.zeros(len(p), bool), "status": np.zeros(len(p), np.int8),
                "sequence_digest": np.zeros((len(p), 16), np.uint8),
                "embeddings/mean": rng.standard_normal((len(p), dim), dtype=np.float32)}))
        w.finish()
    return run


def plain_copy(run: RunDir, shards: int, target: Path) -> None:
    slab = 64 << 20
    with h5py.File(target, "w") as out:
        for r in range(shards):
            with h5py.File(run.shard_path(r)) as f:
                names = []
                f.visit(lambda n: names.append(n) if isinstance(f[n], h5py.Dataset) else None)
                for name in names:
                    src = f[name]
                    if name not in out:
                        out.create_dataset(name, shape=(0,) + src.shape[1:], maxshape=(None,) + src.shape[1:],
                                           dtype=src.dtype, chunks=src.chunks)
                    dst = out[name]
                    step = max(1, slab // max(1, src.dtype.itemsize * int(np.prod(src.shape[1:]) or 1)))
                    for a in range(0, len(src), step):
                        block = src[a:a + step]
                        start = len(dst)
                        dst.resize(start + len(block), axis=0)
                        dst[start:] = block
    fsync_path(target)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=400_000)
    ap.add_argument("--dim", type=int, default=1280)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", default=str(REPO / "bench" / "out" / "merge_work"))
    ap.add_argument("--out", default=str(REPO / "bench" / "out" / "merge.md"))
    args = ap.parse_args()

    root = Path(args.work)
    root.mkdir(parents=True, exist_ok=True)
    run = build_run(root, args.rows, args.dim, args.shards)
    data_bytes = sum(run.shard_path(r).stat().st_size for r in range(args.shards))
    for r in range(args.shards):   # page cache
        with open(run.shard_path(r), "rb") as fh:
            while fh.read(1 << 24):
                pass

    merge_times, copy_times = [], []
    for _ in range(args.repeats):
        run.result_path.unlink(missing_ok=True)
        t = time.perf_counter()
        merge(str(run.root))
        merge_times.append(time.perf_counter() - t)
        target = root / "copy.h5"
        t = time.perf_counter()
        plain_copy(run, args.shards, target)
        copy_times.append(time.perf_counter() - t)
        target.unlink()
    m, c = statistics.median(merge_times), statistics.median(copy_times)
    lines = [
        f"Merge of {args.shards} shards, {args.rows:,} rows x {args.dim} float32 ({data_bytes / 1e9:.2f} GB), "
        f"{os.cpu_count()} cores, files in the page cache, median of {args.repeats}",
        "",
        "| operation | seconds | GB/s | vs plain copy |",
        "| --- | ---: | ---: | ---: |",
        f"| run_shards merge (FASTA order, full validation, fsync, rename) | {m:.2f} | {data_bytes / 1e9 / m:.2f} | {c / m:.2f}x |",
        f"| plain h5py copy (concatenate shards, no checks, fsync) | {c:.2f} | {data_bytes / 1e9 / c:.2f} | 1.00x |",
    ]
    text = "\n".join(lines)
    print(text)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
