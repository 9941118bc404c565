"""Fault injection with real processes and signals: what each fault does, and that nothing is lost.

A reference run computes the expected result once; every faulty run must end non-zero with a clear
message, keep what was durable, and after `rerun` give the same rows and values as the reference.
Values are compared at atol = rtol = 1e-6: resumed shards run the same batches with the same thread
count, so they agree to float32 rounding.
"""
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from pipeline.errors import UserError
from pipeline.output.result_reader import open_result
from pipeline.planning.storage import check_storage

from .run_helpers import (assert_same, env_with, log_text, option_set, read, rerun_matches, start, status_rows,
                          suggested_commands, wait_for, worker_pid)
from .tiny_models import REPO, run_cli


@pytest.mark.parametrize("point", ["part-written", "part-finished", "shard-written"])
def test_kill_while_writing_output(fasta, common, reference, tmp_path, point):
    """SIGKILL at each step of writing a checkpoint or the shard: only undurable rows are recomputed."""
    out = tmp_path / "out"
    res = run_cli(fasta, "--out", str(out), *common,
                  env={"RUN_SHARDS_FAULT_DIE_AT": point, "RUN_SHARDS_FAULT_DIE_SHARD": "1",
                       "RUN_SHARDS_FAULT_DIE_AFTER": "0" if point == "shard-written" else "1"})
    assert res.returncode == 1
    assert "shard 1 failed: killed by SIGKILL" in res.stderr and f"run_shards rerun {out} --shards 1" in res.stderr
    assert not (out / "result.h5").exists()
    parts = sorted(p.name for p in (out / "shards" / "shard_1.parts").iterdir())
    durable = [p for p in parts if p.startswith("part_")]
    assert "part_000000.h5" in durable                      # the first checkpoint survived
    if point == "part-written":
        assert "part_000001.h5" not in durable              # the one being written never counts
    if point == "shard-written":   # every row durable: merged as they are, status said "failed" beside "finished"
        detail = status_rows(out)[1]["detail"]
        assert detail.endswith(f"every row is durable: `run_shards rerun {out}` writes its shard file without "
                               "computing"), detail
        merged = tmp_path / "merged"
        shutil.copytree(out, merged)
        assert run_cli("merge", str(merged), "--allow-partial").returncode == 0
        rows = status_rows(merged)
        assert [r["state"] for r in rows.values()] == ["complete", "complete"], rows
        assert rows[1]["detail"].startswith("merged from its checkpoints; last run: killed by SIGKILL"), rows
        assert run_cli("report", str(merged)).returncode == 0   # (the same states)
        report = (merged / "report.html").read_text()
        assert report.count("<td class='complete'>complete</td>") == 2 and "class='failed'" not in report
    rerun_matches(out, reference)
    resumed = log_text(out, 1).split("worker for shard 1 started")[-1]
    durable = int(resumed.split("resuming: ")[1].split(" of ")[0])
    if point == "shard-written":
        assert durable == 120          # every row was durable: the rerun only writes the shard again
    else:
        assert 20 <= durable < 120     # the first checkpoint's rows are reused, the rest recomputed


def test_parent_killed_workers_stop_then_rerun(fasta, common, reference, tmp_path):
    common = option_set(common, "--workers", "2")   # (both shards computing at once)
    out = tmp_path / "out"
    proc = start(fasta, "--out", str(out), *common, env=dict(RUN_SHARDS_FAULT_BATCH_SLEEP="0.3"))
    wait_for(lambda: all("checkpoint part_000000" in log_text(out, r) for r in (0, 1)))
    pids = [worker_pid(out, r) for r in (0, 1)]
    os.kill(pids[1], signal.SIGSTOP)   # (Ctrl-Z of a worker, a debugger): it holds its shard but does nothing
    proc.kill()
    proc.wait()

    def gone(pids):
        return all(not os.path.exists(f"/proc/{p}") or open(f"/proc/{p}/stat").read().split()[2] == "Z" for p in pids)
    wait_for(lambda: gone(pids[:1]), timeout=60)
    # status and rerun say it is stopped and how to go on; rerun's way on once it has stopped is rerun (it named
    # `merge`, which refuses a shard its process left unfinished)
    stopped = f"STOPPED (SIGSTOP or Ctrl-Z): it does nothing until `kill -CONT {pids[1]}` continues it"
    assert stopped in run_cli("status", str(out)).stdout
    res = run_cli("rerun", str(out), "--shards", "1")
    assert res.returncode != 0 and stopped in res.stderr and "left to it" in res.stderr, res.stderr
    assert f"continue with:  run_shards rerun {out}" in res.stderr and "merge with" not in res.stderr
    os.kill(pids[1], signal.SIGCONT)
    wait_for(lambda: gone(pids), timeout=60)   # no orphans left holding memory
    for r in (0, 1):   # the kernel's parent-death signal, not a Ctrl-C, and said so
        text = log_text(out, r)
        assert "stopping after the current batch: the parent process is gone" in text, text
        assert "SIGINT" not in text and "exits with code 75" in text
    assert [s["state"] for s in status_rows(out).values()] == ["interrupted", "interrupted"]
    rerun_matches(out, reference)


