"""Fast unit tests of the cluster launchers' pure parts: --array lists, splitting arrays over MaxArraySize,
the task number from each scheduler's variables, a task's shards, and the two batch scripts' text (bash
syntax, the directives the README explains, the user's --sbatch options). No cluster; the real SLURM
tests are in test_slurm_launcher.py."""
from __future__ import annotations

import logging
import os
import random
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.errors import UserError
from pipeline.launchers.sbatch_scripts import (SIGNAL_SECONDS, array_ranges, expand_ranges, merge_options,
                                               merge_script, option_groups, option_value, parse_time, shard_script,
                                               signal_seconds, split_arrays)
from pipeline.launchers.slurm import warn_if_node_local
from pipeline.launchers.slurm_queue import Task
from pipeline.launchers.work import _task_shards, shards_of_task, task_number

COMMAND = ["/opt/py env/bin/python", "/opt/run_shards/bin/run_shards"]


@pytest.mark.parametrize("tasks,expected", [
    ([0, 1, 2, 3], "0-3"),
    ([3, 17, 20, 21, 22], "3,17,20-22"),
    ([5, 2, 1, 2], "1-2,5"),
    ([7], "7"),
    ([0, 2, 4], "0,2,4"),
])
def test_array_ranges(tasks, expected):
    assert array_ranges(tasks) == expected


def _expand(ranges: str) -> list[int]:
    """The task indices an --array list names, as SLURM reads it."""
    out = []
    for part in ranges.split(","):
        a, _, b = part.partition("-")
        out += range(int(a), int(b or a) + 1)
    return out


def test_array_ranges_names_exactly_the_tasks():
    rng = random.Random(3)
    for _ in range(200):
        tasks = sorted(rng.sample(range(300), rng.randint(1, 60)))
        assert _expand(array_ranges(tasks)) == tasks == expand_ranges(array_ranges(tasks))


def test_split_arrays_over_max_array_size():
    assert split_arrays(list(range(7)), 3) == [(0, [0, 1, 2]), (3, [0, 1, 2]), (6, [0])]
    # Under MaxArraySize the indices are the task numbers (what `rerun` shows as --array=3,17).
    assert split_arrays([3, 17], 100) == [(0, [3, 17])]
    assert split_arrays([99], 100) == [(0, [99])]
    assert split_arrays([100], 100) == [(100, [0])]
    # A rerun of 1,001 tasks past the first MaxArraySize is one array, not two.
    assert split_arrays(list(range(1500, 2501)), 1001) == [(1500, list(range(1001)))]
    assert len(split_arrays(list(range(10_000)), 1001)) == 10


@pytest.mark.parametrize("max_size", [1, 2, 3, 100, 1001])
def test_split_arrays_keeps_every_index_below_the_limit_and_every_task_once(max_size):
    rng = random.Random(max_size)
    for _ in range(50):
        tasks = rng.sample(range(5000), rng.randint(1, 400))
        arrays = split_arrays(tasks, max_size)
        assert all(0 <= i < max_size for _, indices in arrays for i in indices)
        assert sorted(off + i for off, indices in arrays for i in indices) == sorted(tasks)
        offsets = [off for off, _ in arrays]
        assert offsets == sorted(set(offsets))
        # no two consecutive arrays could have been one: each starts past the reach of the one before
        for (off, indices), (next_off, next_indices) in zip(arrays, arrays[1:]):
            assert next_off + next_indices[0] - off >= max_size


@pytest.mark.parametrize("env,expected", [
    ({"SLURM_ARRAY_TASK_ID": "5"}, 5),
    ({"SLURM_ARRAY_TASK_ID": "5", "RUN_SHARDS_OFFSET": "3"}, 8),
    ({"SLURM_ARRAY_TASK_ID": "0", "RUN_SHARDS_OFFSET": ""}, 0),
    ({"PBS_ARRAY_INDEX": "2"}, 2),
    ({"PBS_ARRAYID": "4"}, 4),
    ({"LSB_JOBINDEX": "1"}, 0),                                  # LSF counts from 1
    ({"LSB_JOBINDEX": "3", "RUN_SHARDS_OFFSET": "10"}, 12),
    ({"LSB_JOBINDEX": "0"}, None),                               # LSF's value in a job that is no array
    ({"SLURM_ARRAY_TASK_ID": " ", "PBS_ARRAY_INDEX": "6"}, 6),
    ({"SLURM_ARRAY_TASK_ID": "1", "PBS_ARRAY_INDEX": "6", "LSB_JOBINDEX": "9"}, 1),
    ({}, None),
    ({"RUN_SHARDS_OFFSET": "4"}, None),
])
def test_task_number_from_each_scheduler(env, expected):
    assert task_number(env) == expected


