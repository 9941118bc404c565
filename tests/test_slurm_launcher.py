"""`--launcher slurm` on a real SLURM cluster on this machine (tests/slurm_cluster.py: two nodes of one CPU
and one fake GPU each), through the real CLI with CPU workers: shards spread over both nodes and merged by
the merge job into the local run's result, bit for bit; a cancelled task, a failed task and what `status`
and `rerun` make of them; USR1 before a time limit (checkpoint, requeue, continue); --dry-run scripts that
sbatch accepts; arrays split over MaxArraySize; `work` taking its shard from SLURM, PBS and LSF variables;
the shard lock against a second task; and the mistakes a user can make.

Without SLURM (or root) these tests skip with the reason; under CI=true they fail instead (the fixture).
"""
from __future__ import annotations

import datetime
import fcntl
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from .run_helpers import read, start, status_rows, suggested_commands, undocumented_files, wait_for
from .slurm_cluster import FINISHED_STATES, LocalSlurm, poll_until, require_slurm
from .tiny_models import REPO, run_cli

pytestmark = pytest.mark.slow

# What a SLURM run adds to the run directory (README "On a cluster").
SLURM_LAYOUT = re.compile(r"slurm|slurm/(shards|merge)\.sbatch|slurm/jobs\.json|logs/slurm_\d+_\d+\.out|"
                          r"logs/slurm_merge_\d+\.out")
SLEEPY = {"RUN_SHARDS_FAULT_BATCH_SLEEP": "0.3"}   # slow enough to interrupt mid-shard


# ------------------------------------------------------------------------------------------------ helpers
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


def checkpoints(log: str) -> list[int]:
    """Rows of every checkpoint a shard's log records, in order."""
    return [int(n) for n in re.findall(r"checkpoint part_\d+\.h5: (\d+) rows", log)]


def no_traceback(res) -> None:
    assert "Traceback" not in res.stdout + res.stderr, res.stderr


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def small_fasta(tmp_path_factory) -> str:
    """40 short sequences: enough for 4 shards, cheap enough to run as many array tasks."""
    path = tmp_path_factory.mktemp("small") / "small.fasta"
    subprocess.run([sys.executable, str(REPO / "tools" / "make_fasta.py"), "--n", "40", "--seed", "4",
                    "--max-len", "300", str(path)], check=True, capture_output=True)
    return str(path)


@pytest.fixture(scope="module")
def small_local_four(small_fasta, common, tmp_path_factory) -> dict:
    """The local result of small_fasta in 4 shards (a shard's rows depend on its batches, hence on W)."""
    out = tmp_path_factory.mktemp("local4") / "out"
    res = run_cli(small_fasta, "--out", str(out), *common, "--shards", "4")
    assert res.returncode == 0, res.stderr
    return read(out / "result.h5")


@pytest.fixture(scope="module")
def busy_shard(small_fasta, common, tmp_path_factory):
    """A planned run whose shard 1 is held by 'another task' (this process holds its lock, with the record a
    SLURM task writes), and a `run_shards work OUT --shard 1` started against it. The worker waits a minute for
    the lock before it refuses, so it is started here, first, and collected by the test at the end of the
    module: the minute passes while the other tests run."""
    require_slurm()
    out = tmp_path_factory.mktemp("busy") / "out"
    res = run_cli(small_fasta, "--out", str(out), *common, "--launcher", "slurm", "--shards", "2", "--dry-run")
    assert res.returncode == 0, res.stderr
    fd = os.open(out / "shards" / "shard_1.lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    holder = {"pid": 4242, "host": "n2", "since": datetime.datetime.now().isoformat(timespec="seconds"),
              "slurm": "77_1"}
    os.pwrite(fd, json.dumps(holder).encode(), 0)
    duplicate = start("work", str(out), "--shard", "1", env={"SLURM_ARRAY_JOB_ID": "78", "SLURM_ARRAY_TASK_ID": "1"})
    yield out, duplicate
    if duplicate.poll() is None:
        duplicate.kill()
        duplicate.wait()
    os.close(fd)


# ------------------------------------------------------------------------------------------------ tests
def test_a_second_task_for_a_shard_waits_for_its_lock_then_stops_without_computing(busy_shard):
    """Started first (see busy_shard); asserted last, below, once its minute is up."""