def test_sigterm_to_parent_checkpoints_and_exits_nonzero(fasta, common, reference, tmp_path):
    """SIGTERM, twice, as schedulers send it (SLURM to the batch script and to every process of the job; a
    dying Ray worker): every worker still writes its final checkpoint (only a second Ctrl-C kills at once),
    and nothing offers a Ctrl-C to a process without a terminal."""
    common = option_set(common, "--workers", "2")   # (both shards computing at once)
    out = tmp_path / "out"
    proc = start(fasta, "--out", str(out), *common, env=dict(RUN_SHARDS_FAULT_BATCH_SLEEP="0.3"),
                 stdin=subprocess.DEVNULL)
    wait_for(lambda: all("checkpoint part_000000" in log_text(out, r) for r in (0, 1)))
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert "interrupted by SIGTERM: every running worker wrote a final checkpoint" in stderr
    assert "killed" not in stderr and "Ctrl-C" not in stderr, stderr
    for r in (0, 1):
        events = [json.loads(line) for line in (out / "logs" / f"events_{r}.jsonl").read_text().splitlines()]
        assert [e["code"] for e in events if e["event"] == "end"] == [75]
        assert [e["signal"] for e in events if e["event"] == "stop"] == ["SIGTERM"]
    assert f"Continue with:  run_shards rerun {out}\n" in stderr and "failed" not in stderr, stderr
    assert stderr.count("stopped at its final checkpoint (run_shards received SIGTERM and asked it to stop)") == 2
    for r in (0, 1):
        assert "interrupted (received SIGTERM)" in log_text(out, r)
        assert "run_shards received SIGTERM: asking this worker (SIGTERM) to write a final checkpoint" in log_text(out, r)
    assert [s["state"] for s in status_rows(out).values()] == ["interrupted", "interrupted"]
    rerun_matches(out, reference)


def test_second_run_refused_while_active_and_stale_lock_taken_over(fasta, common, tmp_path):
    common = option_set(common, "--workers", "2")   # (both shards computing at once)
    out = tmp_path / "out"
    proc = start(fasta, "--out", str(out), *common, env=dict(RUN_SHARDS_FAULT_BATCH_SLEEP="1.0"))   # still running when SIGTERM ends it
    try:
        wait_for(lambda: "started (pid" in log_text(out, 0))
        res = run_cli(fasta, "--out", str(out), *common)
        assert res.returncode == 2 and "is in use by another run_shards command (pid" in res.stderr
        res = run_cli("merge", str(out))
        assert res.returncode == 2 and "is in use" in res.stderr
        wait_for(lambda: (out / "manifest.json").exists())
        res = run_cli("status", str(out))
        assert res.returncode == 0 and f"ACTIVE: `run` (pid {proc.pid} on" in res.stdout, res.stdout
        wait_for(lambda: all("started (pid" in log_text(out, r) for r in (0, 1)))
        wait_for(lambda: len(re.findall(r"^[01] +running ", run_cli("status", str(out)).stdout, re.M)) == 2)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    assert "ACTIVE" not in run_cli("status", str(out)).stdout
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / ".lock").write_text(json.dumps({"pid": 999999, "host": "gone", "purpose": "run", "since": "yesterday"}))
    res = run_cli(fasta, "--out", str(stale), *common)
    assert res.returncode == 0, res.stderr
    assert "took over a stale lock left by pid 999999" in (stale / "logs" / "run.log").read_text()


