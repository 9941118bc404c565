"""The local SLURM cluster is real: arrays spread over both nodes with a GPU each, dependencies,
requeues, signals before the time limit and cancelling one task behave as the SLURM launcher expects."""
import textwrap
from pathlib import Path

import pytest

from .slurm_cluster import LocalSlurm, SlurmError, poll_until
from .slurm_cluster import slurm_cluster, slurm_session  # noqa: F401  (fixtures)


def batch_script(folder: Path, name: str, body: str) -> str:
    path = folder / name
    path.write_text("#!/bin/bash\n" + textwrap.dedent(body))
    return str(path)


def test_array_tasks_run_on_both_nodes_each_with_a_gpu(slurm_cluster, tmp_path):
    script = batch_script(tmp_path, "task.sh", """\
        printf '%s %s %s\\n' "$SLURMD_NODENAME" "$CUDA_VISIBLE_DEVICES" "$SLURM_JOB_GPUS" \\
            > "task_$SLURM_ARRAY_TASK_ID.txt"
        sleep 1
        """)
    array = slurm_cluster.sbatch(["--array=0-3", "--gres=gpu:1", script], cwd=tmp_path)

    states = slurm_cluster.wait_for_job(array)

    assert states == {f"{array}_{task}": "COMPLETED" for task in range(4)}
    reports = {task: (tmp_path / f"task_{task}.txt").read_text().split() for task in range(4)}
    assert {node for node, _, _ in reports.values()} == {"n1", "n2"}
    assert all(cuda and job_gpus for _, cuda, job_gpus in reports.values()), reports


def test_afterok_job_runs_after_the_whole_array(slurm_cluster, tmp_path):
    task = batch_script(tmp_path, "task.sh", """\
        sleep 1
        date +%s.%N > "finished_$SLURM_ARRAY_TASK_ID"
        """)
    merge = batch_script(tmp_path, "merge.sh", "date +%s.%N > merge_started\n")
    array = slurm_cluster.sbatch(["--array=0-2", task], cwd=tmp_path)
    merge_job = slurm_cluster.sbatch([f"--dependency=afterok:{array}", "--kill-on-invalid-dep=yes",
                                      merge], cwd=tmp_path)

    assert slurm_cluster.wait_for_job(merge_job) == {merge_job: "COMPLETED"}
    last_task_end = max(float((tmp_path / f"finished_{task}").read_text()) for task in range(3))
    assert float((tmp_path / "merge_started").read_text()) > last_task_end


def test_afterok_job_is_cancelled_when_a_task_fails(slurm_cluster, tmp_path):
    task = batch_script(tmp_path, "task.sh", '[ "$SLURM_ARRAY_TASK_ID" != 1 ]\n')
    merge = batch_script(tmp_path, "merge.sh", "touch merge_ran\n")
    array = slurm_cluster.sbatch(["--array=0-2", task], cwd=tmp_path)
    merge_job = slurm_cluster.sbatch([f"--dependency=afterok:{array}", "--kill-on-invalid-dep=yes",
                                      merge], cwd=tmp_path)

    assert slurm_cluster.wait_for_job(array)[f"{array}_1"] == "FAILED"
    assert slurm_cluster.wait_for_job(merge_job) == {merge_job: "CANCELLED"}
    assert not (tmp_path / "merge_ran").exists()


def test_requeued_job_runs_again_and_sees_its_restart_count(slurm_cluster, tmp_path):
    script = batch_script(tmp_path, "job.sh", """\
        echo "${SLURM_RESTART_COUNT:-unset}" >> runs
        if [ -z "$SLURM_RESTART_COUNT" ]; then sleep 300; fi
        """)
    job = slurm_cluster.sbatch(["--requeue", script], cwd=tmp_path)
    runs = tmp_path / "runs"
    poll_until(runs.exists, 30, "first run started")

    slurm_cluster.run("scontrol", "requeue", job)

    assert slurm_cluster.wait_for_job(job, timeout=60) == {job: "COMPLETED"}
    assert runs.read_text().split() == ["unset", "1"]


def test_usr1_reaches_the_batch_shell_before_the_time_limit(slurm_cluster, tmp_path):
    # slurmctld checks time limits, and so sends --signal, every 30 s from its start, however early the
    # signal is due: due 5 s into the job (after the trap is set), it comes 5 to 35 s into it.
    script = batch_script(tmp_path, "job.sh", """\
        trap 'touch signalled; exit 0' USR1
        while true; do sleep 0.2; done
        """)
    job = slurm_cluster.sbatch(["--time=1", "--signal=B:USR1@55", script], cwd=tmp_path)

    # TIMEOUT, not COMPLETED, had the signal not come before the limit.
    assert slurm_cluster.wait_for_job(job, timeout=100) == {job: "COMPLETED"}
    assert (tmp_path / "signalled").exists()


def test_scancel_signal_reaches_the_batch_shell_at_once(slurm_cluster, tmp_path):
    # The same delivery as --signal=B:USR1 without waiting for slurmctld's time-limit check: what a
    # launcher test can use to exercise its USR1 handling quickly.
    script = batch_script(tmp_path, "job.sh", """\
        trap 'touch signalled; exit 0' USR1
        touch started
        while true; do sleep 0.2; done
        """)
    job = slurm_cluster.sbatch([script], cwd=tmp_path)
    poll_until((tmp_path / "started").exists, 30, "job started")

    slurm_cluster.run("scancel", "--batch", "--signal=USR1", job)

    assert slurm_cluster.wait_for_job(job, timeout=10) == {job: "COMPLETED"}
    assert (tmp_path / "signalled").exists()


def test_cancelling_one_array_task_leaves_the_others(slurm_cluster, tmp_path):
    script = batch_script(tmp_path, "task.sh", """\
        touch "started_$SLURM_ARRAY_TASK_ID"
        sleep 2
        touch "done_$SLURM_ARRAY_TASK_ID"
        """)
    array = slurm_cluster.sbatch(["--array=0-3", script], cwd=tmp_path)
    poll_until((tmp_path / "started_0").exists, 30, "task 0 started")

    slurm_cluster.run("scancel", f"{array}_0")

    states = slurm_cluster.wait_for_job(array)
    assert states == {f"{array}_0": "CANCELLED", **{f"{array}_{task}": "COMPLETED" for task in (1, 2, 3)}}
    assert sorted(path.name for path in tmp_path.glob("done_*")) == ["done_1", "done_2", "done_3"]


def test_second_cluster_with_its_own_max_array_size(slurm_cluster, tmp_path_factory):
    # Array indices must stay below MaxArraySize: a launcher with more shards must split its array.
    root = tmp_path_factory.mktemp("slurm")
    with LocalSlurm(root, max_array_size=3) as small:
        held = small.sbatch(["--array=0-2", "--hold", "--wrap=true"], cwd=root)
        assert len(small.job_states(held)) == 3
        with pytest.raises(SlurmError, match="Invalid job array specification"):
            small.sbatch(["--array=0-3", "--hold", "--wrap=true"], cwd=root)
    # On its own ports: shutting it down left the session's cluster running.
    assert slurm_cluster.node_states() == {"n1": "idle", "n2": "idle"}