def test_four_shards_on_two_nodes_and_a_cancelled_merge_job(slurm_cluster, small_fasta, common, small_local_four,
                                                            tmp_path):
    """4 shards, 2 per task (--shards-per-task 2): one task on each node, 1 CPU thread each (the node's one
    CPU). The merge job is cancelled before it can run: `status` says so and names the command that
    finishes the run, which then gives the local run's result bit for bit."""
    out = tmp_path / "out"
    res = run_cli(small_fasta, "--out", str(out), *common, "--launcher", "slurm", "--shards", "4",
                  "--shards-per-task", "2", env=slurm_cluster.env)
    assert res.returncode == 0, res.stderr
    no_traceback(res)
    (array,), merge = job_ids(res.stdout)
    assert f"submitted shards 0-3 as job array(s) {array} (2 task(s)); merge job {merge}" in res.stdout
    assert f"{out} is on a node-local file system" in res.stderr     # tmp_path is under /tmp
    slurm_cluster.run("scancel", merge)
    tasks = wait_finished(slurm_cluster, array)
    assert {t: s for t, (s, _) in tasks.items()} == {f"{array}_0": "COMPLETED", f"{array}_1": "COMPLETED"}
    assert {node for _, node in tasks.values()} == {"n1", "n2"}
    assert wait_finished(slurm_cluster, merge)[merge][0] == "CANCELLED"
    for task, shards in ((0, "0, 1"), (1, "2, 3")):
        assert f"shard(s) {shards} complete" in (out / "logs" / f"slurm_{array}_{task}.out").read_text()
    for rank in range(4):
        log = (out / "logs" / f"worker_{rank}.log").read_text()
        assert log.count("started (pid ") == 1 and "1 CPU thread(s)" in log, log
    assert [r["shards"] for r in jobs_json(out)] == [[0, 1, 2, 3]]

    status = run_cli("status", str(out), env=slurm_cluster.env)
    assert status.returncode == 0, status.stderr
    assert {r: row["state"] for r, row in status_rows(out).items()} == {r: "complete" for r in range(4)}
    assert f"merge job {merge} has not written the result" in status.stdout
    assert ["merge", str(out)] in suggested_commands(status.stdout)
    merged = run_cli("merge", str(out))
    assert merged.returncode == 0, merged.stderr
    assert_identical(read(out / "result.h5"), small_local_four)
    assert stray_files(out) == []


def test_work_takes_its_shard_from_each_scheduler_and_skips_complete_shards(slurm_cluster, small_fasta, common,
                                                                             tmp_path):
    """`run_shards work OUT` with no --shard: the shard(s) of SLURM_ARRAY_TASK_ID (plus RUN_SHARDS_OFFSET),
    PBS_ARRAY_INDEX or LSB_JOBINDEX (from 1), with --shards-per-task G; complete shards are skipped without
    starting a worker."""
    out = tmp_path / "out"
    res = run_cli(small_fasta, "--out", str(out), *common, "--launcher", "slurm", "--shards", "4", "--dry-run")
    assert res.returncode == 0, res.stderr
    done = run_cli("work", str(out), env={"LSB_JOBINDEX": "3"})   # LSF's third element: shard 2
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "shard(s) 2 complete"
    assert (out / "shards" / "shard_2.h5").exists() and not (out / "shards" / "shard_3.h5").exists()
    log_before = (out / "logs" / "worker_2.log").read_text()
    for env, extra, said in [
        ({"SLURM_ARRAY_TASK_ID": "0", "RUN_SHARDS_OFFSET": "2"}, [], "shard(s) 2 already complete"),
        ({"PBS_ARRAY_INDEX": "2"}, [], "shard(s) 2 already complete"),
        ({"SLURM_ARRAY_TASK_ID": "1"}, ["--shards-per-task", "2"], None),   # shards 2 and 3: computes 3 only
    ]:
        res = run_cli("work", str(out), *extra, env=env)
        assert res.returncode == 0, res.stderr
        if said:
            assert res.stdout.strip() == said
    assert res.stdout.strip() == "shard(s) 3 complete"
    assert (out / "logs" / "worker_2.log").read_text() == log_before     # no worker started for shard 2 again
    for env, message in [({}, "no shard given: pass --shard K"),
                         ({"SLURM_ARRAY_TASK_ID": "4"}, "array task 4 has no shard: this run has shards 0..3, 1 "
                                                        "per task, so tasks 0..3"),
                         ({"LSB_JOBINDEX": "0"}, "no shard given"),                 # an LSF job that is no array
                         ({"SLURM_ARRAY_TASK_ID": "0", "--shard": "9"}, "shard 9: this run has shards 0..3")]:
        shard = ["--shard", env.pop("--shard")] if "--shard" in env else []
        res = run_cli("work", str(out), *shard, env=env)
        assert res.returncode == 2 and message in res.stderr, (env, res.stderr)
        no_traceback(res)