def test_a_lock_holder_is_told_by_its_start_not_by_a_time_of_day():
    """A lock record's owner is its pid and its start (the boot's id and clock ticks since boot): a process with
    the pid and another start is not the owner. A check against the record's time of day called a live owner dead
    once the clock was set forward (a VM resumed, NTP stepping it), since a process's start in wall-clock terms is
    the boot time, which moves with the clock."""
    from pipeline.processes import process_alive, process_start
    mine = process_start()
    boot, ticks = mine.rsplit(":", 1)
    assert process_alive(os.getpid(), mine) and process_alive(os.getpid())
    assert not process_alive(os.getpid(), f"{boot}:{int(ticks) + 1}")          # the pid reused later
    assert not process_alive(os.getpid(), f"another-boot:{ticks}")            # or after a reboot
    child = subprocess.Popen(["sleep", "60"])
    try:
        assert process_start(child.pid) != mine and process_alive(child.pid, process_start(child.pid))
    finally:
        child.kill()
        child.wait()


def test_a_lock_left_by_a_dead_run_whose_pid_lives_on_in_another_process_is_not_active(fasta, common, reference,
                                                                                        tmp_path):
    """A machine rebooted (or pids wrapped around): OUT/.lock names a pid that a process started since then has,
    or a zombie no parent reaps. `status` must not call the run active (it then leaves out the command that
    finishes it, and the user waits for nothing), nor a stopped planning a run being planned."""
    out = tmp_path / "out"
    res = run_cli(fasta, "--out", str(out), *common,
                  env={"RUN_SHARDS_FAULT_DIE_AT": "part-written", "RUN_SHARDS_FAULT_DIE_SHARD": "0"})
    assert res.returncode == 1
    from pipeline.processes import process_start
    newer = subprocess.Popen(["sleep", "600"])            # a process started after the record's owner
    zombie = subprocess.Popen(["true"])                   # exits; never waited for while the check runs
    wait_for(lambda: b") Z" in open(f"/proc/{zombie.pid}/stat", "rb").read())
    now = time.strftime("%Y-%m-%dT%H:%M:%S")
    owner = process_start()   # (this test's process: the record's owner, whose pid `newer` now has)
    assert owner is not None and owner != process_start(newer.pid)
    try:
        for pid, start in ((newer.pid, owner), (zombie.pid, None)):
            (out / ".lock").write_text(json.dumps({"pid": pid, "host": os.uname().nodename, "purpose": "run",
                                                   "since": now, "start": start}))
            text = run_cli("status", str(out)).stdout
            assert "ACTIVE" not in text and f"`run_shards rerun {out}` computes the unfinished shards" in text, text
        planned = tmp_path / "planned"                    # stopped while planned: no manifest yet
        planned.mkdir()
        (planned / ".lock").write_bytes((out / ".lock").read_bytes())
        res = run_cli("status", str(planned))
        assert "being planned there now" not in res.stderr and "stopped there while it was planned" in res.stderr
        (out / ".lock").write_text(json.dumps({"pid": newer.pid, "host": os.uname().nodename, "purpose": "run",
                                               "since": now, "start": process_start(newer.pid)}))   # it holds it
        assert f"ACTIVE: `run` (pid {newer.pid} on" in run_cli("status", str(out)).stdout
        (out / ".lock").write_text(json.dumps({"pid": newer.pid, "host": os.uname().nodename, "purpose": "run",
                                               "since": now}))   # a record of an older version: the pid decides
        assert f"ACTIVE: `run` (pid {newer.pid} on" in run_cli("status", str(out)).stdout
    finally:
        newer.kill()
        newer.wait()
        zombie.wait()
    rerun_matches(out, reference)


