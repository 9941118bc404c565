"""What the SLURM tests share: reading the jobs a run submitted (jobs.json, squeue, scontrol), waiting for
them, comparing results bit for bit, and two small inputs with their local results."""
from __future__ import annotations

import html
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from .run_helpers import read, undocumented_files
from .slurm_cluster import FINISHED_STATES, LocalSlurm, poll_until
from .tiny_models import REPO, run_cli

# What a SLURM run adds to the run directory (README "On a cluster").
SLURM_LAYOUT = re.compile(r"slurm|slurm/(shards|merge)\.sbatch|slurm/jobs\.json|logs/slurm_\d+_\d+\.out|"
                          r"logs/slurm_merge_\d+\.out")
SLEEPY = {"RUN_SHARDS_FAULT_BATCH_SLEEP": "0.3"}   # slow enough to interrupt mid-shard


def assert_identical(got: dict, want: dict) -> None:
    """The same datasets with the same bits (the same shards run the same batches, whatever the thread count)."""
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert np.array_equal(got[key], value, equal_nan=value.dtype.kind == "f"), key


def stray_files(out: Path) -> list[str]:
    return [p for p in undocumented_files(out) if not SLURM_LAYOUT.fullmatch(p)]


def job_ids(stdout: str) -> tuple[list[str], str]:
    """The array job ids and the merge job id a submission printed."""
    m = re.search(r"as job array\(s\) ([\d, ]+) \(\d+ task\(s\)\); merge job (\d+)", stdout)
    assert m, stdout
    return m[1].replace(" ", "").split(","), m[2]


def queue(cluster: LocalSlurm, job: str) -> dict[str, tuple[str, str]]:
    """{job or task id: (state, node)}, finished ones too."""
    out = cluster.run("squeue", "--noheader", "--array", "--states=all", f"--jobs={job}", "--format=%i %T %N")
    return {w[0]: (w[1], w[2] if len(w) > 2 else "") for w in (line.split() for line in out.splitlines()) if w}


def wait_finished(cluster: LocalSlurm, job: str, timeout: float = 180) -> dict[str, tuple[str, str]]:
    return poll_until(lambda: (q := queue(cluster, job)) and all(s in FINISHED_STATES for s, _ in q.values()) and q,
                      timeout, f"job {job} finished", interval=0.3)


def show_job(cluster: LocalSlurm, job: str) -> str:
    return cluster.run("scontrol", "show", "job", job)


def jobs_json(out: Path) -> list[dict]:
    return json.loads((out / "slurm" / "jobs.json").read_text())


def shard_events(out: Path, rank: int, kind: str | None = None) -> list[dict]:
    """Shard `rank`'s events (OUT/logs/events_N.jsonl), or only those of one kind."""
    path = out / "logs" / f"events_{rank}.jsonl"
    found = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [e for e in found if kind is None or e["event"] == kind]


def checkpoints(out: Path, rank: int) -> list[int]:
    """Rows of every checkpoint of shard `rank`, in order."""
    return [e["rows"] for e in shard_events(out, rank, "checkpoint")]


def slurm_states(cluster: LocalSlurm, out: Path) -> dict[int, str]:
    """Each listed shard's state as `run_shards status` says it where SLURM's commands work."""
    res = run_cli("status", str(out), env=cluster.env)
    assert res.returncode == 0, res.stderr
    return {int(m[1]): m[2] for m in re.finditer(r"^(\d+)\s+(\S+)\s+[\d,]+\s+[\d,]+\s+\S+%", res.stdout, re.M)}


def html_cells(page: str, table: str) -> list[list[str]]:
    """The text of each data row's cells of report.html's table with this id."""
    body = re.search(rf"""<table id=["']{table}["'][^>]*>(.*?)</table>""", page, re.S).group(1)
    return [[html.unescape(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]
            for row in re.findall(r"<tr>(.*?)</tr>", body, re.S)][1:]


def no_traceback(res) -> None:
    assert "Traceback" not in res.stdout + res.stderr, res.stderr


@pytest.fixture(scope="session")
def small_fasta(tmp_path_factory) -> str:
    """40 short sequences: enough for 4 shards, cheap enough to run as many array tasks."""
    path = tmp_path_factory.mktemp("small") / "small.fasta"
    subprocess.run([sys.executable, str(REPO / "tools" / "make_fasta.py"), "--n", "40", "--seed", "4",
                    "--max-len", "300", str(path)], check=True, capture_output=True)
    return str(path)


@pytest.fixture(scope="session")
def small_local_four(small_fasta, common, tmp_path_factory) -> dict:
    """The local result of small_fasta in 4 shards (a shard's rows depend on its batches, hence on W)."""
    out = tmp_path_factory.mktemp("local4") / "out"
    res = run_cli(small_fasta, "--out", str(out), *common, "--shards", "4")
    assert res.returncode == 0, res.stderr
    return read(out / "result.h5")
