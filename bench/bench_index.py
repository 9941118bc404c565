#!/usr/bin/env python3
"""Index build on a ~1 GiB synthetic protein FASTA, beside samtools faidx and pyfaidx on the same file.

    python bench/bench_index.py [--fasta PATH] [--target-mb 1024] [--repeats 3] [--out bench/out/index.md]

The FASTA (tools/make_fasta.py --target-mb 1024 --seed 1, about 2.7M records) is generated once and
reused. The file is read once before timing so every tool starts from the page cache; each tool runs
--repeats times and the median is reported. Also reported: loading the saved index, and its bytes per
record beside the id bytes. samtools comes from Debian (`apt-get install samtools`), pyfaidx from PyPI
(`pip install pyfaidx`); a missing one is reported as such.
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from index import SequenceIndex  # noqa: E402


def timed(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fasta", default=str(REPO / "bench" / "out" / "uniref_like_1g.fasta"))
    ap.add_argument("--target-mb", type=float, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "bench" / "out" / "index.md"))
    args = ap.parse_args()

    fasta = Path(args.fasta)
    if not fasta.exists():
        fasta.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, str(REPO / "tools" / "make_fasta.py"), "--target-mb", str(args.target_mb),
                        "--seed", "1", str(fasta)], check=True)
    size = fasta.stat().st_size
    with open(fasta, "rb") as fh:          # into the page cache for everyone
        while fh.read(1 << 24):
            pass

    rows = []
    ours_time, index = timed(lambda: SequenceIndex.build([fasta]), args.repeats)
    n = len(index)
    rows.append(("run_shards index build (scan, ids, duplicate check, length order)", ours_time))

    with tempfile.TemporaryDirectory() as tmp:
        saved = Path(tmp) / "i.rsidx"
        index.save(saved)
        load_time, _ = timed(lambda: SequenceIndex.load(saved), max(args.repeats, 5))
        file_bytes = saved.stat().st_size
    id_bytes = int(index.id_offsets[-1])

    samtools = shutil.which("samtools")
    if samtools:
        def faidx():
            Path(str(fasta) + ".fai").unlink(missing_ok=True)
            subprocess.run([samtools, "faidx", str(fasta)], check=True)
        t, _ = timed(faidx, args.repeats)
        version = subprocess.run([samtools, "--version"], capture_output=True).stdout.decode("utf-8", "replace").split("\n")[0]
        rows.append((f"{version} faidx", t))
    else:
        rows.append(("samtools faidx (not installed: apt-get install samtools)", float("nan")))
    try:
        import pyfaidx

        def pyfaidx_build():
            Path(str(fasta) + ".fai").unlink(missing_ok=True)
            pyfaidx.Faidx(str(fasta), rebuild=True).close()
        t, _ = timed(pyfaidx_build, 1)
        rows.append((f"pyfaidx {pyfaidx.__version__} Faidx(rebuild=True) (1 run)", t))
    except ImportError:
        rows.append(("pyfaidx (not installed: pip install pyfaidx)", float("nan")))

    cpu = platform.processor() or platform.machine()
    lines = [
        f"Index build, {size / 2**30:.2f} GiB FASTA, {n:,} records; {os.cpu_count()} cores ({cpu}), "
        f"median of {args.repeats} runs from the page cache",
        "",
        "| tool | seconds | MiB/s | vs run_shards |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, t in rows:
        lines.append(f"| {name} | {t:.2f} | {size / 2**20 / t:.0f} | {t / ours_time:.2f}x |")
    lines += [
        "",
        f"| index load ({n:,} records) | {load_time * 1000:.0f} ms |",
        "| --- | --- |",
        f"| bytes per record (file) | {file_bytes / n:.1f} |",
        f"| of which id bytes per record | {id_bytes / n:.1f} |",
        f"| bytes per record besides the ids | {(file_bytes - id_bytes) / n:.1f} |",
    ]
    text = "\n".join(lines)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