def test_a_run_directory_copied_while_its_run_goes_on_is_not_held_by_that_run(fasta, common, reference, tmp_path):
    """`cp -a OUT COPY` while the run computes: the copy's OUT/.lock names the original's live command, yet
    nothing holds the copy. Its status must say so and advise the rerun that finishes it there."""
    out, copy = tmp_path / "out", tmp_path / "copy"
    proc = start(fasta, "--out", str(out), *common, env=dict(RUN_SHARDS_FAULT_BATCH_SLEEP="0.5"))
    try:
        wait_for(lambda: all("checkpoint part_000000" in log_text(out, r) for r in (0, 1)))
        subprocess.run(["cp", "-a", str(out), str(copy)], check=True)
        assert f"ACTIVE: `run` (pid {proc.pid} on" in run_cli("status", str(out)).stdout
        text = run_cli("status", str(copy)).stdout
        assert "ACTIVE" not in text and f"`run_shards rerun {copy}` computes the unfinished shards" in text, text
        rerun_matches(copy, reference)
        with h5py.File(copy / "result.h5") as f:   # its settings name where it is (they named the original)
            assert json.loads(f.attrs["config"])["out"] == str(copy)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)


def test_a_run_directory_moved_elsewhere_is_merged_as_the_run_in_its_new_place(reference_run, reference, tmp_path):
    """`mv OUT NEW` (here a copy) then `merge NEW`: the result's settings name NEW, not the place it was planned."""
    moved = tmp_path / "moved"
    shutil.copytree(reference_run, moved, symlinks=True)
    (moved / "result.h5").unlink()
    res = run_cli("merge", str(moved))
    assert res.returncode == 0, res.stderr
    assert_same(read(moved / "result.h5"), reference)
    with h5py.File(moved / "result.h5") as f:
        assert json.loads(f.attrs["config"])["out"] == str(moved)
    assert json.loads((moved / "manifest.json").read_text())["config"]["out"] == str(moved)


def test_a_run_directory_moved_while_its_run_computes(fasta, common, reference, tmp_path):
    """`mv OUT NEW` mid-run: the workers made OUT/shards/shard_N.parts anew at the old place (mkdir -p), wrote
    checkpoints there, then a shard of only those rows failed an assertion ('checkpoints do not add up'), and
    the failure report said `Continue with: run_shards rerun OUT`, a directory that is gone. Now the workers
    stop with a message saying what happened, nothing is made at the old place, and rerun continues at NEW."""
    out, moved = tmp_path / "out", tmp_path / "moved"
    proc = start(fasta, "--out", str(out), *common, env=dict(RUN_SHARDS_FAULT_BATCH_SLEEP="0.3"))
    wait_for(lambda: all("checkpoint part_000000" in log_text(out, r) for r in (0, 1)))
    os.rename(out, moved)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1 and "Traceback" not in stderr and "do not add up" not in stderr, stderr
    assert f"the run directory {out} is gone (moved or removed while this run computed)" in stderr, stderr
    assert "`run_shards rerun DIR` continues it" in stderr and f"run_shards rerun {out}" not in stderr, stderr
    assert "before it wrote its log" not in stderr, stderr
    assert not (out / "shards").exists()
    assert all(r["durable"] >= 20 for r in status_rows(moved).values())   # the checkpoints made before the move
    rerun_matches(moved, reference)


def test_corrupt_checkpoint_is_recomputed(fasta, common, reference, tmp_path):
    out = tmp_path / "out"
    res = run_cli(fasta, "--out", str(out), *common,
                  env={"RUN_SHARDS_FAULT_DIE_AT": "part-written", "RUN_SHARDS_FAULT_DIE_SHARD": "0",
                       "RUN_SHARDS_FAULT_DIE_AFTER": "2"})
    assert res.returncode == 1
    part = out / "shards" / "shard_0.parts" / "part_000001.h5"
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])   # a torn file
    status = run_cli("status", str(out)).stdout
    assert "corrupt checkpoint(s) part_000001.h5 will be recomputed" in status
    res = run_cli("merge", str(out), "--allow-partial")   # never merged, even partially
    assert res.returncode == 0, res.stderr
    with h5py.File(out / "result.h5") as f:
        assert not f.attrs["complete"] and len(f["missing_ids"]) > 0
    rerun_matches(out, reference)
    assert "part_000001.h5 is corrupt" in log_text(out, 0)


