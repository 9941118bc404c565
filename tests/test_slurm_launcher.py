"""`--launcher slurm` on a real SLURM cluster on this machine (tests/slurm_cluster.py: two nodes of one CPU
and one fake GPU each), through the real CLI with CPU workers: shards spread over both nodes and merged by
the merge job into the local run's result, bit for bit; a cancelled task, a failed task and what `status`
and `rerun` make of them; USR1 before a time limit (checkpoint, requeue, continue); --dry-run scripts that
sbatch accepts; arrays split over MaxArraySize; `work` taking its shard from SLURM, PBS and LSF variables;
the shard lock against a second task; and the mistakes a user can make.

Without SLURM (or root) these tests skip with the reason; under CI=true they fail instead (the fixture).
"""
from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import sys

import pytest

from pipeline.launchers.slurm import QUEUE_POLL_SECONDS
from pipeline.rundir.layout import RunDir
from pipeline.rundir.locks import RunLock, ShardLock

from .run_helpers import (IMPORT_TIMES, imported, option_set, read, start, status_rows, suggested_commands,
                          wait_for)
from .slurm_cluster import LocalSlurm, require_slurm
from .slurm_helpers import (SLEEPY, assert_identical, checkpoints, html_cells, job_ids, jobs_json, no_traceback, queue,
                            shard_events, show_job, slurm_states,
                            stray_files, wait_finished)
from .tiny_models import REPO, run_cli

pytestmark = pytest.mark.slow


# ------------------------------------------------------------------------------------------------ tests
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
    assert f"merge job {merge} has not written the result (it never started: it left no log)" in status.stdout
    assert ["merge", str(out)] in suggested_commands(status.stdout)
    assert run_cli("report", str(out), env=slurm_cluster.env).returncode == 0     # the page says the same
    page = (out / "report.html").read_text()
    (job,) = html_cells(page, "slurm_jobs")
    assert job[2] == merge and job[3].startswith("CANCELLED"), job
    assert {row[2] for row in html_cells(page, "slurm_tasks")} == {"n1", "n2"}
    assert f"Next: every shard is complete: `run_shards merge {out}` writes the result" in html.unescape(page)
    merged = run_cli("merge", str(out))
    assert merged.returncode == 0, merged.stderr
    assert_identical(read(out / "result.h5"), small_local_four)
    assert stray_files(out) == []


def test_work_takes_its_shard_from_each_scheduler_and_the_merge_job_waits_for_a_merge_by_hand(
        slurm_cluster, small_fasta, common, small_local_four, tmp_path):
    """`run_shards work OUT` with no --shard: the shard(s) of SLURM_ARRAY_TASK_ID (plus RUN_SHARDS_OFFSET),
    PBS_ARRAY_INDEX or LSB_JOBINDEX (from 1), with --shards-per-task G; complete shards are skipped without
    starting a worker. `merge` refuses while a shard is being computed, naming it; the SLURM merge job waits
    for a command holding the run (`status` says that one merges) and then merges."""
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
        # where nothing is left to compute: said at once, without importing torch (a requeued array's tasks)
        res = run_cli("work", str(out), *extra, env={**env, **(IMPORT_TIMES if said else {})})
        assert res.returncode == 0, res.stderr
        if said:
            assert res.stdout.strip() == said
            assert "torch" not in imported(res.stderr)
    assert res.stdout.strip() == "shard(s) 3 complete"
    assert (out / "logs" / "worker_2.log").read_text() == log_before     # no worker started for shard 2 again
    for env, message in [({}, "no shard given: pass --shard K"),
                         ({"SLURM_ARRAY_TASK_ID": "4"}, "array task 4 has no shard: this run has shards 0..3, 1 "
                                                        "per task, so tasks 0..3"),
                         ({"LSB_JOBINDEX": "0"}, "no shard given"),                 # an LSF job that is no array
                         ({"SLURM_ARRAY_TASK_ID": "0", "--shard": "9"}, "shard 9: this run has shards 0..3")]:
        shard = ["--shard", env.pop("--shard")] if "--shard" in env else []
        res = run_cli("work", str(out), *shard, env={**env, **IMPORT_TIMES})
        assert res.returncode == 2 and message in res.stderr, (env, res.stderr)
        assert "torch" not in imported(res.stderr)
        no_traceback(res)

    # Shard 0 being computed (its lock held, as a worker holds it): `merge` names it and suggests no rerun.
    run = RunDir(out)
    busy = ShardLock(run, 0)
    assert busy.acquire() is None
    try:
        res = run_cli("merge", str(out))
        assert res.returncode == 2 and "cannot merge yet: 1 shard(s) are being computed now (shard 0 by pid" \
            in res.stderr and "rerun" not in res.stderr, res.stderr
        assert suggested_commands(res.stderr) == [["status", str(out)]] and f"run_shards merge {out}" in res.stderr
        # with --allow-partial, the merge to run once it has finished is the partial one again (other shards may
        # still be unfinished then: a plain merge was named, which refuses them)
        res = run_cli("merge", str(out), "--allow-partial")
        assert res.returncode == 2 and res.stderr.rstrip().endswith(f"run_shards merge {out} --allow-partial"), \
            res.stderr
    finally:
        busy.release()
    res = run_cli("work", str(out), "--shards-per-task", "2", env={"SLURM_ARRAY_TASK_ID": "0"})
    assert res.returncode == 0 and res.stdout.strip() == "shard(s) 0, 1 complete", res.stderr

    # The merge job finds a merge by hand holding the run: it waits for it, saying so, instead of failing.
    by_hand = RunLock(run, "merge").acquire()
    try:
        status = run_cli("status", str(out)).stdout
        assert "holds this run; it is merging the shards now" in status and "may be running" not in status
        merge = slurm_cluster.sbatch([str(out / "slurm" / "merge.sbatch")])
        merge_log = out / "logs" / f"slurm_merge_{merge}.out"
        wait_for(lambda: merge_log.exists() and "waiting for it" in merge_log.read_text(), 120, "the merge job waiting")
    finally:
        by_hand.release()
    assert wait_finished(slurm_cluster, merge)[merge][0] == "COMPLETED"
    assert "is in use by another run_shards command (pid" in merge_log.read_text()
    assert_identical(read(out / "result.h5"), small_local_four)


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


