"""A local worker that has finished its shard is given the next one waiting (pipeline/launchers/supervisor.py):
more shards than workers start one process per slot and load the model once there, the rows being the bits
one process per shard computes; a shard that fails in such a process ends it, and the next shard gets a new one."""
import json
import resource
import subprocess
import sys

import pytest

from .run_helpers import env_with, log_text, raw_datasets, start, wait_for
from .tiny_models import REPO, run_cli

FASTA = ">a\nMKVLAAGLLW\n>b\nMKKLLAAGG\n>c\nMQ\n>d\nMSTNPKPQRKTKRNTNRRPQDVKFPGG\n>e\nMAAAAAAAA\n"


def start_pids(out, rank: int) -> list[int]:
    """The pid of every attempt at shard `rank`, from its `start` events."""
    lines = (out / "logs" / f"events_{rank}.jsonl").read_text().splitlines()
    return [e["pid"] for e in map(json.loads, lines) if e["event"] == "start"]


@pytest.mark.parametrize("model,engine", [("demo", "native"), ("esm", "hf")])
def test_one_worker_computes_three_shards_with_the_model_it_loaded_once(models, tmp_path, model, engine):
    """Three shards, one worker: one process computes them in turn, the model loaded once (ahead, while the run
    was planned); each shard's log says where it ran. The result is the bits of three workers' (one process per
    shard: a shard's batches are the same whichever process computes them)."""
    fasta = tmp_path / "in.fasta"
    fasta.write_text(FASTA)
    common = [str(fasta), "--model", models[model], "--engine", engine, "--gpus", "0", "--threads", "1",
              "--shards", "3", "--no-progress"]
    one, three = tmp_path / "one", tmp_path / "three"
    res = run_cli(*common, "--workers", "1", "--out", str(one))
    assert res.returncode == 0, res.stderr
    assert run_cli(*common, "--workers", "3", "--out", str(three)).returncode == 0
    (pid,) = {p for r in range(3) for p in start_pids(one, r)}
    assert len({p for r in range(3) for p in start_pids(three, r)}) == 3
    assert "using the model loaded ahead" in log_text(one, 0)
    for r in (1, 2):
        assert f"started shard {r} on CPU (pid {pid}, the worker that finished the slot's last shard)" in res.stderr
        text = log_text(one, r)
        assert f"worker for shard {r} started (pid {pid}, CPU, 1 threads; the process that computed shard {r - 1}, " \
               "its model kept)" in text, text
        assert f"using the model loaded for shard {r - 1} in this process" in text, text
        assert f"worker for shard {r - 1} ends with code 0" in log_text(one, r - 1)
    assert "worker for shard 2 ends with code 0" in log_text(one, 2)   # (what followed was the parent's kill)
    assert raw_datasets(one / "result.h5") == raw_datasets(three / "result.h5")


def test_a_shard_failing_in_a_worker_that_computed_another_leaves_the_next_to_a_new_process(models, tmp_path):
    """One worker, three shards; the worker is killed while it finishes shard 1, in the process that computed
    shard 0. Shard 0 stays finished, shard 1 is named failed (the parent writes how its process ended into its
    log), shard 2 gets a new process; `rerun` then computes shard 1 alone, and the result is the clean run's."""
    fasta = tmp_path / "in.fasta"
    fasta.write_text(FASTA)
    common = [str(fasta), "--model", models["demo"], "--gpus", "0", "--workers", "1", "--shards", "3",
              "--no-progress"]
    out, clean = tmp_path / "out", tmp_path / "clean"
    res = run_cli(*common, "--out", str(out),
                  env={"RUN_SHARDS_FAULT_DIE_AT": "shard-written", "RUN_SHARDS_FAULT_DIE_SHARD": "1"})
    assert res.returncode != 0, res.stderr
    assert "shard 1 failed: " in res.stderr and "shard 0 failed" not in res.stderr \
        and "shard 2 failed" not in res.stderr, res.stderr
    (first,), (second,), (third,) = (start_pids(out, r) for r in range(3))
    assert first == second != third
    assert f"the worker (pid {second}) ended: " in log_text(out, 1)
    assert "the process that computed shard 1" not in log_text(out, 2)
    rerun = run_cli("rerun", str(out), "--no-progress")
    assert rerun.returncode == 0, rerun.stderr
    assert [len(start_pids(out, r)) for r in range(3)] == [1, 2, 1]   # only shard 1 again
    assert run_cli(*common, "--out", str(clean)).returncode == 0
    assert raw_datasets(out / "result.h5") == raw_datasets(clean / "result.h5")


def test_a_worker_computing_many_shards_leaves_no_file_open_after_each(models, tmp_path):
    """Each shard opened the run's index and its FASTA (raw descriptors) and never closed them: harmless while a
    process computed one shard, but a worker computing many kept two more descriptors open per shard, so under
    `ulimit -n 32` its 8th or so shard failed with "Too many open files". One worker computes 16 shards here."""
    fasta = tmp_path / "in.fasta"
    fasta.write_text("".join(f">s{i}\nMKV{'LAG' * (i % 5)}{'W' * (1 + i // 5)}\n" for i in range(32)))   # (all distinct)
    out = tmp_path / "out"

    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (32, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    res = subprocess.run([sys.executable, str(REPO / "bin" / "run_shards"), str(fasta), "--model", models["demo"],
                          "--gpus", "0", "--workers", "1", "--threads", "1", "--shards", "16", "--no-progress",
                          "--out", str(out)], capture_output=True, text=True, env=env_with(RUN_SHARDS_REPORT="0"),
                         cwd=REPO, preexec_fn=limit, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert len({p for r in range(16) for p in start_pids(out, r)}) == 1   # (one process computed them all)


def test_a_shard_finished_beside_the_run_is_not_counted_as_left_to_do(models, tmp_path):
    """`run_shards work OUT --shard 2` finishes shard 2 while the run's one worker computes shards 0 and 1
    (slowly); the worker then finds shard 2 complete. The run's last summary still counted its sequences as to
    do: "10 of 15 sequences, 67%, about 5 s left at this rate" of a run that had merged every row."""
    fasta = tmp_path / "in.fasta"
    fasta.write_text("".join(f">s{i}\nMKV{'LAG' * (i % 5)}{'W' * (1 + i // 5)}\n" for i in range(15)))
    out = tmp_path / "out"
    proc = start(str(fasta), "--model", models["demo"], "--gpus", "0", "--workers", "1", "--threads", "1", "--shards",
                 "3", "--max-seqs", "1", "--no-progress", "--out", str(out),
                 env={"RUN_SHARDS_REPORT": "0", "RUN_SHARDS_FAULT_BATCH_SLEEP": "2"})
    run_log = out / "logs" / "run.log"
    # (from shard 0's start, two shards of 2-s batches, about 20 s, for `work` to finish shard 2 first)
    wait_for(lambda: run_log.exists() and "started shard 0" in run_log.read_text(), what="shard 0's start")
    work = run_cli("work", str(out), "--shard", "2")
    assert work.returncode == 0 and "shard(s) 2 complete" in work.stdout + work.stderr, work.stderr
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert "shard 2 is already complete" in log_text(out, 2)   # (the case this is about: else the timing missed)
    (*_, last) = (line for line in stderr.splitlines() if "Total: " in line)   # (the run's last summary)
    assert "(10 of 10 sequences, 100%)" in last and "left at this rate" not in last, stderr