def test_a_cancelled_task_then_a_failed_one_status_names_them_and_rerun_resubmits_only_that_shard(
        slurm_cluster, fasta, common, reference, tmp_path):
    out = tmp_path / "out"
    res = run_cli(fasta, "--out", str(out), *common, "--launcher", "slurm", "--shards", "2",
                  env={**slurm_cluster.env, **SLEEPY})
    assert res.returncode == 0, res.stderr
    (array,), merge = job_ids(res.stdout)
    wait_for(lambda: (out / "shards" / "shard_1.parts" / "part_000000.h5").exists(), 150, "shard 1's first checkpoint")
    slurm_cluster.run("scancel", f"{array}_1")
    states = wait_finished(slurm_cluster, array)
    assert (states[f"{array}_0"][0], states[f"{array}_1"][0]) == ("COMPLETED", "CANCELLED")
    assert wait_finished(slurm_cluster, merge)[merge][0] == "CANCELLED"   # afterok can never be met

    status = run_cli("status", str(out), env=slurm_cluster.env)
    assert status.returncode == 0, status.stderr
    rows = status_rows(out)
    assert rows[0]["state"] == "complete" and rows[1]["state"] == "interrupted" and 0 < rows[1]["durable"] < 120
    assert "shard 1 was interrupted" in status.stdout and "received SIGTERM" in status.stdout
    assert f"so merge job {merge} cannot run" in status.stdout
    assert f"Continue with:  run_shards rerun {out}" in status.stdout
    assert (f"ARRAY1=$(sbatch --parsable --array=1 --export=ALL,RUN_SHARDS_OFFSET=0 {out}/slurm/shards.sbatch); "
            f"sbatch --parsable --dependency=afterok:$ARRAY1 --kill-on-invalid-dep=yes {out}/slurm/merge.sbatch"
            ) in status.stdout
    assert ["rerun", str(out)] in suggested_commands(status.stdout)
    blind = run_cli("status", str(out))        # where squeue cannot reach the controller: both cases said
    assert "squeue gave no answer here, so whether SLURM requeues them is unknown" in blind.stdout
    assert f"one that was cancelled is not: then continue with:  run_shards rerun {out}" in blind.stdout
    durable = rows[1]["durable"]

    # The resubmitted task dies (SIGKILL while writing its first checkpoint): --wait names it, and so does status.
    failed = run_cli("rerun", str(out), "--wait", "--no-progress",
                     env={**slurm_cluster.env, "RUN_SHARDS_FAULT_DIE_AT": "part-written"})
    assert failed.returncode == 1, failed.stderr
    no_traceback(failed)
    assert "shard 1 failed: killed by SIGKILL" in failed.stderr
    assert "cannot run now" in failed.stderr and f"Continue with:  run_shards rerun {out}" in failed.stderr
    second = jobs_json(out)[-1]
    assert second["shards"] == [1] and [a["array"] for a in second["arrays"]] == ["1"]
    status = run_cli("status", str(out), env=slurm_cluster.env)
    assert status_rows(out)[1]["state"] == "failed"
    assert "shard 1 failed: killed by SIGKILL" in status.stdout
    assert f"so merge job {second['merge_job_id']} cannot run" in status.stdout

    # Resubmitted with other sbatch options (a longer time limit), which later reruns keep.
    done = run_cli("rerun", str(out), "--wait", "--no-progress", "--sbatch", "--time=30", env=slurm_cluster.env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith(f"result: {out / 'result.h5'}")
    third = jobs_json(out)[-1]
    assert third["shards"] == [1]
    assert "TimeLimit=00:30:00" in show_job(slurm_cluster, f"{third['arrays'][0]['job_id']}_1")
    assert json.loads((out / "manifest.json").read_text())["config"]["sbatch"] == "--time=30"
    assert set(queue(slurm_cluster, third["arrays"][0]["job_id"])) == {f"{third['arrays'][0]['job_id']}_1"}
    assert_identical(read(out / "result.h5"), reference)
    log = (out / "logs" / "worker_1.log").read_text()
    assert f"120 sequences, {120 - durable} to do" in log          # the cancelled task's checkpoints were kept
    assert (out / "logs" / "worker_0.log").read_text().count("started (pid ") == 1
    assert stray_files(out) == []


def test_usr1_before_the_time_limit_checkpoints_requeues_and_the_task_continues(slurm_cluster, fasta, common,
                                                                                 reference, tmp_path):
    """USR1 to the batch shell (what --signal=B:USR1@120 sends before the time limit): the trap asks run_shards
    for a final checkpoint and requeues the task, which continues from there; --wait follows it to the
    merged result. Every row is written once: nothing computed before the signal is computed again."""
    out = tmp_path / "out"
    run = start(fasta, "--out", str(out), *common, "--launcher", "slurm", "--shards", "2", "--wait",
                env={**slurm_cluster.env, **SLEEPY})
    try:
        wait_for(lambda: (out / "shards" / "shard_0.parts" / "part_000000.h5").exists(), 150,
                 "shard 0's first checkpoint")
        array = jobs_json(out)[0]["arrays"][0]["job_id"]
        slurm_cluster.run("scancel", "--batch", "--signal=USR1", f"{array}_0")
        stdout, stderr = run.communicate(timeout=240)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, stderr
    assert stdout.strip().endswith(f"result: {out / 'result.h5'}")
    assert "Traceback" not in stderr
    assert_identical(read(out / "result.h5"), reference)
    assert "Restarts=1 " in show_job(slurm_cluster, f"{array}_0")
    task_out = (out / "logs" / f"slurm_{array}_0.out").read_text()
    assert "USR1 from SLURM" in task_out and task_out.count("started shard 0") == 2   # appended, not overwritten
    log = (out / "logs" / "worker_0.log").read_text()
    interrupted = re.search(r"interrupted \(received SIGTERM\): (\d+) of 120 sequences durable", log)
    assert interrupted, log
    assert f"120 sequences, {120 - int(interrupted[1])} to do" in log
    assert sum(checkpoints(log)) == 120, checkpoints(log)
    assert stray_files(out) == []


def test_dry_run_scripts_are_accepted_by_sbatch_and_arrays_split_over_max_array_size(
        small_fasta, common, small_local_four, tmp_path, tmp_path_factory):
    """A cluster with MaxArraySize=3: 4 shards are two arrays (offsets 0 and 3). --dry-run submits nothing and
    prints commands that sbatch accepts as they are (held here, then cancelled), with the user's options
    (a value with a space, one given apart from its option, a GPU request the merge job leaves out);
    the real submission merges to the local result; more tasks than MaxJobCount are refused before sbatch."""
    require_slurm()
    options = "--gres gpu:1 --comment 'two words' --time 10"
    with LocalSlurm(tmp_path_factory.mktemp("s"), max_array_size=3, max_job_count=20) as cluster:
        out = tmp_path / "out"
        args = [small_fasta, "--out", str(out), *common, "--launcher", "slurm", "--shards", "4", "--sbatch", options]
        dry = run_cli(*args, "--dry-run", env=cluster.env)
        assert dry.returncode == 0, dry.stderr
        lines = dry.stdout.splitlines()
        assert lines[0].startswith(f"wrote {out}/slurm/shards.sbatch") and "nothing was submitted" in lines[0]
        assert lines[1:] == [
            f"  ARRAY1=$(sbatch --parsable --array=0-2 --export=ALL,RUN_SHARDS_OFFSET=0 {out}/slurm/shards.sbatch)",
            f"  ARRAY2=$(sbatch --parsable --array=0 --export=ALL,RUN_SHARDS_OFFSET=3 {out}/slurm/shards.sbatch)",
            f"  sbatch --parsable --dependency=afterok:$ARRAY1:$ARRAY2 --kill-on-invalid-dep=yes "
            f"{out}/slurm/merge.sbatch"]
        assert cluster.run("squeue", "--noheader").strip() == "" and not (out / "slurm" / "jobs.json").exists()
        assert "slurm: nothing submitted yet" in run_cli("status", str(out)).stdout

        script = "set -e\n" + "\n".join(line.strip() for line in lines[1:]) + '\necho "$ARRAY1 $ARRAY2"\n'
        submitted = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                                   env={**cluster.env, "SBATCH_HOLD": "1"})
        assert submitted.returncode == 0, submitted.stderr
        merge = submitted.stdout.split()[0]
        first, second = submitted.stdout.split()[1:]
        shown = show_job(cluster, f"{first}_0")
        assert "Comment=two words" in shown and "TimeLimit=00:10:00" in shown
        assert re.search(r"gres[:/]gpu:1", shown), shown          # TresPerNode=gres:gpu:1 (gres/gpu:1 in newer SLURM)
        assert "ArrayTaskId=0-2" in show_job(cluster, first) and "ArrayTaskId=0" in show_job(cluster, second)
        shown = show_job(cluster, merge)
        assert f"Dependency=afterok:{first}_*" in shown and "gpu" not in shown and "TimeLimit=00:10:00" in shown
        cluster.cancel_all()

        res = run_cli(*args, "--wait", env=cluster.env)
        assert res.returncode == 0, res.stderr
        record = jobs_json(out)[-1]
        assert [(a["offset"], a["array"]) for a in record["arrays"]] == [(0, "0-2"), (3, "0")]
        assert "shard(s) 3 complete" in (out / "logs" / f"slurm_{record['arrays'][1]['job_id']}_0.out").read_text()
        assert_identical(read(out / "result.h5"), small_local_four)
        assert stray_files(out) == []

        # More tasks than the controller holds (MaxJobCount, every array task counting): refused before any
        # sbatch, with the --shards-per-task that fits.
        many = run_cli(small_fasta, "--out", str(tmp_path / "many"), *common, "--launcher", "slurm", "--shards",
                       "24", env=cluster.env)
        assert many.returncode == 2 and "Traceback" not in many.stderr, many.stderr
        assert ("24 array tasks and a merge job are more than this cluster's controller holds (MaxJobCount = 20; "
                "every array task counts as one job). Put more shards in each task: --shards-per-task 3") in many.stderr
        assert not (tmp_path / "many" / "slurm" / "jobs.json").exists()


