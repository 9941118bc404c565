"""`--launcher ray` against a real Ray on this machine, through the real CLI: one task per shard, a killed
Ray worker retried from the shard's checkpoints, the result the same as a local run's, and a clear error
without Ray.

Ray is the optional extra `run_shards[ray]`; without it these tests skip with the reason, and fail under
CI=true, whose install (the Makefile's) includes it.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from .run_helpers import (assert_same, env_with, log_text, read, skip_or_fail, start, suggested_commands,
                          undocumented_files, wait_for)
from .tiny_models import REPO, run_cli

# A Ray head with declared resources: 2 CPUs, no GPU, whatever this machine has; it lives until its stdin
# closes. Token authentication with a token of the test's own (Ray versions without it ignore the variables).
HEAD = """
import sys, ray
ray.init(num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False)
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()
ray.shutdown()
"""


@pytest.fixture(scope="module")
def ray_installed() -> None:
    """First among a test's fixtures, so that a missing Ray skips before anything is computed."""
    try:
        import ray  # noqa: F401
    except ImportError as e:
        skip_or_fail(f"ray is not installed ({e}); install the extra: .venv/bin/pip install -e '.[ray]'")


@pytest.fixture(scope="module")
def ray_auth() -> dict:
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}


@pytest.fixture(scope="module")
def ray_head(ray_installed, tmp_path_factory, ray_auth):
    """The address of a Ray head (2 CPUs, 0 GPUs) that this fixture starts and stops."""
    log = tmp_path_factory.mktemp("ray_head") / "head.log"
    with open(log, "w") as err:
        head = subprocess.Popen([sys.executable, "-c", HEAD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=err, text=True, env=env_with(**ray_auth))
    address = head.stdout.readline().strip()
    assert address, f"the Ray head did not start: {log.read_text()[-2000:]}"
    yield address
    head.stdin.close()
    try:
        head.wait(timeout=60)
    except subprocess.TimeoutExpired:
        head.kill()   # Ray's own processes share its fate
        head.wait()


@pytest.fixture(scope="module")
def local_four(fasta, common, tmp_path_factory):
    """The result of a local run with 4 shards: a Ray run of 4 shards batches each shard the same way."""
    out = tmp_path_factory.mktemp("local4") / "out"
    res = run_cli(fasta, "--out", str(out), *common, "--shards", "4")
    assert res.returncode == 0, res.stderr
    return read(out / "result.h5")


def shard_process(out: Path, rank: int) -> int | None:
    """The pid of the `run_shards work OUT --shard RANK` process, if one runs."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "work" in args and str(out) in args and args[-3:-1] == ["--shard", str(rank)]:
            return int(entry.name)
    return None


def parent_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def command_line(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").replace("\0", " ")


@pytest.mark.slow
def test_four_shards_as_ray_tasks_on_a_local_ray_match_a_local_run(ray_installed, fasta, common, local_four,
                                                                    tmp_path):
    """Without --ray-address the launcher starts a local Ray (this machine's CPUs, no GPU), runs one task
    per shard, merges, and stops the Ray it started."""
    out = tmp_path / "out"
    res = run_cli(fasta, "--out", str(out), *common, "--shards", "4", "--launcher", "ray")
    assert res.returncode == 0, res.stderr
    assert "submitted shard(s) 0,1,2,3 as 4 Ray task(s) (1 CPU(s) each)" in res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    assert res.stdout.strip() == f"result: {out / 'result.h5'}"   # Ray printed nothing of its own
    assert all(line[:2] in ("I ", "W ") for line in res.stderr.splitlines()), res.stderr
    got = read(out / "result.h5")
    assert sorted(got) == sorted(local_four)
    for key, want in local_four.items():   # the same shards, batched the same way: the same bits
        assert np.array_equal(got[key], want, equal_nan=want.dtype.kind == "f"), key
    for rank in range(4):
        assert log_text(out, rank).count("started (pid ") == 1, rank   # each shard ran once
    assert undocumented_files(out) == []
    assert all(shard_process(out, r) is None for r in range(4))


@pytest.mark.slow
def test_a_killed_ray_worker_is_retried_from_the_checkpoints(ray_head, ray_auth, fasta, common, local_four,
                                                             tmp_path):
    """SIGKILL to the Ray worker running shard 1: its `work` process gets SIGTERM (a final checkpoint, the
    shard lock released), Ray runs the task again, which resumes; the result is the same."""
    out = tmp_path / "out"
    proc = start(fasta, "--out", str(out), *common, "--shards", "4", "--launcher", "ray", "--ray-address", ray_head,
                 env={"RUN_SHARDS_FAULT_BATCH_SLEEP": "0.3", **ray_auth})
    try:
        wait_for(lambda: "checkpoint part_" in log_text(out, 1), timeout=150, what="shard 1's first checkpoint")
        work = shard_process(out, 1)
        assert work is not None, "no `run_shards work ... --shard 1` process"
        ray_worker = parent_of(work)
        assert command_line(ray_worker).startswith("ray::"), command_line(ray_worker)
        os.kill(ray_worker, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    text = log_text(out, 1)
    stopped = re.search(r"interrupted \(received SIGTERM\): (\d+) of 60 sequences durable", text)
    assert stopped, text                                      # one SIGTERM: a final checkpoint, not a kill
    assert (f"shard 1: Ray started it again (try 2); it resumes from its checkpoints: {int(stopped[1]):,} of 60 "
            "sequences durable") in stderr                    # the count the retry resumed from
    assert text.count("started (pid ") == 2 and f"resuming: {stopped[1]} of 60" in text
    ends = [json.loads(line) for line in (out / "logs" / "events_1.jsonl").read_text().splitlines()]
    assert [e["code"] for e in ends if e["event"] == "end"] == [75, 0]
    assert stdout.strip() == f"result: {out / 'result.h5'}"    # no retry notice from Ray itself
    assert all(line[:2] in ("I ", "W ") for line in stderr.splitlines()), stderr
    assert_same(read(out / "result.h5"), local_four)
    assert undocumented_files(out) == []
    assert all(shard_process(out, r) is None for r in range(4))


@pytest.mark.slow
def test_sigterm_to_the_driver_cancels_the_tasks_and_names_rerun(ray_head, ray_auth, fasta, common, local_four,
                                                                 tmp_path):
    """SIGTERM to the driver (a scheduler stopping the job that runs it, `kill`) is Ctrl-C's path: the tasks are
    cancelled, their shards checkpoint, and the message names `rerun`, which finishes the same result. (ray.init
    used to replace the command's SIGTERM handler with Ray's crash handler: a C++ stack, no advice.)"""
    out = tmp_path / "out"
    args = ["--ray-address", ray_head]
    # Shard 1 slowed (2 s a batch, ~10 batches) and signalled after its first checkpoint (5 records): ray.cancel's
    # way to a running task took 4.5 s on a busy machine, and a shard with 0.3 s batches had finished first.
    proc = start(fasta, "--out", str(out), *common, "--shards", "4", "--checkpoint-every", "5", "--launcher", "ray",
                 *args, env={"RUN_SHARDS_FAULT_BATCH_SLEEP": "2", "RUN_SHARDS_FAULT_BATCH_SLEEP_SHARD": "1",
                             **ray_auth})
    try:
        wait_for(lambda: "checkpoint part_" in log_text(out, 1), timeout=150, what="shard 1's first checkpoint")
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr
    assert "*** SIGTERM received at time" not in stderr, stderr
    assert "interrupted by SIGTERM: the Ray tasks were cancelled" in stderr, stderr
    assert f"Continue with:  run_shards rerun {out}" in stderr
    assert all(shard_process(out, r) is None for r in range(4))
    # its final checkpoint: on the SIGTERM of its cancelled task, or (a task a plain cancel does not reach) the
    # kernel's when Ray killed the task's worker ("the parent process is gone")
    assert re.search(r"interrupted \((received SIGTERM|the parent process is gone.*)\): \d+ of 60 sequences durable",
                     log_text(out, 1)), log_text(out, 1)
    cancelled = [e for e in events(out / "logs" / "events.jsonl") if e["event"] == "cancelled"]
    assert len(cancelled) == 1 and 1 in cancelled[0]["shards"] and cancelled[0]["submission"], cancelled
    res = run_cli("rerun", str(out), env=ray_auth)
    assert res.returncode == 0, res.stderr
    assert_same(read(out / "result.h5"), local_four)


def events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_task_attempt_that_starts_after_its_command_cancelled_it_computes_nothing(small_fasta, models, tmp_path):
    """Ray may start an attempt of a task after the driver cancelled it (a retry racing the cancel: under load,
    one started after the driver had left, computed its shard for a minute and held the lock the suggested
    `rerun` met). Its `work` finds the driver's `cancelled` event for its submission and stops before it takes
    the shard: exit 130, the rerun named; an attempt of another submission (the rerun's) computes."""
    out = tmp_path / "out"
    res = run_cli(small_fasta, "--out", str(out), "--model", models["demo"], "--gpus", "0", "--launcher", "slurm",
                  "--shards", "2", "--dry-run")
    assert res.returncode == 0, res.stderr
    with open(out / "logs" / "events.jsonl", "a") as f:
        f.write(json.dumps({"t": time.time(), "event": "cancelled", "submission": "h:1:2", "shards": [0, 1]}) + "\n")
    res = run_cli("work", str(out), "--shard", "0", env={"RUN_SHARDS_RAY_SUBMISSION": "h:1:2"})
    assert res.returncode == 130, res.stderr
    assert "the command that submitted this Ray task cancelled it" in res.stderr, res.stderr
    assert ["rerun", str(out)] in suggested_commands(res.stderr)
    assert not (out / "logs" / "events_0.jsonl").exists() and not (out / "shards" / "shard_0.h5").exists()
    res = run_cli("work", str(out), "--shard", "0", env={"RUN_SHARDS_RAY_SUBMISSION": "h:1:3"})
    assert res.returncode == 0, res.stderr
    assert (out / "shards" / "shard_0.h5").exists()


@pytest.mark.slow
def test_a_ray_task_refusing_the_runs_settings_names_no_rerun(ray_head, ray_auth, models, tmp_path):
    """A Ray run whose shard's worker refused caches past the RAM (a setting a rerun cannot change) ended with
    "Continue with: run_shards rerun OUT", which stops the same way; the worker's command (a new run with fewer
    new tokens, in another --out) is now the only one named, as for a local run and a SLURM task."""
    fasta, out = tmp_path / "three.fasta", tmp_path / "out"
    fasta.write_text(">a\nMKTAYIAKQRQISFVKSHFSRQ\n>b\nMSEQNNTEMTFQIQRIYTKDIS\n")
    res = run_cli(str(fasta), "--out", str(out), "--model", models["demo"], "--gpus", "0", "--task", "generate",
                  "--max-new-tokens", "1000000000", "--max-length", "1000", "--launcher", "ray", "--shards", "1",
                  "--ray-address", ray_head, "--no-progress", env={**ray_auth, "RUN_SHARDS_FAULT_FREE_RAM": "16000000"})
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert "caches need" in res.stderr and "Continue with" not in res.stderr, res.stderr
    assert "run_shards rerun" not in res.stderr, res.stderr
    (command, *others) = {tuple(c) for c in suggested_commands(res.stderr)}
    assert others == [] and command[:3] == ("run", str(fasta), "--out") and command[3] != str(out), command
    assert command[command.index("--launcher") + 1] == "ray" and "--max-new-tokens" in command


def test_the_requirement_the_error_names_is_the_extras():
    import configparser

    from pipeline.launchers.ray_tasks import RAY_REQUIREMENT
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    assert cfg["options.extras_require"]["ray"].split() == [RAY_REQUIREMENT]


@pytest.mark.slow
def test_without_ray_the_error_says_how_to_install_it(fasta, common, tmp_path):
    """A `ray` that cannot be imported (a test double on PYTHONPATH, as when the package is missing): one
    line naming the extra and the command that continues, no traceback."""
    double = tmp_path / "no_ray" / "ray"
    double.mkdir(parents=True)
    (double / "__init__.py").write_text("raise ImportError('No module named ray')\n")
    out = tmp_path / "out"
    res = run_cli(fasta, "--out", str(out), *common, "--shards", "2", "--launcher", "ray",
                  env={"PYTHONPATH": str(double.parent)})
    assert res.returncode == 2, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --launcher ray needs Ray"), res.stderr
    assert f"`{sys.executable} -m pip install 'ray>=2.9'`" in last, last
    assert f"run_shards rerun {out}" in last
    assert "Traceback" not in res.stderr
    assert not (out / "result.h5").exists()


# The task's body is plain Python: these run without Ray.
def test_the_task_retries_only_what_a_retry_may_fix():
    from pipeline.launchers.ray_tasks import ShardTaskFailed, run_shard
    assert run_shard([sys.executable, "-c", "print('done')"], {}) == {"exit_code": 0, "output": ["done"]}
    stopped = run_shard([sys.executable, "-c", "import sys; print('error: bad input'); sys.exit(2)"], {})
    assert stopped == {"exit_code": 2, "output": ["error: bad input"]}   # a user error: the same on every try
    with pytest.raises(ShardTaskFailed) as failed:
        run_shard([sys.executable, "-c", "import os, sys; print(os.environ['X']); sys.exit(1)"],
                  {"X": "from the driver"})
    assert failed.value.exit_code == 1 and failed.value.output == ["from the driver"]
    with pytest.raises(ShardTaskFailed) as killed:
        run_shard([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], {})
    assert killed.value.exit_code == -signal.SIGKILL


SHARD = """
import os, signal, sys, time
def stop(*_):
    open(sys.argv[1], "a").write("SIGTERM\\n")
    sys.exit(130)
signal.signal(signal.SIGTERM, stop)
from pipeline.launchers.work import die_with_the_task   # what `run_shards work` does first
die_with_the_task()
open(sys.argv[1], "a").write(f"{os.getpid()}\\n")
time.sleep(120)
"""


def test_the_shard_process_gets_one_sigterm_when_its_task_process_is_killed(tmp_path):
    """What a killed Ray worker does to its shard: the `work` process gets SIGTERM, once (to checkpoint and
    free the shard lock), even though nothing could run in the SIGKILLed worker: it asked the kernel for it
    itself, from the task's pid in RUN_SHARDS_DIE_WITH (no preexec_fn in the task's threaded worker)."""
    from .tiny_models import REPO
    record = tmp_path / "shard.txt"
    task = subprocess.Popen([sys.executable, "-c", "import sys; from pipeline.launchers.ray_tasks import run_shard; "
                             "run_shard(sys.argv[1:], {})", sys.executable, "-c", SHARD, str(record)], cwd=REPO)
    try:
        wait_for(lambda: record.exists() and record.read_text().strip(), timeout=60, what="the shard process")
        shard = int(record.read_text().split()[0])
        assert parent_of(shard) == task.pid
        task.kill()
        wait_for(lambda: "SIGTERM" in record.read_text(), timeout=10, what="SIGTERM to the shard process")
        time.sleep(1)
        assert record.read_text().count("SIGTERM") == 1
    finally:
        task.kill()
        task.wait()
