"""Step e2e: bin/run_shards end to end as a user runs it, on tools/make_fasta.py's 10,000 sequences (seed 1) with
an ESM-2 650M-shaped checkpoint on local disk (random bf16 weights, ESM's tokenizer files built offline):
`--gpus 1 --on-long truncate`, the native engine, then `--engine hf`. For each: the whole run's seconds (this
process's clock around the command), the run log's split (prepare, start + load, compute, finish + merge), the
worker log's shard tok/s and engine stats, and a timeline of the run log's and the worker log's lines in seconds
since the command started (where the fixed costs go: planning, the worker's start, the model's load, the merge,
the report); then how far the two results' rows agree (cosine of the mean embeddings)."""
from __future__ import annotations

import datetime
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from . import REPO
from .models import write_checkpoint
from .report import Report
from .setting import Setting

TIMINGS = re.compile(r"timings: prepare ([\d.]+) s, start workers and load model ([\d.]+) s, compute ([\d.]+) s, "
                     r"finish shards and merge ([\d.]+) s; total ([\d.]+) s")
SHARD = re.compile(r"shard complete: .*\((\d+) sequences, (\d+) tokens, ([\d.]+) s, (\d+) tok/s"
                   r"(?:; computing ([\d.]+) s, (\d+) tok/s)?\)")
ENGINE = re.compile(r"(native engine: .*)$", re.M)
LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (?:\w+ )?(?:run_shards[\w.]*: |pipeline\.[\w.]+: )?(.*)$")
QUIET = re.compile(r"checkpoint part_|^\s*\d+\s+(CPU|GPU)|per-shard summary|^shard\s+device")   # repeated lines


def one_run(setting: Setting, fasta: Path, checkpoint: Path, engine: str) -> dict:
    out = setting.scratch / f"e2e_{engine}"
    shutil.rmtree(out, ignore_errors=True)
    devices = ["--gpus", "1"] if setting.gpu else ["--gpus", "0", "--workers", "1", "--threads", "1"]
    cmd = [sys.executable, str(REPO / "bin" / "run_shards"), "run", str(fasta), "--model", str(checkpoint), *devices,
           "--on-long", "truncate", "--out", str(out), "--no-progress"] + (["--engine", "hf"] if engine == "hf" else [])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}   # workers run as in production
    if setting.smoke:
        env["RUN_SHARDS_REPORT"] = "0"   # the HTML page: not what a CPU check checks
    start, began = time.perf_counter(), time.time()
    limit = setting.seconds_left() - 5   # a run past the step's end is this row's result, not the step's kill
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO,
                             timeout=limit if limit != float("inf") else None)
    except subprocess.TimeoutExpired:   # (the run's workers end with their parent)
        return {"engine": engine, "seconds": time.perf_counter() - start, "returncode": "timeout", "out": out,
                "began": began, "error": [f"stopped after {limit:.0f} s, the time the step had left"]}
    result = {"engine": engine, "seconds": time.perf_counter() - start, "returncode": res.returncode, "out": out,
              "began": began}
    if res.returncode != 0:
        result["error"] = (res.stderr or res.stdout).strip().splitlines()[-5:]
        return result
    run_log = (out / "logs" / "run.log").read_text()
    worker_log = "\n".join(p.read_text() for p in sorted((out / "logs").glob("worker_*.log")))
    if (m := TIMINGS.search(run_log)):
        result.update(zip(("prepare", "start_load", "compute", "finish_merge", "total"), map(float, m.groups())))
    if (m := SHARD.search(worker_log)):
        result.update((k, float(v)) for k, v in zip(("sequences", "tokens", "shard_seconds", "shard_tok_s",
                                                     "computing_seconds", "computing_tok_s"), m.groups()) if v)
    if (m := ENGINE.search(worker_log)):
        result["engine_stats"] = m.group(1)
    return result