def test_user_mistakes_get_one_clear_line(slurm_cluster, small_fasta, common, tmp_path):
    def refused(*args, env=None):
        res = run_cli(small_fasta, "--out", str(tmp_path / "out"), *common, *args, env=env)
        assert res.returncode == 2, res.stderr
        no_traceback(res)
        return res.stderr

    assert "Invalid value for '--launcher'" in refused("--launcher", "pbs", "--shards", "2")
    assert "Invalid value for '--shards': 0 is not in the range x>=1" in refused("--launcher", "slurm", "--shards", "0")
    assert "--launcher slurm needs --shards W" in refused("--launcher", "slurm")
    assert not (tmp_path / "out").exists()

    message = refused("--launcher", "slurm", "--shards", "2", "--sbatch", "--partition=nosuch", env=slurm_cluster.env)
    assert "error: sbatch refused the job" in message and "invalid partition" in message.lower()
    assert slurm_cluster.run("squeue", "--noheader").strip() == ""        # nothing left queued
    assert not (tmp_path / "out" / "slurm" / "jobs.json").exists()
    # The same command with the options fixed continues the planned run with the new options (held here).
    fixed = run_cli(small_fasta, "--out", str(tmp_path / "out"), *common, "--launcher", "slurm", "--shards", "2",
                    "--sbatch", "--hold", env=slurm_cluster.env)
    assert fixed.returncode == 0, fixed.stderr
    assert "with this command's --sbatch '--hold' (was '--partition=nosuch')" in fixed.stderr
    (array,), merge = job_ids(fixed.stdout)
    assert "Reason=JobHeldUser" in show_job(slurm_cluster, array)
    slurm_cluster.cancel_all()

    bare = tmp_path / "no_slurm"     # a PATH without SLURM's commands (this machine has them in /usr/bin)
    bare.mkdir()
    env = {"PATH": str(bare)}
    message = refused("--launcher", "slurm", "--shards", "2", env=env)
    assert "--launcher slurm needs SLURM's sbatch, which is not on PATH" in message and "--dry-run" in message
    res = run_cli(small_fasta, "--out", str(tmp_path / "out"), *common, "--launcher", "slurm", "--shards", "2",
                  "--dry-run", env=env)
    assert res.returncode == 0, res.stderr                 # --dry-run works where SLURM is not installed
    assert "node-local file system" in res.stderr and str(tmp_path / "out") in res.stderr
    assert "--array=0-1" in res.stdout


