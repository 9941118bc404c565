"""What a scheduler admin checks of `--launcher slurm` on the real local SLURM (tests/slurm_cluster.py): a
duplicate task for a shard being computed steps aside without failing or counting as an attempt; a short
time limit needs no requeue; the merge job asks only for what a merge needs (no --exclusive, no GPU, its
own --merge-sbatch options, a time limit from the data); and a run directory that is read-only on this host
gives every command one clear error, while `status` shows SLURM's own reason for tasks that could not start.

Without SLURM (or root) these tests skip with the reason; under CI=true they fail instead (the fixture).
"""
from __future__ import annotations

import os
import re
import subprocess

import pytest

from .run_helpers import read, skip_or_fail, start, wait_for
from .slurm_helpers import (assert_identical, html_cells, job_ids, jobs_json, no_traceback, shard_events, show_job,
                            slurm_states, stray_files, wait_finished)
from .tiny_models import run_cli

pytestmark = pytest.mark.slow


def test_a_duplicate_task_steps_aside_and_a_short_time_limit_needs_no_requeue(slurm_cluster, small_fasta, common,
                                                                              small_local_four, tmp_path):
    """One shard under `--time=2 --exclusive`, each batch slowed so that the task runs past slurmctld's first
    time-limit check (the old 120 s USR1 would have fired there and requeued it). While it computes, the same
    task is submitted again by hand (a double submission): the duplicate finds the shard's lock held, says so
    and exits 0 without a worker, a log line, a failure record or an event. The merge job asks for neither
    the node nor the shards' time limit, and takes --merge-sbatch. The result is the local run's."""
    out = tmp_path / "out"
    run = start(small_fasta, "--out", str(out), *common, "--max-seqs", "5", "--checkpoint-seconds", "200",
                "--launcher", "slurm", "--shards", "1", "--wait", "--sbatch", "--time=2 --exclusive --comment=shards",
                "--merge-sbatch", "--comment=merging", env={**slurm_cluster.env, "RUN_SHARDS_FAULT_BATCH_SLEEP": "4"})
    try:
        wait_for(lambda: shard_events(out, 0, "loaded"), 150, "shard 0's model loaded")
        (array,) = [a["job_id"] for a in jobs_json(out)[0]["arrays"]]
        assert slurm_states(slurm_cluster, out) == {0: "running"}
        duplicate = slurm_cluster.sbatch(["--array=0", "--export=ALL,RUN_SHARDS_OFFSET=0",
                                          str(out / "slurm" / "shards.sbatch")])
        assert wait_finished(slurm_cluster, duplicate, 120)[f"{duplicate}_0"][0] == "COMPLETED"
        assert not (out / "shards" / "shard_0.h5").exists()        # the original was still computing
        stdout, stderr = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, stderr
    assert stdout.strip().endswith(f"result: {out / 'result.h5'}")
    assert "Traceback" not in stderr
    assert "the shard tasks' time limit (120 s) is shorter than one checkpoint interval" in stderr
    assert_identical(read(out / "result.h5"), small_local_four)

    said = (out / "logs" / f"slurm_{duplicate}_0.out").read_text()
    assert re.search(rf"shard 0 is being computed by pid \d+ on \S+, SLURM task {array}_0, since \S+; left to it",
                     said), said
    assert not (out / "shards" / "shard_0.failed.json").exists()
    assert len(shard_events(out, 0, "start")) == 1 and [e["code"] for e in shard_events(out, 0, "end")] == [0]
    assert (out / "logs" / "worker_0.log").read_text().count("started (pid ") == 1
    task = show_job(slurm_cluster, f"{array}_0")
    assert "Restarts=0 " in task and "TimeLimit=00:02:00" in task and "OverSubscribe=NO" in task
    merge = show_job(slurm_cluster, jobs_json(out)[0]["merge_job_id"])
    assert "JobState=COMPLETED" in merge and "Comment=merging" in merge and "TimeLimit=00:40:00" in merge
    assert "OverSubscribe=NO" not in merge and "gres" not in merge.lower()
    assert "--exclusive" not in (out / "slurm" / "merge.sbatch").read_text()
    assert stray_files(out) == []

    report = run_cli("report", str(out))
    assert report.returncode == 0, report.stderr
    page = (out / "report.html").read_text()
    assert [row[7] for row in html_cells(page, "shards")] == ["1"]              # one attempt: the duplicate is none
    assert "none: every attempt of every shard finished" in page


def test_a_run_directory_read_only_here_gives_each_command_one_clear_error(slurm_cluster, small_fasta, common,
                                                                           tmp_path):
    """The run directory as a node without a writable mount sees it (a bind mount remounted read-only): the
    tasks cannot start, and `status` shows SLURM's reason (JobLaunchFailure) and where to run the rerun;
    `rerun`, `merge`, `work`, the same `run` again and `report` each end with one line naming the directory
    and the cause, exit code 2, no traceback."""
    if os.geteuid() != 0:
        skip_or_fail("a read-only bind mount needs root")
    real, out = tmp_path / "real", tmp_path / "out"
    real.mkdir()
    out.mkdir()
    mounted = subprocess.run(["mount", "--bind", str(real), str(out)], capture_output=True, text=True)
    if mounted.returncode != 0:
        skip_or_fail(f"cannot bind-mount here: {mounted.stderr.strip()}")
    try:
        args = [small_fasta, "--out", str(out), *common, "--launcher", "slurm", "--shards", "2", "--sbatch", "--hold"]
        res = run_cli(*args, env=slurm_cluster.env)
        assert res.returncode == 0, res.stderr
        (array,), merge = job_ids(res.stdout)
        remount = subprocess.run(["mount", "-o", "remount,ro,bind", str(out)], capture_output=True, text=True)
        assert remount.returncode == 0, remount.stderr
        slurm_cluster.run("scontrol", "release", array)
        states = wait_finished(slurm_cluster, array)
        assert {s for s, _ in states.values()} == {"FAILED"}, states

        status = run_cli("status", str(out), env=slurm_cluster.env)
        assert status.returncode == 0, status.stderr
        assert (f"NOT WRITABLE here (a read-only file system here): rerun, merge and work must run where {out} is "
                "mounted read-write") in status.stdout
        assert f"SLURM task {array}_0: FAILED (JobLaunchFailure)" in status.stdout
        assert slurm_states(slurm_cluster, out) == {0: "failed", 1: "failed"}
        assert f"Where the run directory is writable (it is not here): Continue with:  run_shards rerun {out}" \
            in status.stdout
        for command in (["rerun", str(out)], ["merge", str(out)], ["work", str(out), "--shard", "0"], args,
                        ["report", str(out)]):
            res = run_cli(*command, env=slurm_cluster.env)
            assert res.returncode == 2, (command, res.stderr)
            no_traceback(res)
            last = res.stderr.strip().splitlines()[-1]
            assert last.startswith("error: ") and str(out) in last and "read-only file system" in last.lower(), \
                (command, res.stderr)
    finally:
        subprocess.run(["umount", str(out)], capture_output=True)
    gone = run_cli("rerun", str(tmp_path / "nowhere"))
    assert gone.returncode == 2 and f"{tmp_path / 'nowhere'}: no such run directory" in gone.stderr
    no_traceback(gone)