def test_allow_partial_merge(fasta, common, reference, tmp_path):
    out = tmp_path / "out"
    res = run_cli(fasta, "--out", str(out), *common,
                  env={"RUN_SHARDS_FAULT_DIE_AT": "part-written", "RUN_SHARDS_FAULT_DIE_SHARD": "1",
                       "RUN_SHARDS_FAULT_DIE_AFTER": "2"})
    assert res.returncode == 1
    res = run_cli("merge", str(out))
    assert res.returncode == 2 and "shard 1 is not finished" in res.stderr and "--allow-partial" in res.stderr
    needs = re.compile(r"^disk: .* finishing needs about (.+) more", re.M)
    before = needs.search(run_cli("status", str(out)).stdout)
    res = run_cli("merge", str(out), "--allow-partial")
    assert res.returncode == 0, res.stderr
    # A partial result.h5 frees nothing (the next merge writes the whole result beside it): status's estimate
    # of the space finishing needs stays (it dropped to the unfinished shard's share, as if merged in place)
    after = needs.search(run_cli("status", str(out)).stdout)
    assert before and after and after[1] == before[1], (before, after)
    got = read(out / "result.h5")
    # the copy plan's counts are the plan's: said so, in the plan's words ("240 computed" read as rows merged)
    assert f"rows as planned ({len(got['missing_ids']):,} missing from this partial result): 240 records: 240 to " \
           "compute\n" in res.stderr, res.stderr
    with h5py.File(out / "result.h5") as f:
        assert not f.attrs["complete"] and f.attrs["num_missing"] == len(got["missing_ids"]) > 0
    present = got["index"]
    missing = sorted(set(range(240)) - set(present.tolist()))
    assert [m.decode() for m in got["missing_ids"]] == [reference["ids"][m].decode() for m in missing]
    np.testing.assert_allclose(got["embeddings/mean"], reference["embeddings/mean"][present], rtol=1e-6, atol=1e-6)
    # read by FASTA position: a missing record is said to be one, a position past the input (at 17f6bc6 said
    # to be missing from a partial result too) is out of range
    with open_result(out) as res:
        assert res.at_position(int(present[-1]))["ids"] == reference["ids"][present[-1]].decode()
        with pytest.raises(UserError, match=f"no row for FASTA record {missing[0]} .*the result is partial"):
            res.at_position(missing[0])
        for outside in (240, -1):
            with pytest.raises(UserError, match=f"no row for FASTA record {outside} .*the input has 240 records"):
                res.at_position(outside)
    rerun_matches(out, reference)


def test_changed_input_is_refused(common, tmp_path, models):
    fasta = tmp_path / "in.fasta"
    fasta.write_bytes(b">a\nMKVL\n>b\nACDEF\n")
    out = tmp_path / "out"
    assert run_cli(str(fasta), "--out", str(out), *common).returncode == 0
    st = os.stat(fasta)
    os.utime(fasta, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))      # touched, same records: fine
    res = run_cli("merge", str(out))
    assert res.returncode == 0, res.stderr
    with open(fasta, "ab") as fh:
        fh.write(b">c\nWW\n")
    for cmd in (["rerun", str(out)], ["merge", str(out)]):
        res = run_cli(*cmd)
        assert res.returncode == 2, res.stderr
        assert "the input FASTA no longer matches this run" in res.stderr and "size changed" in res.stderr
        assert "2 records when the run started, 3 now" in res.stderr
    assert "inputs: CHANGED" in run_cli("status", str(out)).stdout
    res = run_cli(str(fasta), "--out", str(out), *common)   # same command again: refuses, says what changed
    assert res.returncode == 2 and "FASTA content" in res.stderr

    fasta.write_bytes(b">a\nMKVL\n>b\nACDEF\n")      # restored: accepted again
    assert run_cli("merge", str(out)).returncode == 0
    fasta.write_bytes(b">a\nMKVL\n>b\nACDEW\n")      # one residue edited in place: same records and lengths
    for cmd in (["rerun", str(out)], ["merge", str(out)]):
        res = run_cli(*cmd)
        assert res.returncode == 2 and f"the contents of {fasta} differ" in res.stderr, res.stderr
    assert "inputs: CHANGED" in run_cli("status", str(out)).stdout
    res = run_cli(str(fasta), "--out", str(out), *common)
    assert res.returncode == 2 and "FASTA content" in res.stderr


