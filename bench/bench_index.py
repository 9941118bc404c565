#!/usr/bin/env python3
"""Index build on a ~1 GiB synthetic protein FASTA, beside samtools faidx and pyfaidx on the same file.

    python bench/bench_index.py [--fasta PATH] [--target-mb 1024] [--repeats 3] [--out bench/out/index.md]
                                [--huge-record-gb 3]

The FASTA (tools/make_fasta.py --target-mb 1024 --seed 1, about 2.7M records) is generated once and
reused. The file is read once before timing so every tool starts from the page cache; each tool runs
--repeats times and the median is reported. Also reported: whether every length equals samtools' .fai,
the extra pass that counts nucleotides for the alphabet check (run start, cached), loading the saved
index, and its bytes per record beside the id bytes. samtools comes from Debian (`apt-get install
samtools`), pyfaidx from PyPI (`pip install pyfaidx`); a missing one is reported as such.

--huge-record-gb N writes one N GB record (60-column lines) beside the FASTA, indexes it in a child
process, reports its time and peak RSS (VmHWM), and deletes the file.
"""
from __future__ import annotations

import argparse
import json
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
from index.alphabet import nucleotide_like  # noqa: E402


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
    ap.add_argument("--huge-record-gb", type=float, default=0, help="Also index one record this large (GB).")
    args = ap.parse_args()
    load_before = os.getloadavg()[0]   # others' work on the machine, before ours adds to it

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
    rows.append(("run_shards index build (scan, ids, duplicate check, length order, record checksums)", ours_time))

    with tempfile.TemporaryDirectory() as tmp:
        saved = Path(tmp) / "i.rsidx"
        index.save(saved)
        load_time, _ = timed(lambda: SequenceIndex.load(saved), max(args.repeats, 5))
        file_bytes = saved.stat().st_size
    id_bytes = int(index.id_offsets[-1])

    nuc_time, _ = timed(lambda: nucleotide_like(index), 1)

    samtools = shutil.which("samtools")
    same_lengths = "samtools not installed"
    if samtools:
        def faidx():
            Path(str(fasta) + ".fai").unlink(missing_ok=True)
            subprocess.run([samtools, "faidx", str(fasta)], check=True)
        t, _ = timed(faidx, args.repeats)
        version = subprocess.run([samtools, "--version"], capture_output=True).stdout.decode("utf-8", "replace").split("\n")[0]
        rows.append((f"{version} faidx", t))
        with open(str(fasta) + ".fai") as fh:
            fai = [(line.split("\t", 2)[0], int(line.split("\t", 2)[1])) for line in fh]
        same_lengths = "yes" if fai == list(zip(index.ids(), index.lengths.tolist())) else "NO"
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
        f"median of {args.repeats} runs from the page cache; load average before: {load_before:.2f}",
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
        f"| ids and lengths equal samtools' .fai | {same_lengths} |",
        f"| nucleotide counts for the alphabet check (1 run) | {nuc_time:.2f} s |",
        f"| bytes per record (file) | {file_bytes / n:.1f} |",
        f"| of which id bytes per record | {id_bytes / n:.1f} |",
        f"| bytes per record besides the ids | {(file_bytes - id_bytes) / n:.1f} |",
    ]
    if args.huge_record_gb:
        lines += ["", huge_record(fasta.parent / "huge_record.fasta", args.huge_record_gb)]
    text = "\n".join(lines)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")


def huge_record(path: Path, gigabytes: float) -> str:
    """Index one record of `gigabytes` GB in a child process: its time, peak RSS and residue count."""
    line = b"ACDEFGHIKLMNPQRSTVWY" * 3 + b"\n"
    chunk = line * ((64 << 20) // len(line))
    pieces = max(1, round(gigabytes * 1e9 / len(chunk)))
    free = shutil.disk_usage(path.parent).free
    if free < pieces * len(chunk) * 1.2:
        return f"huge record: skipped, {free / 1e9:.1f} GB free in {path.parent}"
    try:
        with open(path, "wb") as fh:
            fh.write(b">huge one record\n")
            for _ in range(pieces):
                fh.write(chunk)
        child = (f"import json, re, sys, time; sys.path.insert(0, {str(REPO)!r}); from index import SequenceIndex; "
                 f"t = time.perf_counter(); i = SequenceIndex.build([{str(path)!r}]); t = time.perf_counter() - t; "
                 "hwm = int(re.search(r'VmHWM:\\s*(\\d+)', open('/proc/self/status').read()).group(1)) * 1024; "
                 "print(json.dumps([t, hwm, int(i.lengths[0]), str(i.lengths.dtype)]))")
        out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout
        seconds, peak, residues, dtype = json.loads(out)
    finally:
        path.unlink(missing_ok=True)
    return (f"| one record of {pieces * len(chunk) / 1e9:.2f} GB ({residues:,} residues, lengths {dtype}) | "
            f"{seconds:.2f} s, peak RSS {peak / 2**20:.0f} MiB |\n| --- | --- |")


if __name__ == "__main__":
    main()