def test_status_while_the_jobs_wait_and_after_they_were_cancelled_before_starting(slurm_cluster, small_fasta,
                                                                                  common, tmp_path):
    """Held jobs (`--sbatch --hold`): status says the merge job writes the result once every shard is
    complete, and does not suggest a rerun that would submit the queued shards twice. Cancelled before any
    task started: status names the merge job as gone and gives the rerun (and the same sbatch by hand)."""
    out = tmp_path / "out"
    res = run_cli(small_fasta, "--out", str(out), *common, "--launcher", "slurm", "--shards", "3",
                  "--sbatch", "--hold", env=slurm_cluster.env)
    assert res.returncode == 0, res.stderr
    (array,), merge = job_ids(res.stdout)
    waiting = run_cli("status", str(out), env=slurm_cluster.env)
    assert waiting.returncode == 0, waiting.stderr
    assert f"3 shard(s) to go; merge job {merge} writes the result once every shard is complete" in waiting.stdout
    assert "rerun" not in waiting.stdout and "\nresult: not merged yet\n" in waiting.stdout
    slurm_cluster.run("scancel", array, merge)
    wait_finished(slurm_cluster, merge)
    gone = run_cli("status", str(out), env=slurm_cluster.env)
    assert f"merge job {merge} is no longer queued, and shard(s) 0-2 are not complete" in gone.stdout
    assert f"Continue with:  run_shards rerun {out}" in gone.stdout
    assert f"sbatch --parsable --array=0-2 --export=ALL,RUN_SHARDS_OFFSET=0 {out}/slurm/shards.sbatch" in gone.stdout
    assert ["rerun", str(out)] in suggested_commands(gone.stdout)