def test_usr1_and_term_to_the_batch_scripts_checkpoint_requeue_and_the_report_says_why(slurm_cluster, fasta, common,
                                                                                      reference, tmp_path):
    """USR1 to shard 0's batch shell (what --signal=B:USR1@N sends before the time limit) and TERM to shard 1's
    (`scancel --signal=TERM --batch`; preemption): each trap passes the signal on, waits for run_shards' final
    checkpoint and requeues the task, which continues from there, so the merge job runs and --wait ends with
    the result. `status` says `running` while the tasks compute and `requeued` while SLURM holds them again;
    the report names each requeue and its cause. Every row is written once."""
    out = tmp_path / "out"
    run = start(fasta, "--out", str(out), *common, "--launcher", "slurm", "--shards", "2", "--wait",
                env={**slurm_cluster.env, **SLEEPY})
    try:
        wait_for(lambda: all((out / "shards" / f"shard_{r}.parts" / "part_000000.h5").exists() for r in (0, 1)),
                 150, "both shards' first checkpoints")
        assert {r: row["state"] for r, row in status_rows(out).items()} == {0: "running", 1: "running"}
        array = jobs_json(out)[0]["arrays"][0]["job_id"]
        tasks = [f"{array}_0", f"{array}_1"]
        # Each task stays COMPLETING, its restart count raised, for longer than --wait's squeue interval:
        # SLURM requeues it only after that, so neither --wait nor rerun may take it for ended.
        with slurm_cluster.slow_epilog(QUEUE_POLL_SECONDS + 3):
            slurm_cluster.run("scancel", "--batch", "--signal=USR1", tasks[0])
            slurm_cluster.run("scancel", "--batch", "--signal=TERM", tasks[1])
            wait_for(lambda: [slurm_cluster.job_states(t).get(t) for t in tasks] == ["COMPLETING"] * 2, 60,
                     "both tasks COMPLETING")
            # (the epilogs' sleep leaves seconds for status and rerun, which each take about one)
            said = run_cli("status", str(out), env=slurm_cluster.env)
            assert "shard(s) 0-1: SLURM is ending their task(s) (COMPLETING), then requeues them" in said.stdout, \
                said.stdout
            ending = run_cli("rerun", str(out), env=slurm_cluster.env)
            assert ending.returncode == 0, ending.stderr
            assert ending.stdout.startswith("nothing submitted: shard(s) 0-1 ending in SLURM already"), ending.stdout
            assert "if they end unfinished" in ending.stdout and ["rerun", str(out)] in suggested_commands(ending.stdout)
            assert len(jobs_json(out)) == 1
            wait_for(lambda: "requeued" in slurm_states(slurm_cluster, out).values(), 60, "a task requeued")
        stdout, stderr = run.communicate(timeout=240)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, stderr
    assert stdout.strip().endswith(f"result: {out / 'result.h5'}")
    assert "Traceback" not in stderr
    assert_identical(read(out / "result.h5"), reference)
    for rank, signal_name in ((0, "USR1"), (1, "TERM")):
        assert "Restarts=1 " in show_job(slurm_cluster, f"{array}_{rank}")
        task_out = (out / "logs" / f"slurm_{array}_{rank}.out").read_text()
        assert f"{signal_name} from SLURM" in task_out and task_out.count(f"started shard {rank}") == 2   # appended
        assert "Ctrl-C" not in task_out                              # no word of a terminal in a batch log
        ends = shard_events(out, rank, "end")
        assert [e["code"] for e in ends] == [75, 0], ends          # stopped at a final checkpoint, then finished
        assert sum(checkpoints(out, rank)) == 120                   # nothing computed twice
        before = [e for e in shard_events(out, rank, "checkpoint") if e["t"] <= ends[0]["t"]]
        assert shard_events(out, rank, "start")[1]["durable"] == before[-1]["durable"] > 0   # resumed from there
    assert stray_files(out) == []

    report = run_cli("report", str(out), env=slurm_cluster.env)
    assert report.returncode == 0, report.stderr
    page = (out / "report.html").read_text()
    tasks = {int(row[0]): row for row in html_cells(page, "slurm_tasks")}
    assert tasks[0][1] == f"{array}_0" and tasks[1][1] == f"{array}_1"
    for rank in (0, 1):   # the node of each attempt: a requeued task may start again on the other node
        assert tasks[rank][2].split(", ") in (["n1"], ["n2"], ["n1", "n2"], ["n2", "n1"]), tasks[rank][2]
    assert tasks[0][4] == tasks[1][4] == "1"                                            # one requeue each
    assert "the time limit was near" in tasks[0][5] and "stopped by a SIGTERM" in tasks[1][5]
    (sub,) = html_cells(page, "slurm_jobs")
    assert sub[2] == jobs_json(out)[0]["merge_job_id"] and sub[3].startswith("merged in ")
    assert "run.log has no time split" not in page and "1 restart(s)" not in page and "2 restart(s) in all" in page


