"""Step pll (optional, last): bench/bench_pll.py gpu with small arguments: pseudo-log-likelihood of an ESM-2
650M-shaped masked LM, the native engine's masked copies beside transformers' masked copies in padded batches."""
from __future__ import annotations

import re
import subprocess
import sys

from . import REPO
from .report import Report
from .setting import Setting

ARGS = ["gpu", "--n", "16", "--max-len", "200", "--slices", "2"]   # ~45 s on an H100 with the checkpoint
SMOKE_ARGS = ["cpu", "--n", "3", "--max-len", "30", "--slices", "1"]


def run(setting: Setting, report: Report) -> None:
    args = SMOKE_ARGS if setting.smoke else ARGS
    cmd = [sys.executable, str(REPO / "bench" / "bench_pll.py"), *args]
    report.line(f"`python bench/bench_pll.py {' '.join(args)}`")
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    for line in res.stdout.strip().splitlines():
        report.line(line)
    if res.returncode:
        raise SystemExit(f"bench_pll.py failed (exit {res.returncode}): {res.stderr.strip()[-600:]}")
    if (m := re.search(r"^\| native \|.*\| ([\d.]+)x \|$", res.stdout, re.M)):
        report.keep("native_vs_transformers", float(m.group(1)))
        report.headline(f"pll: native {m.group(1)}x transformers' masked copies")