@pytest.mark.parametrize("env,named", [
    ({"SLURM_ARRAY_TASK_ID": "x"}, "SLURM_ARRAY_TASK_ID='x' is not an array index"),
    ({"LSB_JOBINDEX": "2", "RUN_SHARDS_OFFSET": "a"}, "RUN_SHARDS_OFFSET='a' is not a number"),
])
def test_task_number_refuses_garbage_naming_the_variable(env, named):
    with pytest.raises(UserError, match=named):
        task_number(env)


def test_an_lsf_index_past_the_run_is_named_in_lsf_numbering(monkeypatch):
    """LSF numbers array elements from 1: at ca44de4 LSB_JOBINDEX=5 over 4 shards said only 'array task 4 has
    no shard ... so tasks 0..3', which reads as if 4 were in range for `bsub -J "run[1-4]"`."""
    monkeypatch.setenv("LSB_JOBINDEX", "5")
    for name in ("SLURM_ARRAY_TASK_ID", "PBS_ARRAY_INDEX", "PBS_ARRAYID", "RUN_SHARDS_OFFSET"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(UserError, match=r"array task 4 has no shard: this run has shards 0\.\.3, 1 per task, so "
                                        r"tasks 0\.\.3 \(LSB_JOBINDEX=5; LSB_JOBINDEX counts from 1, so it runs "
                                        r"1\.\.4 without RUN_SHARDS_OFFSET\)"):
        _task_shards({"world": 4, "config": {}}, None, None)
    monkeypatch.setenv("LSB_JOBINDEX", "4")
    assert _task_shards({"world": 4, "config": {}}, None, None) == [3]
    monkeypatch.delenv("LSB_JOBINDEX")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "4")
    with pytest.raises(UserError) as slurm:
        _task_shards({"world": 4, "config": {}}, None, None)
    assert str(slurm.value).endswith("so tasks 0..3")   # SLURM counts from 0: nothing to add


@pytest.mark.parametrize("task,per_task,world,expected", [
    (0, 1, 4, [0]),
    (3, 1, 4, [3]),
    (4, 1, 4, []),
    (1, 2, 7, [2, 3]),
    (3, 2, 7, [6]),          # the last task of an uneven split
    (0, 8, 3, [0, 1, 2]),
])
def test_shards_of_task(task, per_task, world, expected):
    assert shards_of_task(task, per_task, world) == expected


def _bash_syntax_ok(text: str, tmp_path: Path) -> None:
    script = tmp_path / "script.sbatch"
    script.write_text(text)
    res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def _directives(text: str) -> list[list[str]]:
    """The words of each #SBATCH line, read as sbatch reads them (shell-like quoting)."""
    return [shlex.split(line[len("#SBATCH "):]) for line in text.splitlines() if line.startswith("#SBATCH ")]


def test_shard_script_is_bash_with_the_directives_the_readme_explains(tmp_path):
    out = tmp_path / "run out"
    text = shard_script(out, COMMAND, shlex.split("--partition gpu --time=12:00:00 --comment 'two words' -A abc"),
                        shards_per_task=1, gpus_per_task=0)
    _bash_syntax_ok(text, tmp_path)
    directives = _directives(text)
    for expected in (["--requeue"], ["--open-mode=append"], [f"--signal=B:USR1@{SIGNAL_SECONDS}"],
                     [f"--output={out}/logs/slurm_%A_%a.out"], ["--partition", "gpu"], ["--time=12:00:00"],
                     ["--comment", "two words"], ["-A", "abc"]):
        assert expected in directives, (expected, directives)
    assert SIGNAL_SECONDS == 120
    assert not any("gres" in word for d in directives for word in d)   # a CPU run asks for no GPU
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    # Every directive comes before the first command, or sbatch ignores it.
    first_command = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    assert max(i for i, line in enumerate(lines) if line.startswith("#SBATCH")) < first_command
    assert """trap 'checkpoint_and_requeue USR1 "the time limit is near"' USR1""" in text
    assert """trap 'checkpoint_and_requeue TERM "the job is being stopped"' TERM""" in text
    assert 'task="${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"' in text and 'scontrol requeue "$task"' in text
    assert f"shard_command=({shlex.join(COMMAND)} work {shlex.quote(str(out))} --shards-per-task 1)" in text