def test_dry_run_scripts_are_accepted_by_sbatch_and_arrays_split_over_max_array_size(
        small_fasta, common, small_local_four, tmp_path, tmp_path_factory):
    """A cluster with MaxArraySize=3: 4 shards are two arrays (offsets 0 and 3). --dry-run submits nothing and
    prints commands that sbatch accepts as they are (kept pending here, then cancelled), with the user's options
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

        # Pending until cancelled: the nodes drained (SBATCH_HOLD is not read by Slurm 22.05's sbatch, so the
        # array's record split as soon as its first tasks started, whenever the scheduler came first).
        nodes = f"nodename={','.join(cluster.nodes)}"
        cluster.run("scontrol", "update", nodes, "state=drain", "reason=kept_pending_by_the_test")
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
        assert f"Dependency=afterok:{first}_*" in shown and "TimeLimit=00:40:00" in shown, shown
        assert not re.search(r"gres|gpu:|Comment=two", shown), shown   # the merge job keeps no shard option
        # Submitted by hand, so run_shards holds no record of these jobs: `status` finds them by their scripts
        # (it said "nothing submitted yet; `rerun` submits them"), and `rerun` submits nothing a second time.
        queued = cluster.run("squeue", "--noheader", "--array", "--format=%i").split()
        status = run_cli("status", str(out), env=cluster.env).stdout
        assert "that run_shards did not submit" in status and f"{merge} PENDING" in status, status
        assert "nothing submitted yet" not in status and f"scancel {first} {second} {merge}" in status, status
        again = run_cli("rerun", str(out), env=cluster.env)
        assert again.returncode == 0 and again.stdout.startswith("nothing submitted (never a shard twice)"), again
        # Where squeue cannot reach the controller, those jobs cannot be seen: nothing is submitted (sbatch was
        # called before, and with a controller it would have queued every shard a second time).
        blind = run_cli("rerun", str(out))
        assert blind.returncode != 0 and "squeue gave no answer here, so whether jobs of this run are queued " \
            "already (a --dry-run's commands submitted by hand) is unknown; nothing was submitted" in blind.stderr, blind
        assert "sbatch" not in blind.stderr and ["status", str(out)] in suggested_commands(blind.stderr)
        assert cluster.run("squeue", "--noheader", "--array", "--format=%i").split() == queued
        assert run_cli("report", str(out), env=cluster.env).returncode == 0
        page = (out / "report.html").read_text()
        assert "that run_shards did not submit" in page and "Next: shards are being computed or queued" in page
        cluster.cancel_all()
        cluster.run("scontrol", "update", nodes, "state=resume")

        # sbatch refuses the second array (a per-user limit, say): the first, already submitted, is cancelled
        # with it, not left computing untracked, without a merge job (a fake sbatch before the real one on PATH).
        fake = tmp_path / "refuses_the_second_array"
        fake.mkdir()
        (fake / "sbatch").write_text(
            "#!/bin/sh\ncase \"$*\" in *RUN_SHARDS_OFFSET=3*) echo 'sbatch: error: Batch job submission failed: "
            f"Job violates accounting/QOS policy' >&2; exit 1;; esac\nexec {shutil.which('sbatch')} \"$@\"\n")
        (fake / "sbatch").chmod(0o755)
        half = run_cli(*args, env={**cluster.env, "PATH": f"{fake}:{cluster.env['PATH']}"})
        assert half.returncode == 2 and "Job violates accounting/QOS policy" in half.stderr, half.stderr
        first = re.search(r"\(job array\(s\) (\d+), already submitted, were cancelled\)", half.stderr)
        assert first, half.stderr
        assert {state for state, _ in wait_finished(cluster, first[1]).values()} == {"CANCELLED"}
        assert not (out / "slurm" / "jobs.json").exists()

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
    common = option_set(common, "--shards")   # (each case gives its own, or none)
    def refused(*args, env=None, out=tmp_path / "out"):
        res = run_cli(small_fasta, "--out", str(out), *common, *args, env=env)
        assert res.returncode == 2, res.stderr
        no_traceback(res)
        return res.stderr

    assert "Invalid value for '--launcher'" in refused("--launcher", "pbs", "--shards", "2")
    assert "Invalid value for '--shards': 0 is not in the range 1<=x<=1000000" in refused("--launcher", "slurm",
                                                                                          "--shards", "0")
    assert "--launcher slurm needs --shards W" in refused("--launcher", "slurm")
    assert not (tmp_path / "out").exists()

    message = refused("--launcher", "slurm", "--shards", "2", "--sbatch", "--partition=nosuch", env=slurm_cluster.env)
    assert "error: sbatch refused the job" in message and "invalid partition" in message.lower()
    assert slurm_cluster.run("squeue", "--noheader").strip() == ""        # nothing left queued
    assert not (tmp_path / "out" / "slurm" / "jobs.json").exists()
    status = run_cli("status", str(tmp_path / "out"), env=slurm_cluster.env).stdout
    assert "slurm: nothing submitted: sbatch refused the job" in status and "--dry-run" not in status
    assert ["rerun", str(tmp_path / "out")] in suggested_commands(status)
    # The same command with the options fixed continues the planned run with the new options (held here).
    fixed = run_cli(small_fasta, "--out", str(tmp_path / "out"), *common, "--launcher", "slurm", "--shards", "2",
                    "--sbatch", "--hold", env=slurm_cluster.env)
    assert fixed.returncode == 0, fixed.stderr
    assert "with this command's --sbatch '--hold' (was '--partition=nosuch')" in fixed.stderr
    (array,), merge = job_ids(fixed.stdout)
    assert "Reason=JobHeldUser" in show_job(slurm_cluster, array)
    slurm_cluster.cancel_all()

    # A GPU request run_shards added (--gpus 1, two shards per task: gres gpu:2, more than a node has) is no
    # option of the user's to fix; --gpus 0 on that plan would change its device kind: refused, saying so.
    assert common[2:4] == ["--gpus", "0"]
    gpus = [small_fasta, "--out", str(tmp_path / "gpu"), *common[:2], *common[4:], "--launcher", "slurm", "--shards",
            "2", "--shards-per-task", "2"]
    res = run_cli(*gpus, "--gpus", "1", env=slurm_cluster.env)
    assert res.returncode == 2 and "sbatch refused the job" in res.stderr, res.stderr
    assert "Fix the --sbatch options" not in res.stderr and "run_shards asked for a GPU per shard" in res.stderr
    res = run_cli(*gpus, "--gpus", "0", env=slurm_cluster.env)
    assert res.returncode == 2, res.stderr
    assert f"--gpus: {tmp_path / 'gpu'} holds a run planned for GPUs" in res.stderr

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

    # sbatch refuses the merge job's own options: the arrays are cancelled, and status names --merge-sbatch.
    merge_refused = refused("--launcher", "slurm", "--shards", "2", "--merge-sbatch", "--partition=nosuch",
                            out=tmp_path / "merge", env=slurm_cluster.env)
    assert "Fix the --merge-sbatch options ('--partition=nosuch')" in merge_refused
    assert "already submitted, were cancelled" in merge_refused
    status = run_cli("status", str(tmp_path / "merge"), env=slurm_cluster.env).stdout
    assert "slurm: nothing submitted: sbatch refused the job" in status
    assert '(`rerun --merge-sbatch "..."` submits with other options)' in status and "rerun --sbatch" not in status


def test_queued_shards_are_never_submitted_twice_and_a_run_has_one_merge_job(slurm_cluster, small_fasta, common,
                                                                             tmp_path):
    """Held jobs (`--sbatch --hold`): the same `run` again, and a `rerun`, submit nothing and say where things
    stand; status shows each shard `pending` with SLURM's reason, says the merge job writes the result once
    every shard is complete, and suggests no rerun. One queued task cancelled: `rerun` submits that shard
    alone and one new merge job, which also waits for the tasks still queued, and the old merge job is gone.
    All cancelled: status names the merge job as gone and gives the rerun (and the same sbatch by hand)."""
    out = tmp_path / "out"
    args = [small_fasta, "--out", str(out), *common, "--launcher", "slurm", "--shards", "3", "--sbatch", "--hold"]
    res = run_cli(*args, env=slurm_cluster.env)
    assert res.returncode == 0, res.stderr
    (array,), merge = job_ids(res.stdout)
    for again in (run_cli(*args, env=slurm_cluster.env), run_cli("rerun", str(out), env=slurm_cluster.env)):
        assert again.returncode == 0, again.stderr
        assert again.stdout.startswith(f"nothing submitted: shard(s) 0-2 pending in SLURM already (tasks {array}); "
                                       "not submitted again\n"), again.stdout
        assert f"merge job {merge} (PENDING (Dependency)) writes the result once they succeed" in again.stdout
        assert f"follow with:  run_shards status {out}" in again.stdout
    assert len(jobs_json(out)) == 1 and sorted(queue(slurm_cluster, f"{array},{merge}")) == sorted(
        [f"{array}_0", f"{array}_1", f"{array}_2", merge])
    waiting = run_cli("status", str(out), env=slurm_cluster.env)
    assert waiting.returncode == 0, waiting.stderr
    assert slurm_states(slurm_cluster, out) == {0: "pending", 1: "pending", 2: "pending"}
    assert f"SLURM task {array}_1: PENDING (JobHeldUser)" in waiting.stdout
    assert f"3 shard(s) to go; merge job {merge} writes the result once every shard is complete" in waiting.stdout
    assert "rerun" not in waiting.stdout and "\nresult: not merged yet\n" in waiting.stdout

    slurm_cluster.run("scancel", f"{array}_1")
    again = run_cli("rerun", str(out), env=slurm_cluster.env)
    assert again.returncode == 0, again.stderr
    (second,), new_merge = job_ids(again.stdout)
    assert "shard(s) 0,2 pending in SLURM already" in again.stdout
    assert [r["shards"] for r in jobs_json(out)] == [[0, 1, 2], [1]]
    live = [job for job, (state, _) in queue(slurm_cluster, f"{merge},{new_merge}").items() if state == "PENDING"]
    assert live == [new_merge]                                          # one merge job per run
    dependency = re.search(r"Dependency=(\S+)", show_job(slurm_cluster, new_merge))[1]
    assert f"afterok:{second}_*" in dependency and f"afterany:{array}_*" in dependency, dependency

    slurm_cluster.cancel_all()
    gone = run_cli("status", str(out), env=slurm_cluster.env)
    assert f"merge job {new_merge} is no longer queued, and shard(s) 0-2 are not complete" in gone.stdout
    assert f"Continue with:  run_shards rerun {out}" in gone.stdout
    assert f"sbatch --parsable --array=0-2 --export=ALL,RUN_SHARDS_OFFSET=0 {out}/slurm/shards.sbatch" in gone.stdout
    assert ["rerun", str(out)] in suggested_commands(gone.stdout)

    # A rerun with merge job options sbatch refuses: status says so after the last submission, naming the option
    # to change (a plain rerun would be refused the same way).
    refused = run_cli("rerun", str(out), "--merge-sbatch", "--partition=nosuch", env=slurm_cluster.env)
    assert refused.returncode == 2 and "already submitted, were cancelled" in refused.stderr, refused.stderr
    status = run_cli("status", str(out), env=slurm_cluster.env).stdout
    assert ("then nothing more was submitted: sbatch refused the job" in status
            and '(`rerun --merge-sbatch "..."` submits with other options)' in status), status


def test_status_of_many_shards_counts_them_and_lists_those_that_need_a_look(common, tmp_path):
    """Above 40 shards the table keeps the shards that are not complete and not pending, after a count per
    state; --all lists every shard. (A planned run of 1,200 shards, one computed, one failed; numbers with
    thousands separators throughout.)"""
    fasta = tmp_path / "many.fasta"
    subprocess.run([sys.executable, str(REPO / "tools" / "make_fasta.py"), "--n", "1200", "--seed", "5",
                    "--max-len", "40", str(fasta)], check=True, capture_output=True)
    out = tmp_path / "out"
    res = run_cli(str(fasta), "--out", str(out), *common, "--launcher", "slurm", "--shards", "1200", "--dry-run")
    assert res.returncode == 0, res.stderr
    assert run_cli("work", str(out), "--shard", "7").returncode == 0
    died = run_cli("work", str(out), "--shard", "5", env={"RUN_SHARDS_FAULT_DIE_AT": "part-written"})
    assert died.returncode != 0
    status = run_cli("status", str(out))
    assert status.returncode == 0, status.stderr
    assert "sequences: 1,200 in 1,200 shard(s)" in status.stdout
    assert (f"shards: 1 complete, 1 failed, 1,198 pending. Below: the 1 not complete and not pending; every shard: "
            f"`run_shards status {out} --all`") in status.stdout
    assert {r: row["state"] for r, row in status_rows(out).items()} == {5: "failed"}
    every = status_rows(out, "--all")
    assert sorted(every) == list(range(1200)) and every[7]["state"] == "complete" and every[0]["state"] == "pending"
    assert ["status", str(out), "--all"] in suggested_commands(status.stdout)


def test_queued_tasks_keep_their_shards_when_a_later_command_changes_shards_per_task(slurm_cluster, small_fasta,
                                                                                     common, tmp_path):
    """Three shards, one per task, held in the queue; the same run again with --shards-per-task 2 submits
    nothing (they are queued) but changes the run's setting. A held task released then computes the shard it
    was submitted for (it used to read the new grouping: task 2 became shards 4-5, which do not exist), and
    status's sbatch by hand for the others groups them as the script on disk now does."""
    out = tmp_path / "out"
    args = [small_fasta, "--out", str(out), *common, "--launcher", "slurm", "--shards", "3", "--sbatch", "--hold"]
    res = run_cli(*args, env=slurm_cluster.env)
    assert res.returncode == 0, res.stderr
    (array,), merge = job_ids(res.stdout)
    again = run_cli(*args, "--shards-per-task", "2", env=slurm_cluster.env)
    assert again.returncode == 0 and again.stdout.startswith("nothing submitted: shard(s) 0-2 pending"), again.stdout
    slurm_cluster.run("scontrol", "release", f"{array}_2")
    assert wait_finished(slurm_cluster, f"{array}_2")[f"{array}_2"][0] == "COMPLETED"
    assert "shard(s) 2 complete" in (out / "logs" / f"slurm_{array}_2.out").read_text()
    slurm_cluster.run("scancel", array, merge)
    wait_finished(slurm_cluster, array)
    status = run_cli("status", str(out), env=slurm_cluster.env)
    assert {r: row["state"] for r, row in status_rows(out).items()} == {0: "pending", 1: "pending", 2: "complete"}
    # shards 0 and 1 are task 0 of the script on disk (2 per task); task 1 would be shards 2 and 3
    assert f"ARRAY1=$(sbatch --parsable --array=0 --export=ALL,RUN_SHARDS_OFFSET=0 {out}/slurm/shards.sbatch)" \
        in status.stdout, status.stdout