def test_empty_records_and_unknown_characters(common, tmp_path):
    fasta = tmp_path / "in.fasta"
    fasta.write_bytes(b">ok\nMKVL\n>empty\n\n>odd\nMKJ1L\n")
    res = run_cli(str(fasta), "--out", str(tmp_path / "a"), *common)
    assert res.returncode == 2 and "1 record(s) have no residues" in res.stderr and f"{fasta}:3 'empty'" in res.stderr
    (suggested,) = suggested_commands(res.stderr)               # the same run with --skip-empty
    assert "--skip-empty" in suggested, suggested
    res = run_cli(*suggested)
    assert res.returncode == 0, res.stderr
    got = read(tmp_path / "a" / "result.h5")
    assert got["status"].tolist() == [0, 3, 2]
    assert np.isnan(got["embeddings/mean"][1]).all() and not np.isnan(got["embeddings/mean"][[0, 2]]).any()
    assert got["num_tokens"].tolist() == [6, 0, 7]


def test_more_workers_than_records_and_shards_of_empty_records(common, tmp_path):
    """Four workers asked for three records: three shards (a fourth would load the model for nothing);
    stride over length-descending order gives shard 2 only the empty record, so its one batch has nothing
    to tokenize."""
    fasta = tmp_path / "in.fasta"
    fasta.write_bytes(b">ok\nMKVL\n>empty\n\n>two\nMKVLA\n")
    args = option_set(option_set(common, "--shards"), "--workers", "4")   # (as many shards as workers: 4, then 3)
    res = run_cli(str(fasta), "--out", str(tmp_path / "o"), *args, "--skip-empty")
    assert res.returncode == 0, res.stderr
    got = read(tmp_path / "o" / "result.h5")
    assert got["ids"].tolist() == [b"ok", b"empty", b"two"] and got["status"].tolist() == [0, 3, 0]
    assert sorted(p.name for p in (tmp_path / "o" / "shards").glob("*.h5")) == [f"shard_{r}.h5" for r in range(3)]
    assert "3 record(s): using 3 shard(s), not 4" in (tmp_path / "o" / "logs" / "run.log").read_text()
    # The end of the run says which rows have no values and why (the rows line counts every record as computed).
    assert "I 1 row(s) without values (status 3: empty records kept under --skip-empty), e.g. 'empty'" in res.stderr


def test_out_of_memory_batches_split_and_single_sequences_marked(fasta, common, reference, tmp_path):
    out = tmp_path / "out"
    lengths = reference["lengths"]
    limit = 500    # tokens; the demo tokenizer adds 2 specials per sequence
    res = run_cli(fasta, "--out", str(out), *common, env={"RUN_SHARDS_FAULT_OOM_TOKENS": str(limit)})
    assert res.returncode == 0, res.stderr
    got = read(out / "result.h5")
    too_big = lengths + 2 > limit
    assert too_big.any() and (~too_big).any()
    assert (got["status"][too_big] == 4).all() and np.isnan(got["embeddings/mean"][too_big]).all()
    assert (got["status"][~too_big] == 0).all()
    np.testing.assert_allclose(got["embeddings/mean"][~too_big], reference["embeddings/mean"][~too_big],
                               rtol=1e-4, atol=1e-4)   # smaller batches: other padding, float32 rounding
    logs = log_text(out, 0) + log_text(out, 1)
    assert "splitting it in two" in logs and "out of memory on a single sequence" in logs
    # Not only in the worker logs: the end of the run warns, and `status` says so as long as the result is there.
    said = f"{too_big.sum()} row(s) without values (status 4: out of device memory even as a batch of one"
    assert f"W {said}" in res.stderr
    assert f"rows: {said}" in run_cli("status", str(out)).stdout


