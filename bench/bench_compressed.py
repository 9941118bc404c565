#!/usr/bin/env python3
"""Compressed FASTA: what indexing a .gz costs beside `gzip -dc`, and a BGZF file beside samtools faidx.

    python bench/bench_compressed.py [--target-mb 1024] [--out bench/out/compressed.md] [--keep]

A `tools/make_fasta.py` file is gzip-compressed (Python's gzip, level 6) and BGZF-compressed (Biopython's
bgzf writer, as bgzip writes it). Timed: `gzip -dc > /dev/null` on both; `run_shards index FILE.gz` with an
empty cache (decompress into the cache, then index) and again (the copy reused); the BGZF file's (read in
place) and the plain file's `run_shards index`; `samtools faidx` on the BGZF file; reading sequences the
way workers do (a stride through the length order, each record checked) from the plain file and from
BGZF; and the demo run of examples/demo.fasta from the plain file, a .gz and a BGZF file. The generated
files are deleted at the end unless --keep.
"""
from __future__ import annotations

import argparse
import gzip
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def timed(cmd: list[str], env: dict | None = None, stdout=subprocess.DEVNULL) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=stdout, stderr=subprocess.DEVNULL, env=env)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target-mb", type=int, default=1024)
    ap.add_argument("--keep", action="store_true", help="keep the generated files (several GB)")
    ap.add_argument("--work", default=str(REPO / "bench" / "out" / "compressed_work"))
    ap.add_argument("--out", default=str(REPO / "bench" / "out" / "compressed.md"))
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    plain = work / f"synthetic_{args.target_mb}mb.fasta"
    if not plain.exists():
        subprocess.run([sys.executable, str(REPO / "tools" / "make_fasta.py"), "--target-mb", str(args.target_mb),
                        "--seed", "1", str(plain)], check=True)
    gz, bgz = work / (plain.name + ".gz"), work / (plain.stem + ".bgz.fasta.gz")
    if not gz.exists():
        with open(plain, "rb") as src, gzip.open(gz, "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
    if not bgz.exists():
        from Bio import bgzf
        with open(plain, "rb") as src, bgzf.BgzfWriter(str(bgz), "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
    cache = work / "cache"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["RUN_SHARDS_CACHE"] = str(cache)
    run_shards = [sys.executable, str(REPO / "bin" / "run_shards")]
    rows = []
    size = plain.stat().st_size
    rows.append(("`gzip -dc FILE.gz > /dev/null`", timed(["gzip", "-dc", str(gz)])))
    rows.append(("`gzip -dc FILE.bgz.gz > /dev/null`", timed(["gzip", "-dc", str(bgz)])))
    shutil.rmtree(cache, ignore_errors=True)
    rows.append(("`run_shards index FILE.gz`, empty cache (decompress + index)", timed([*run_shards, "index", str(gz)], env)))
    rows.append(("`run_shards index FILE.gz` again (copy and index reused)", timed([*run_shards, "index", str(gz)], env)))
    shutil.rmtree(cache, ignore_errors=True)
    rows.append(("`run_shards index FILE` (plain, empty cache)", timed([*run_shards, "index", str(plain)], env)))
    shutil.rmtree(cache, ignore_errors=True)
    rows.append(("`run_shards index FILE.bgz.gz`, empty cache (read in place, no copy)",
                 timed([*run_shards, "index", str(bgz)], env)))
    if shutil.which("samtools"):
        for suffix in (".fai", ".gzi"):
            Path(str(bgz) + suffix).unlink(missing_ok=True)
        rows.append(("`samtools faidx FILE.bgz.gz` (reads BGZF in place)", timed(["samtools", "faidx", str(bgz)])))
    reads = [worker_reads(path, cache) for path in (plain, bgz)]
    demo = REPO / "examples" / "demo.fasta"
    demo_gz, demo_bgz = work / "demo.fasta.gz", work / "demo.bgz.fasta.gz"
    demo_gz.write_bytes(gzip.compress(demo.read_bytes()))
    from Bio import bgzf
    with bgzf.BgzfWriter(str(demo_bgz), "wb") as dst:
        dst.write(demo.read_bytes())
    for name, path in (("demo run, examples/demo.fasta", demo), ("demo run, the same as .gz", demo_gz),
                       ("demo run, the same as BGZF", demo_bgz)):
        out = work / ("demo_out_" + path.name)
        shutil.rmtree(out, ignore_errors=True)
        rows.append((name, timed([*run_shards, str(path), "--out", str(out), "--gpus", "0", "--no-progress", "-q"], env)))
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    lines = [f"Machine: {os.cpu_count()} cores, {cpu}; {time.strftime('%Y-%m-%d')}. FASTA {size / 2**20:,.0f} MiB, "
             f"gzip {gz.stat().st_size / 2**20:,.0f} MiB, BGZF {bgz.stat().st_size / 2**20:,.0f} MiB.", "",
             "| command | seconds |", "| --- | ---: |"] + [f"| {n} | {t:.2f} |" for n, t in rows]
    lines += ["", "| reading sequences as workers do (length order, stride 100, checksums checked) | records/s |",
              "| --- | ---: |"] + [f"| {name} | {rate:,.0f} |" for name, rate in reads]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


def worker_reads(path: Path, cache: Path) -> tuple[str, float]:
    """Records per second read by `SequenceIndex.sequence` (checksum checked) over every 100th record of
    the length order, the order a worker's shard takes them in: scattered over the file."""
    sys.path.insert(0, str(REPO))
    from index import load_or_build
    index, _ = load_or_build([path], cache)
    picks = index.order[::100]
    t = time.perf_counter()
    for i in picks:
        index.sequence(int(i))
    rate = len(picks) / (time.perf_counter() - t)
    index.close()
    return (f"`{path.name}` ({'BGZF, in place' if path.suffix == '.gz' else 'plain'})", rate)


if __name__ == "__main__":
    main()
