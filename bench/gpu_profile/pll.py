"""Step pll (optional, last): bench/bench_pll.py gpu with small arguments: pseudo-log-likelihood of an ESM-2
650M-shaped masked LM, the native engine's masked copies beside transformers' masked copies in padded batches."""
from __future__ import annotations

import re
import subprocess
import sys
import tempfile

from . import REPO
from .report import Report
from .setting import Setting

ARGS = ["gpu", "--n", "16", "--max-len", "200", "--slices", "2"]   # ~45 s on an H100 with the checkpoint
SMOKE_ARGS = ["cpu", "--n", "3", "--max-len", "30", "--slices", "1"]


def run(setting: Setting, report: Report) -> None:
    args = SMOKE_ARGS if setting.smoke else ARGS
    cmd = [sys.executable, str(REPO / "bench" / "bench_pll.py"), *args]
    report.line(f"`python bench/bench_pll.py {' '.join(args)}`")
    # Each line reported as bench_pll.py prints it: a step stopped at its limit keeps what was measured.
    with tempfile.TemporaryFile("w+") as errors:
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errors, text=True, cwd=REPO) as proc:
            lines = []
            for line in proc.stdout:
                lines.append(line)
                if line.strip():
                    report.line(line.rstrip("\n"))
        errors.seek(0)
        stderr = errors.read()
    if proc.returncode:
        raise SystemExit(f"bench_pll.py failed (exit {proc.returncode}): {stderr.strip()[-600:]}")
    if (m := re.search(r"^\| native \|.*\| ([\d.]+)x \|$", "".join(lines), re.M)):
        report.keep("native_vs_transformers", float(m.group(1)))
        report.headline(f"pll: native {m.group(1)}x transformers' masked copies")