def _limit_file_size(limit):
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # writes past the limit fail with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_disk_full_is_a_clear_error_and_rerun_works(fasta, common, reference, tmp_path):
    out = tmp_path / "out"
    env = env_with()
    res = subprocess.run([sys.executable, str(REPO / "bin" / "run_shards"), fasta, "--out", str(out), *common,
                          "--checkpoint-every", "1000"], capture_output=True, text=True, env=env, cwd=REPO,
                         preexec_fn=_limit_file_size(40_000), timeout=300)
    assert res.returncode != 0
    assert "the file size limit was reached" in res.stderr and "Nothing partial was kept" in res.stderr
    assert "Traceback" not in res.stderr
    leftovers = [p for p in (out / "shards").rglob("*") if p.name.endswith(".tmp")]
    assert leftovers == []
    rerun_matches(out, reference)


def test_hung_worker_is_killed_and_reported(fasta, common, reference, tmp_path):
    out = tmp_path / "out"
    res = run_cli(fasta, "--out", str(out), *common, "--worker-timeout", "10",
                  env={"RUN_SHARDS_FAULT_HANG_SHARD": "1"})
    assert res.returncode == 1
    assert "shard 1: no progress for" in res.stderr and "killed as hung" in res.stderr
    # run_shards killed it, and says so: not "out of host memory, or killed by hand"
    assert "shard 1 failed: killed by SIGKILL from run_shards (no progress for" in res.stderr, res.stderr
    failed_line = next(line for line in res.stderr.splitlines() if "shard 1 failed:" in line)
    assert failed_line.count("killed as hung") == 1, failed_line          # the reason said once
    assert "not by run_shards" not in res.stderr and "out of host memory" not in res.stderr
    assert "ERROR run_shards (parent): the worker (pid" in log_text(out, 1)   # its own log tells the end too
    assert (out / "shards" / "shard_0.h5").exists()
    rerun_matches(out, reference)


def test_a_long_batch_is_not_taken_for_a_hang(common, tmp_path):
    """A batch of one sequence ten times the token budget (computed in chunks) may take up to ten times
    --worker-timeout without a word from its worker: the hang detector allows a batch time for its tokens
    (it used to kill it as hung, and `rerun` met the same batch again). The timeout stays above a worker's
    start-up, which it also bounds."""
    fasta = tmp_path / "long.fasta"
    fasta.write_text(f">long\n{'ACDEFGHIKLMNPQRSTVWY' * 50}\n")   # 1,000 residues
    out = tmp_path / "out"
    res = run_cli(str(fasta), "--out", str(out), *common, "--workers", "1", "--max-tokens-per-batch", "100",
                  "--worker-timeout", "10", env={"RUN_SHARDS_FAULT_BATCH_SLEEP": "12"})   # (later options win)
    assert res.returncode == 0, res.stderr
    assert "killed as hung" not in res.stderr and (out / "result.h5").exists()


def test_a_long_generate_batch_is_not_taken_for_a_hang(common, tmp_path):
    """A generate batch ran all its steps (thousands with a large --max-new-tokens: minutes) without a word to its
    parent, and the hang detector killed it as hung, as often as `rerun` met it. Between its steps the worker now
    tells the parent it goes on (every second): here 10 steps of over 1.5 s each, past --worker-timeout 10."""
    fasta = tmp_path / "one.fasta"
    fasta.write_text(">one\nACDEFGHIKLMNPQRSTVWY\n")
    out = tmp_path / "out"
    res = run_cli(str(fasta), "--out", str(out), *option_set(common, "--shards", "1"), "--task", "generate",
                  "--max-new-tokens", "10", "--worker-timeout", "10", env={"RUN_SHARDS_FAULT_STEP_SLEEP": "1.5"})
    assert res.returncode == 0, res.stderr
    assert "killed as hung" not in res.stderr and (out / "result.h5").exists()
    assert len(read(out / "result.h5")["generate/token_ids"]) == 10