def timeline(out: Path, began: float, limit: int = 40) -> list[tuple[float, str, str]]:
    """The run log's and the worker logs' lines as (seconds since the command started, log, text), in time
    order; lines that repeat per checkpoint or per shard left out, at most `limit` (the first and the last)."""
    lines = []
    for path in [out / "logs" / "run.log", *sorted((out / "logs").glob("worker_*.log"))]:
        for text in path.read_text().splitlines():
            if (m := LOG_LINE.match(text)) and not QUIET.search(m.group(2)):
                when = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                lines.append((when - began, path.stem, m.group(2)[:110]))
    lines.sort(key=lambda line: line[0])
    return lines[:limit // 2] + lines[-(limit - limit // 2):] if len(lines) > limit else lines


def agreement(a: Path, b: Path) -> dict:
    """Cosine of each row's mean embedding between two results, and their largest absolute difference."""
    import h5py
    with h5py.File(a / "result.h5") as fa, h5py.File(b / "result.h5") as fb:
        x, y = fa["embeddings/mean"][:].astype(np.float64), fb["embeddings/mean"][:].astype(np.float64)
    cos = (x * y).sum(1) / np.maximum(np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1), 1e-30)
    return {"rows": len(x), "cosine_min": float(cos.min()), "cosine_median": float(np.median(cos)),
            "max_abs_diff": float(np.abs(x - y).max()), "max_abs_value": float(np.abs(y).max())}


def run(setting: Setting, report: Report) -> None:
    fasta = setting.scratch / "e2e.fasta"
    subprocess.run([sys.executable, str(REPO / "tools" / "make_fasta.py"), "--n", str(setting.e2e_sequences), "--seed",
                    "1", str(fasta)], check=True, capture_output=True)
    start = time.perf_counter()
    checkpoint = write_checkpoint(setting, setting.scratch / "esm2_checkpoint")
    shape = setting.esm_shape
    report.line(f"{setting.e2e_sequences:,} make_fasta.py sequences (seed 1); ESM-2 {shape['hidden_size']}-wide x "
                f"{shape['num_hidden_layers']} layers checkpoint written in {time.perf_counter() - start:.1f} s")
    t = report.table("engine", "whole run s", "prepare s", "start + load s", "compute s", "finish + merge s",
                     "shard tok/s", "computing tok/s", "engine stats")
    runs = {}
    # E2E_ENGINES="native" leaves the hf run out (a lease with little time left).
    for engine in os.environ.get("E2E_ENGINES", "native hf").split():
        done = [r["seconds"] for r in runs.values()]
        if done and setting.seconds_left() < 1.2 * max(done) + 5:
            report.line(f"{engine}: left out, {setting.seconds_left():.0f} s left in the step where the run before "
                        f"took {max(done):.0f} s")
            continue
        r = runs[engine] = one_run(setting, fasta, checkpoint, engine)
        if r["returncode"]:
            error = " / ".join(r["error"])[:300]
            t.row(engine, r["seconds"], f"FAILED (exit {r['returncode']}): {error}", "", "", "", "", "", "")
            continue
        t.row(engine, r["seconds"], r.get("prepare", "?"), r.get("start_load", "?"), r.get("compute", "?"),
              r.get("finish_merge", "?"), r.get("shard_tok_s", "?"), r.get("computing_tok_s", "?"),
              r.get("engine_stats", ""))
        report.keep(engine, {k: v for k, v in r.items() if k != "out"})
        lines = report.table(f"{engine}: s since the command started", "log", "line")
        for seconds, log, text in timeline(r["out"], r["began"]):
            lines.row(f"{seconds:.2f}", log, text.replace("|", "/"))
        lines.row(f"{r['seconds']:.2f}", "-", "the command exited (its report.html written, unless RUN_SHARDS_REPORT=0)")
        report.headline(f"e2e {engine}: {r['seconds']:.1f} s whole run (prepare {r.get('prepare', '?')} s, start + load "
                        f"{r.get('start_load', '?')} s, compute {r.get('compute', '?')} s), shard "
                        f"{r.get('shard_tok_s', 0):,.0f} tok/s, computing {r.get('computing_tok_s', 0):,.0f} tok/s")
    if set(runs) == {"native", "hf"} and all(r["returncode"] == 0 for r in runs.values()):
        a = agreement(runs["native"]["out"], runs["hf"]["out"])
        report.line(f"rows native vs hf: {a['rows']:,} rows, cosine min {a['cosine_min']:.6f}, median "
                    f"{a['cosine_median']:.6f}; largest absolute difference {a['max_abs_diff']:.3g} (values up to "
                    f"{a['max_abs_value']:.3g})")
        report.keep("agreement", a)
        report.headline(f"e2e rows native vs hf: cosine >= {a['cosine_min']:.5f}")