@pytest.mark.parametrize("user,gres", [
    ("", ["--gres=gpu:4"]),                      # asked for by the run: one GPU per shard of the task
    ("--gres=gpu:a100:4", None),
    ("--gres gpu:4", None),
    ("-G 4", None),
    ("--gpus-per-node=4", None),
    ("--gres=nvme:1", ["--gres=gpu:4"]),         # another generic resource is no GPU
])
def test_shard_script_asks_for_gpus_unless_the_user_did(tmp_path, user, gres):
    text = shard_script(tmp_path, COMMAND, shlex.split(user), shards_per_task=4, gpus_per_task=4)
    _bash_syntax_ok(text, tmp_path)
    directives = _directives(text)
    assert (gres in directives) if gres else (["--gres=gpu:4"] not in directives)
    if user:
        assert shlex.split(user) in directives, directives   # the user's option, whole, on one line
    assert "task t computes shards 4t .. 4t+3" in text


def test_merge_script_keeps_only_who_pays_and_what_merge_sbatch_says(tmp_path):
    """The merge job is one GPU-less process: of --sbatch it keeps the account and QOS only (no --exclusive, no
    GPU, no partition or time limit meant for the shards); --merge-sbatch gives its own; its time limit
    follows the data unless --merge-sbatch sets one."""
    user = shlex.split("--partition gpu --gres gpu:1 -G 1 --cpus-per-gpu=4 --mem-per-gpu 10G --gres=nvme:1 "
                       "--array=0-3 --time 1:00:00 --account=abc --exclusive -q high")
    text = merge_script(tmp_path, COMMAND, merge_options(user, shlex.split("-p cpu --mem=8G"), 42), 1800)
    _bash_syntax_ok(text, tmp_path)
    directives = _directives(text)
    assert ["--account=abc"] in directives and ["-q", "high"] in directives
    assert ["-p", "cpu"] in directives and ["--mem=8G"] in directives and ["--time=42"] in directives
    words = [w for d in directives for w in d]
    for left_out in ("gpu", "--exclusive", "gpu:1", "-G", "--cpus-per-gpu=4", "--mem-per-gpu", "10G",
                     "--gres=nvme:1", "--array=0-3", "1:00:00"):
        assert left_out not in words, (left_out, directives)
    assert [f"--output={tmp_path}/logs/slurm_merge_%j.out"] in directives
    assert text.rstrip().endswith(f"merge {shlex.quote(str(tmp_path))} --lock-wait 1800")
    own_time = merge_options(user, ["--time=5:00"], 42)
    assert ["--time=5:00"] in own_time and ["--time=42"] not in own_time


@pytest.mark.parametrize("sbatch,seconds", [
    ("--time=1", 60), ("-t 90", 5400), ("--time 1:30", 90), ("--time=2:00:00", 7200), ("-t1-0", 86400),
    ("--time=1-2:03:04", 93784), ("--time=UNLIMITED", None), ("-p gpu", None)])
def test_time_limits_as_sbatch_reads_them(sbatch, seconds):
    given = option_value(shlex.split(sbatch), ("--time", "-t"))
    assert (parse_time(given) if given is not None else None) == seconds


def test_usr1_comes_a_tenth_of_a_short_limit_before_it(tmp_path):
    """USR1 120 s before a one-minute limit would fire at once and requeue every task: the lead follows the
    limit (a tenth of it, at least 10 s) and the script asks for exactly that."""
    assert signal_seconds(None) == SIGNAL_SECONDS == 120
    assert signal_seconds(24 * 3600) == 120 and signal_seconds(600) == 60 and signal_seconds(60) == 10
    text = shard_script(tmp_path, COMMAND, ["--time=1"], 1, 0, signal_seconds(60))
    assert ["--signal=B:USR1@10"] in _directives(text)


def test_option_groups_keep_each_option_with_its_value():
    assert option_groups(shlex.split("-p gpu --time=1:00 --exclusive --gres gpu:2 -A x")) == [
        ["-p", "gpu"], ["--time=1:00"], ["--exclusive"], ["--gres", "gpu:2"], ["-A", "x"]]


def test_out_on_a_node_local_file_system_warns(caplog):
    caplog.set_level(logging.WARNING, logger="run_shards")
    warn_if_node_local(Path("/tmp/somewhere/out"))
    warn_if_node_local(Path("/dev/shm/out"))
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and all("node-local file system" in m for m in messages)
    assert "/tmp/somewhere/out" in messages[0] and "tmpfs" in messages[1]


def test_out_on_a_disk_file_system_does_not_warn(caplog):
    shared = [fields[1] for fields in (line.split() for line in open("/proc/mounts"))
              if fields[2] in ("ext4", "xfs", "nfs", "nfs4", "lustre", "gpfs", "beegfs", "btrfs")
              and not fields[1].startswith(("/tmp", "/var/tmp", "/dev/shm"))]
    if not shared:
        pytest.skip("no disk or network file system is mounted here")
    caplog.set_level(logging.WARNING, logger="run_shards")
    warn_if_node_local(Path(shared[0]) / "project" / "out")
    assert caplog.records == []


