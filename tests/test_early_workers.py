"""Workers started while the parent plans (pipeline/launchers/early_workers.py): they compute the same rows as
workers started after the plan, and a worker no shard needs is gone without having written anything."""
import os
import uuid

from pipeline.launchers.early_workers import EarlyWorkers
from pipeline.launchers.supervisor import spawn_worker
from pipeline.rundir.layout import RunDir

from .run_helpers import log_text, raw_datasets, wait_for
from .tiny_models import run_cli

FASTA = ">a\nMKVLAAGLLW\n>b\nMKKLLAAGG\n>c\nMQ\n>d\nMSTNPKPQRKTKRNTNRRPQDVKFPGG\n>e\nMAAAAAAAA\n"


def _processes_tagged(tag: str) -> list[int]:
    """Live worker processes (spawned by multiprocessing, not its resource tracker) whose environment holds
    RUN_SHARDS_TEST_TAG=tag, which a command's workers inherit."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                environ = open(f"/proc/{entry}/environ", "rb").read()
                cmdline = open(f"/proc/{entry}/cmdline", "rb").read()
                state = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if f"RUN_SHARDS_TEST_TAG={tag}".encode() in environ.split(b"\0") and b"spawn_main" in cmdline \
                    and state != "Z":
                found.append(int(entry))
    return found


def test_workers_started_while_planning_compute_the_rows_of_workers_started_after(models, tmp_path):
    fasta = tmp_path / "in.fasta"
    fasta.write_text(FASTA)
    common = [str(fasta), "--model", models["demo"], "--gpus", "0", "--workers", "2", "--no-progress"]
    early = run_cli(*common, "--out", str(tmp_path / "early"))
    late = run_cli(*common, "--out", str(tmp_path / "late"), env={"RUN_SHARDS_EARLY_WORKERS": "0"})
    assert early.returncode == 0 and late.returncode == 0, early.stderr + late.stderr
    for r in (0, 1):
        assert f"started shard {r} on CPU (pid" in early.stderr
        assert "before its shard was known, while the run was planned" in log_text(tmp_path / "early", r)
        assert "before its shard was known" not in log_text(tmp_path / "late", r)
    assert early.stderr.count("a worker started while planning") == 2
    assert "a worker started while planning" not in late.stderr
    assert raw_datasets(tmp_path / "early" / "result.h5") == raw_datasets(tmp_path / "late" / "result.h5")


def test_a_refused_plan_stops_the_workers_it_started_and_leaves_no_directory(models, tmp_path):
    fasta = tmp_path / "in.fasta"
    fasta.write_text("MKV\n" + FASTA)   # sequence data before the first header: the index refuses it
    tag = uuid.uuid4().hex
    out = tmp_path / "out"
    res = run_cli(str(fasta), "--model", models["demo"], "--gpus", "0", "--workers", "2", "--out", str(out),
                  "--no-progress", env={"RUN_SHARDS_TEST_TAG": tag})
    assert res.returncode == 2 and "sequence data before the first header" in res.stderr, res.stderr
    assert not out.exists()
    assert _processes_tagged(tag) == []


def test_waiting_workers_are_killed_unused_and_a_dead_one_is_not_handed_a_shard(tmp_path, monkeypatch):
    """Two workers started for slots no shard came to: `take` of one that died returns None (its slot gets a
    worker started the usual way), `close` ends the other; neither wrote anything into the run directory."""
    tag = uuid.uuid4().hex
    monkeypatch.setenv("RUN_SHARDS_TEST_TAG", tag)
    run = RunDir(tmp_path / "out")
    run.root.mkdir()
    early = EarlyWorkers({slot: spawn_worker(run, None, slot, False, 1) for slot in ("0", "1")})
    wait_for(lambda: len(_processes_tagged(tag)) == 2, timeout=30, what="both workers' processes")   # (exec'd)
    died = early.waiting["0"].context.processes[0]
    os.kill(died.pid, 9)
    died.join(30)
    assert early.take("0", 0) is None and "0" not in early.waiting
    assert early.take("2", 0) is None   # no worker was started for that slot
    other = early.waiting["1"].context.processes[0]
    early.close()
    assert other.exitcode is not None and early.waiting == {}
    assert _processes_tagged(tag) == []
    assert list(run.root.iterdir()) == []
