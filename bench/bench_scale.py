#!/usr/bin/env python3
"""Planning at scale: `run_shards index`, planning a SLURM run, one array task's index load and `status`,
each in its own process, with wall time and peak RSS from /usr/bin/time -v (issue 28's table).

    python bench/bench_scale.py FASTA [--shards 1000] [--work /tmp/scale/work] [--repo CHECKOUT]
                                [--out bench/out/scale.md] [--steps index,plan,worker,status]

FASTA as in issue 28: `tools/make_fasta.py --n 20000000 --min-len 20 --max-len 60 FASTA`. --repo runs
another checkout's code (the baseline: `git archive BASE | tar -x -C DIR`). The index cache is a fresh
folder under --work, so `index` builds; `plan` (`run --launcher slurm --shards W --dry-run --gpus 0`)
then finds it cached. `worker` opens the planned run's stride of shard W/2 the way a worker does and reads
every one of its records (id, length, sequence); its peak RSS is reported beside that of the same process
before it touched the index. Run niced, one step at a time: the machine may be shared.
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

WORKER = r"""
import json, re, sys, time
sys.path.insert(0, sys.argv[1])
def hwm():
    return int(re.search(r'VmHWM:\s*(\d+)', open('/proc/self/status').read()).group(1)) * 1024
import numpy as np
from pipeline.rundir.layout import RunDir
from index import SequenceIndex
run, rank = RunDir(sys.argv[2]), int(sys.argv[3])
world = json.loads(run.manifest_path.read_text())["world"]
before = hwm()
t = time.perf_counter()
try:
    from index.shard_view import open_stride           # the mapped index (issue 28)
    index = open_stride(run.index_path, rank, world)
    positions = index.positions
except ImportError:                                  # before: the whole index in memory
    index = SequenceIndex.load(run.index_path)
    positions = index.stride_shard(rank, world)
lengths = index.lengths[positions]
load = time.perf_counter() - t
ids = [index.id_bytes(int(p)) for p in positions]
residues = sum(len(index.sequence(int(p))) for p in positions)
total = time.perf_counter() - t
print(json.dumps({"rows": len(positions), "load_s": load, "read_all_s": total, "hwm_before": before,
                  "hwm": hwm(), "residues": residues, "lengths_sum": int(lengths.sum())}))
"""


def timed(cmd: list[str], env: dict) -> dict:
    """Wall seconds and peak RSS of `cmd` (GNU time -v), niced; its stdout."""
    t = time.perf_counter()
    res = subprocess.run(["/usr/bin/time", "-v", "nice", "-n", "5", *cmd], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", res.stderr).group(1)) * 1024
    return {"seconds": wall, "peak_rss": rss, "stdout": res.stdout, "stderr": res.stderr}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("fasta")
    ap.add_argument("--shards", type=int, default=1000)
    ap.add_argument("--work", default="/tmp/scale/work")
    ap.add_argument("--repo", default=str(REPO))
    ap.add_argument("--out", default=str(REPO / "bench" / "out" / "scale.md"))
    ap.add_argument("--steps", default="index,plan,worker,status")
    args = ap.parse_args()
    steps = args.steps.split(",")
    repo, work = Path(args.repo).resolve(), Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, RUN_SHARDS_CACHE=str(work / "cache"), RUN_SHARDS_REPORT="0")
    cli = [sys.executable, str(repo / "bin" / "run_shards")]
    out = work / "run"
    rows, size = [], Path(args.fasta).stat().st_size
    if "index" in steps:
        shutil.rmtree(work / "cache", ignore_errors=True)
        r = timed(cli + ["index", args.fasta, "--workers", "4"], env)
        records = re.search(r"records: ([\d,]+)", r["stdout"]).group(1)
        rows.append(("`run_shards index` (fresh cache)", r, f"{records} records, {size / 1e9:.2f} GB"))
    if "plan" in steps:
        shutil.rmtree(out, ignore_errors=True)
        r = timed(cli + ["run", args.fasta, "--out", str(out), "--launcher", "slurm", "--shards", str(args.shards),
                         "--dry-run", "--gpus", "0", "--no-progress"], env)
        log = (out / "logs" / "run.log").read_text() if (out / "logs" / "run.log").exists() else ""
        rows.append((f"planning (`run --launcher slurm --shards {args.shards} --dry-run`)", r,
                     f"run.log {len(log.splitlines())} lines, index.rsidx {(out / 'index.rsidx').stat().st_size / 1e9:.2f} GB"))
    if "worker" in steps:
        res = subprocess.run(["nice", "-n", "5", sys.executable, "-c", WORKER, str(repo), str(out),
                              str(args.shards // 2)], capture_output=True, text=True, env=env)
        if res.returncode != 0:
            raise SystemExit(res.stderr)
        w = json.loads(res.stdout)
        rows.append((f"a worker's index: open its stride ({w['rows']:,} rows), then read each row's id and sequence",
                     {"seconds": w["read_all_s"], "peak_rss": w["hwm"]},
                     f"open {w['load_s']:.3f} s; peak RSS {(w['hwm'] - w['hwm_before']) / 2**20:.0f} MiB above "
                     f"the process before it ({w['hwm_before'] / 2**20:.0f} MiB: Python, numpy, h5py)"))
    if "status" in steps:
        r = timed(cli + ["status", str(out)], env)
        rows.append(("`status` of the planned run", r, ""))
    load = os.getloadavg()
    lines = [f"{Path(args.fasta).name}: {size / 1e9:.2f} GB; code {repo}; {os.cpu_count()} cores, load average "
             f"{load[0]:.2f} at the end (a shared machine)", "",
             "| step | seconds | peak RSS | notes |", "| --- | ---: | ---: | --- |"]
    for name, r, note in rows:
        lines.append(f"| {name} | {r['seconds']:.2f} | {r['peak_rss'] / 2**30:.2f} GiB | {note} |")
    text = "\n".join(lines)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as fh:
        fh.write(text + "\n\n")


if __name__ == "__main__":
    main()