# ------------------------------------------------------------------------------ locks, records, events, signals
def _planned(tmp_path: Path):
    from pipeline.rundir.layout import RunDir
    run = RunDir(tmp_path / "out")
    run.create()
    return run


def test_a_second_claim_on_a_shard_steps_aside_at_once_and_waits_only_for_a_stopping_holder(tmp_path):
    """One writer per shard: a second claim gets the holder's record back (the caller steps aside) within
    a couple of seconds, unless the holder is writing its final checkpoint: then it waits and takes over."""
    import threading
    import time

    from pipeline.rundir.locks import BUSY_RETRY_SECONDS, ShardLock
    run = _planned(tmp_path)
    holder = ShardLock(run, 3)
    assert holder.acquire() is None
    assert ShardLock(run, 3).held_elsewhere()
    began = time.monotonic()
    record = ShardLock(run, 3).acquire()
    assert record is not None and record["pid"] == os.getpid() and time.monotonic() - began < BUSY_RETRY_SECONDS + 2
    holder.mark_stopping()
    threading.Timer(3.0, holder.release).start()
    second = ShardLock(run, 3)
    assert second.acquire() is None          # waited for the stopping holder, then took the lock
    assert not second.holder().get("stopping") and second.holder()["pid"] == os.getpid()
    second.release()
    assert not ShardLock(run, 3).held_elsewhere()


def test_the_failure_record_says_the_reason_once(tmp_path):
    from pipeline.rundir.failure import FailureRecord
    hung = "no progress for 3 s (--worker-timeout 2); killed as hung"
    record = FailureRecord.of_exit(-9, reason=hung, killed_for=hung)
    assert record.summary().count("killed as hung") == 1
    assert record.summary() == f"killed by SIGKILL from run_shards ({hung})"
    assert FailureRecord.of_exit(75).interrupted and not FailureRecord.of_exit(1, "boom").interrupted
    assert FailureRecord.of_exit(1, "boom").summary().endswith(" - boom")
    run = _planned(tmp_path)
    run.record_failure(2, record)
    assert run.failure(2) == record
    run.failed_path(4).write_text("[1, 2]")             # damaged: read as no record, not a crash
    assert run.failure(4) is None


def test_events_survive_a_torn_last_line(tmp_path):
    from pipeline.rundir import events
    path = tmp_path / "events_0.jsonl"
    assert events.read(path) == []
    events.append(path, "start", durable=3)
    events.append(path, "checkpoint", rows=5, tokens=50, durable=8)
    with open(path, "a") as fh:
        fh.write('{"t": 1, "event": "end", "co')         # a writer killed mid-line
    got = events.read(path)
    assert [e["event"] for e in got] == ["start", "checkpoint"] and got[1]["durable"] == 8
    assert events.last(got, "start")["durable"] == 3 and events.last(got, "end") is None


def test_a_stop_signal_during_a_worker_spawn_is_not_lost():
    """The parent blocks the stop signals while it spawns a worker (it used to ignore SIGINT, dropping a
    Ctrl-C pressed then): one that arrives meanwhile reaches the handler, once, by the end of the spawn (at
    once, when another thread of the process takes it)."""
    import signal

    from pipeline.launchers.supervisor import signals_deferred
    got = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
    try:
        with signals_deferred((signal.SIGUSR1,)):
            os.kill(os.getpid(), signal.SIGUSR1)
        # (Python runs a handler at the main thread's next check for signals: where another Python thread of this
        # process, left by an earlier test, took the signal, that check may wait for the next switch of threads)
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)   # (and no second delivery)
        assert got == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_the_first_worker_of_a_process_is_spawned_with_the_stop_signals_held_back(tmp_path):
    """In a fresh parent (as each run_shards command is), the first spawn also starts Python's resource
    tracker, which unblocked SIGINT and SIGTERM in the spawning thread: the run's first worker started with
    them open, and a Ctrl-C while it imported torch killed it by SIGTERM ('killed by SIGTERM from run_shards')
    instead of its final checkpoint, while the others stopped as asked. Each spawned worker, the first too,
    starts with every stop signal blocked (until its handlers are in place: worker/entry.py)."""
    script = """
import os, signal, sys
from pipeline.launchers.supervisor import spawn_worker
from pipeline.rundir.layout import RunDir
from pipeline.worker.entry import STOP_SIGNALS
masks = []
for _ in range(2):
    spawned = spawn_worker(RunDir(sys.argv[1]), None, "0", False, 1)
    with open(f"/proc/{spawned.process.pid}/status") as f:   # (at once: the child is still starting Python)
        masks.append(int(f.read().split("SigBlk:")[1].split()[0], 16))
    os.kill(spawned.process.pid, signal.SIGKILL)
    spawned.process.join()
print(all(mask >> (sig - 1) & 1 for mask in masks for sig in STOP_SIGNALS), [hex(m) for m in masks])
"""
    res = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 0 and res.stdout.startswith("True"), res.stdout + res.stderr