def test_status_of_many_shards_counts_them_and_lists_those_that_need_a_look(fasta, common, tmp_path):
    """Above 40 shards the table keeps the shards that are not complete and not pending, after a count per
    state; --all lists every shard. (A planned run of 60 shards, one computed, one failed.)"""
    out = tmp_path / "out"
    res = run_cli(fasta, "--out", str(out), *common, "--launcher", "slurm", "--shards", "60", "--dry-run")
    assert res.returncode == 0, res.stderr
    assert run_cli("work", str(out), "--shard", "7").returncode == 0
    died = run_cli("work", str(out), "--shard", "5", env={"RUN_SHARDS_FAULT_DIE_AT": "part-written"})
    assert died.returncode != 0
    status = run_cli("status", str(out))
    assert status.returncode == 0, status.stderr
    assert (f"shards: 1 complete, 1 failed, 58 pending. Below: the 1 not complete and not pending; every shard: "
            f"`run_shards status {out} --all`") in status.stdout
    assert {r: row["state"] for r, row in status_rows(out).items()} == {5: "failed"}
    every = status_rows(out, "--all")
    assert sorted(every) == list(range(60)) and every[7]["state"] == "complete" and every[0]["state"] == "pending"
    assert ["status", str(out), "--all"] in suggested_commands(status.stdout)


def test_the_second_task_stopped_without_computing_the_busy_shard(busy_shard):
    """The other half of the first test: `work --shard 1` waited a minute for the lock that 'SLURM task 77_1'
    holds, then stopped with a message naming that holder, computing nothing."""
    out, duplicate = busy_shard
    stdout, stderr = duplicate.communicate(timeout=150)
    assert duplicate.returncode == 2, stderr
    assert "shard 1 is being computed by pid 4242 on n2, SLURM task 77_1" in stderr
    assert "it is not computed twice" in stderr
    assert "Traceback" not in stderr
    assert not (out / "shards" / "shard_1.h5").exists()
    assert not list((out / "shards").glob("shard_1.parts/part_*.h5"))
    assert "to do" not in (out / "logs" / "worker_1.log").read_text()   # it never got to planning batches