def test_a_machine_asleep_or_a_clock_set_forward_is_not_a_hang(tmp_path, monkeypatch):
    """The hang detector measured a worker's silence on the wall clock, which counts a laptop's sleep and jumps
    when the clock is set (a VM resumed, NTP stepping it): after an hour asleep every working worker was killed as
    hung at once. It now counts time the machine ran (time.monotonic). A real process stands for the worker."""
    from pipeline.launchers.progress import ProgressBoard
    from pipeline.launchers.supervisor import ShardProcess, Supervisor
    from pipeline.rundir.layout import RunDir

    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        board = ProgressBoard(10, "1 CPU worker(s)", 30.0, show_bar=False)
        board.add_worker(0, "CPU")
        supervisor = Supervisor(RunDir(str(tmp_path / "out")), [0], ["cpu0"], False, 1, board, 1800.0)
        process = ShardProcess(0, "cpu0", None, None, None, pid=worker.pid)
        supervisor.active.append(process)
        wall = time.time()
        monkeypatch.setattr(time, "time", lambda: wall + 3600.0)   # an hour later by the wall clock only
        supervisor._watch_timeouts()
        assert process.kill_at is None and worker.poll() is None and not process.killed_for
        board.workers[0].last_event -= 1801.0   # 1,801 s of silence while the machine ran: a hang
        supervisor._watch_timeouts()
        assert "no progress for 1801 s (--worker-timeout 1800); killed as hung" == process.killed_for
        assert worker.wait(timeout=10) == -signal.SIGTERM
        board.close()
    finally:
        worker.kill()
        worker.wait()


def test_storage_estimate_warns_when_it_will_not_fit(caplog, tmp_path):
    from index import SequenceIndex
    from pipeline.output.schema import BASE_COLUMNS, Column, Schema
    path = tmp_path / "x.fasta"
    path.write_bytes(b">a\n" + b"A" * 1000 + b"\n>b\n" + b"C" * 3000 + b"\n")
    index = SequenceIndex.build([path])
    schema = Schema(BASE_COLUMNS + (Column("embeddings/mean", "float32", 64),
                                    Column("per_residue/values", "float16", 1280, ragged=True)))
    assert schema.result_bytes(index, index.lengths) >= 4000 * 1280 * 2
    with caplog.at_level("INFO", logger="run_shards"):
        check_storage(schema, index, 2, tmp_path, free_bytes=10**12)
        assert "will NOT fit" not in caplog.text and "storage estimate: result 10.2 MB" in caplog.text
        check_storage(schema, index, 2, tmp_path, free_bytes=1000)
        assert "This will NOT fit" in caplog.text



def test_a_generate_runs_storage_estimate_counts_its_new_tokens(caplog, tmp_path):
    """A generate row's ragged values are its new tokens, up to --max-new-tokens, not its prompt's residues: the
    estimate was the same 820 B with 20 or 4,000 new tokens per row (a red team's finding), so "will NOT fit"
    could never be said, and `status` said "finishing needs about 1.6 KB more" of a run of 2^31 per row."""
    from types import SimpleNamespace

    from index import SequenceIndex
    from pipeline.output.schema import BASE_COLUMNS, STR, Column, Schema
    from pipeline.reporting.status import _disk_line
    from pipeline.rundir.layout import RunDir
    path = tmp_path / "x.fasta"
    path.write_bytes(b">a\nMKV\n>b\nMKVLA\n")
    index = SequenceIndex.build([path])
    schema = Schema(BASE_COLUMNS + (Column("generate/token_ids", "int32", ragged=True), Column("generate/text", STR),
                                    Column("generate/finish_reason", STR)))
    with caplog.at_level("INFO", logger="run_shards"):
        check_storage(schema, index, 1, tmp_path, "generate", 20, free_bytes=10**6)
        assert "will NOT fit" not in caplog.text and "(every row to --max-new-tokens 20, the text apart)" in caplog.text
        check_storage(schema, index, 1, tmp_path, "generate", 200_000, free_bytes=10**6)   # 2 x 800 KB of ids
        assert "This will NOT fit: free space, choose another --out, or a lower --max-new-tokens" in caplog.text
    run = RunDir(tmp_path / "out")
    run.shards_dir.mkdir(parents=True)
    manifest = {"schema": schema.to_json(), "world": 1, "config": {"task": "generate", "max_new_tokens": 2**31 - 1}}
    line = _disk_line(run, manifest, index, [SimpleNamespace(rank=0, state="pending", durable=0, expected=2)], False)
    assert "finishing needs about 34.4 GB more" in line, line   # 2 rows x 2^31 ids x 4 bytes, shard and result