@pytest.mark.parametrize("value", ["abc", "0", "-2", "4(x2)", "٣"])
def test_a_task_cpus_variable_that_is_no_count_is_named(monkeypatch, value):
    """RUN_SHARDS_TASK_CPUS (or SLURM_CPUS_ON_NODE) that is not a count was int()'s traceback in `work` ('٣'
    passed as 3); a count caps the task's CPU workers and their threads."""
    from pipeline.config import RunConfig
    from pipeline.launchers.work import _node_devices
    from pipeline.planning.devices import cpu_count
    config = RunConfig(fasta=["x"], out="o")
    for name in ("RUN_SHARDS_TASK_CPUS", "SLURM_CPUS_ON_NODE"):
        monkeypatch.delenv("RUN_SHARDS_TASK_CPUS", raising=False)
        monkeypatch.delenv("SLURM_CPUS_ON_NODE", raising=False)
        monkeypatch.setenv(name, value)
        with pytest.raises(UserError, match="^" + re.escape(f"{name}={value!r} is not a number of CPUs: set it")):
            _node_devices(config, 4)
        monkeypatch.setenv(name, "1")
        assert _node_devices(config, 4) == {"devices": [], "workers": 1, "threads_per_worker": 1}
        monkeypatch.setenv(name, "")
        assert _node_devices(config, 1)["threads_per_worker"] == cpu_count()


# squeue's job states (its manual, "JOB STATE CODES"): those in which SLURM holds the task (queued, running,
# stopped or suspended, being requeued, or ending: COMPLETING, which a requeued task passes through) and those in
# which it ended. A live one is never submitted again and --wait waits for it.
LIVE = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "STOPPED", "REQUEUED", "REQUEUE_HOLD",
        "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD", "SPECIAL_EXIT")
ENDED = ("BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
         "REVOKED", "TIMEOUT")


@pytest.mark.parametrize("state", LIVE + ENDED)
def test_every_squeue_state_is_live_or_ended(state):
    task = Task("12_3", state, restarts=1)
    assert task.live == (state in LIVE)
    assert task.ending == (state == "COMPLETING")
    assert Task("12_3", state, reason="DependencyNeverSatisfied").live is False   # the merge job that cannot run
    words = {"RUNNING": "running", "CONFIGURING": "running", "SIGNALING": "running", "STAGE_OUT": "running",
             "COMPLETING": "ending", "REQUEUED": "requeued", "REQUEUE_HOLD": "requeued", "REQUEUE_FED": "requeued",
             "PENDING": "requeued", "SUSPENDED": "suspended", "STOPPED": "stopped"}   # (PENDING after a restart)
    if state in LIVE:   # what rerun calls it when it leaves the shard out
        assert task.phase == words.get(state, "pending"), state
    assert Task("12_3", "PENDING").phase == "pending"
    if state == "COMPLETING":   # a requeue shows as this before PENDING: not called requeued, nor running
        assert not task.requeued and not task.running and task.words() == "COMPLETING, requeued 1 time(s)"


def test_an_sbatch_that_cannot_reach_the_controller_is_not_told_to_fix_its_options(tmp_path, monkeypatch):
    """SLURM's own sbatch, with no configuration to find its controller by: the refusal says where to run the
    command, not that the cluster wants a partition or an account (it said so, with no options given)."""
    import shutil

    from pipeline.launchers.slurm import SbatchRefused, _sbatch
    if shutil.which("sbatch") is None:
        from .slurm_cluster import require_slurm
        require_slurm()
        pytest.skip("SLURM's sbatch is not on PATH")
    monkeypatch.delenv("SLURM_CONF", raising=False)   # (the test cluster's configuration is only in its own env)
    script = tmp_path / "job.sbatch"
    script.write_text("#!/bin/bash\ntrue\n")
    with pytest.raises(SbatchRefused) as refused:
        _sbatch(["sbatch", "--parsable", str(script)], "", False)
    said = str(refused.value)
    assert "sbatch could not reach SLURM's controller from here" in said and "login node" in said, said
    assert "only run_shards' own options" not in said and "partition" not in said, said
