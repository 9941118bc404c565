"""Commands run at the same time on one run directory, as users of a shared machine or cluster do: one
command's clean-up must never take another's file, and what each says must hold while the other works."""
import os
import re
import shutil
import time

from pipeline.rundir.layout import atomic_path

from .tiny_models import run_cli


def test_a_command_taking_the_run_lock_leaves_an_export_writing_in_out_alone(fasta, common, reference_run,
                                                                             tmp_path):
    """`export` (and `get --output`, `report`) take no run lock and write in OUT through a temporary file: a
    `run`, `rerun` or `merge` started meanwhile took every `.NAME.tmp*` in OUT for its own killed command's
    leftovers and removed it (at 770fa95), so the export then failed, or renamed a file holding only what
    it wrote after the removal into place as OUT/result.parquet. Leftovers of dead commands still go."""
    out = tmp_path / "out"
    shutil.copytree(reference_run, out)
    stale_merge = out / ".result.h5.tmp"                  # a merge killed under the lock: stale at once
    stale_merge.write_bytes(b"half a result")
    dead_export = out / ".result.per-id.h5.tmp999999"     # an export killed two hours ago
    dead_export.write_bytes(b"half an export")
    two_hours_ago = time.time() - 7200
    os.utime(dead_export, (two_hours_ago, two_hours_ago))
    with atomic_path(out / "result.parquet") as tmp:      # this process exports now, as `export` writes
        with open(tmp, "wb") as fh:
            fh.write(b"first half, ")
            fh.flush()
            res = run_cli(fasta, "--out", str(out), *common)   # the same run again: the result stands
            assert res.returncode == 0, res.stderr
            assert "nothing was computed or merged again" in res.stderr
            assert tmp.exists(), "the live export's temporary file was removed"
            res = run_cli("merge", str(out))
            assert res.returncode == 0, res.stderr
            assert tmp.exists(), "the live export's temporary file was removed by merge"
        with open(tmp, "ab") as fh:
            fh.write(b"second half")
    assert (out / "result.parquet").read_bytes() == b"first half, second half"
    assert not stale_merge.exists() and not dead_export.exists()


def test_get_and_export_while_a_command_works_in_out_name_it_not_a_merge_it_would_refuse(reference_run, tmp_path):
    """`get` and `export` on a run whose command is computing it suggested `run_shards merge OUT`, which is then
    refused as 'in use by another run_shards command' (at 770fa95): they name the command working there."""
    from pipeline.rundir.layout import RunDir
    from pipeline.rundir.locks import RunLock
    out = tmp_path / "out"
    shutil.copytree(reference_run, out)
    (out / "result.h5").unlink()   # its shards are done; the command holding the run has not merged yet
    with RunLock(RunDir(out), "run"):
        for args in (("get", str(out), "x"), ("export", str(out), "--format", "parquet")):
            res = run_cli(*args)
            assert res.returncode == 2, res.stderr
            assert f"a run_shards command is working there now (pid {os.getpid()} on " in res.stderr, res.stderr
            assert "`run`" in res.stderr and "run_shards merge" not in res.stderr, res.stderr
    res = run_cli("get", str(out), "x")   # none holds it now: merging is the way on
    assert res.returncode == 2 and f"run_shards merge {out}" in res.stderr, res.stderr


def test_rerun_and_merge_refused_by_the_run_lock_are_not_sent_to_another_out(fasta, common, reference_run, tmp_path):
    """`rerun OUT` and `merge OUT` refused while another command holds the run were told to 'use another --out
    directory' (at 770fa95), which neither has: another directory is another run. They are told to wait and
    what shows the holder; `run`, which has --out, keeps that way out."""
    from pipeline.rundir.layout import RunDir
    from pipeline.rundir.locks import RunLock
    out = tmp_path / "out"
    shutil.copytree(reference_run, out)
    with RunLock(RunDir(out), "run"):
        for args in (("rerun", str(out)), ("merge", str(out)), (fasta, "--out", str(out), *common)):
            res = run_cli(*args)
            assert res.returncode == 2 and "is in use by another run_shards command" in res.stderr, res.stderr
            assert f"`run_shards status {out}` shows what it does" in res.stderr, res.stderr
            assert ("another --out" in res.stderr) == (args[0] == fasta), res.stderr
        res = run_cli("status", str(out))   # the command named: it shows the holder
        assert res.returncode == 0 and f"ACTIVE: `run` (pid {os.getpid()} on" in res.stdout, res.stdout


def test_status_while_a_worker_finishes_its_shard_says_complete_not_corrupt(fasta, common, reference_run, tmp_path,
                                                                           monkeypatch):
    """`status` takes no lock: a worker finishing its shard writes shard_N.h5 and removes its checkpoints while
    status reads them. A checkpoint removed between status listing and opening it was called 'corrupt ...
    will be recomputed' and the shard pending or partial (at 770fa95); its size was read after it was gone (a
    FileNotFoundError traceback, in a narrower window). The race is made to happen at that point: the worker's steps, on real files."""
    import run_shards
    from pipeline.output import shard_state
    out = tmp_path / "out"
    res = run_cli(fasta, "--out", str(out), *common,
                  env={"RUN_SHARDS_FAULT_DIE_AT": "part-written", "RUN_SHARDS_FAULT_DIE_SHARD": "0",
                       "RUN_SHARDS_FAULT_DIE_AFTER": "2"})
    assert res.returncode == 1, res.stderr
    parts = out / "shards" / "shard_0.parts"
    (out / "shards" / "shard_0.failed.json").unlink()   # as a rerun's worker computing it now
    listed = shard_state.part_files(parts)
    assert len(listed) >= 2
    real, calls = shard_state.part_files, []

    def finished_meanwhile(folder):
        found = real(folder)
        calls.append(folder)
        # the worker's finalize, right after status listed them to read them (its first listing sums sizes)
        if folder == parts and calls.count(parts) == 2:
            shutil.copyfile(reference_run / "shards" / "shard_0.h5", out / "shards" / "shard_0.h5")
            shutil.rmtree(parts)
        return found
    monkeypatch.setattr(shard_state, "part_files", finished_meanwhile)
    text = run_shards.status(str(out))
    assert "corrupt" not in text, text
    assert re.search(r"^0 +complete ", text, re.M), text
    assert calls.count(parts) == 2   # (the listing read checkpoints that were gone)


def test_a_decompressed_copy_left_by_a_killed_command_is_removed_and_one_being_written_is_kept(tmp_path):
    """A command killed (kill -9) while decompressing a .gz into the shared cache left its half-written copy,
    as large as the FASTA, hidden there for good (at 770fa95: `.NAME.tmp<pid>`, which nothing removed). The
    next copy of that file removes it; a copy another command is writing now (its lock held) stays."""
    import fcntl
    import gzip
    from index.compressed import copy_path
    cache = tmp_path / "cache"
    gz = tmp_path / "in.fasta.gz"
    gz.write_bytes(gzip.compress(b">a\nMKV\n>b\nMKVL\n"))
    target = copy_path(gz, cache)
    target.parent.mkdir(parents=True)
    killed, writing = (target.with_name(f".{target.name}.tmp{pid}") for pid in (999999, os.getpid()))
    for path in (killed, writing):
        path.write_bytes(b">a\nMK")
        os.utime(path, (time.time() - 120, time.time() - 120))
    held = os.open(writing, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)   # as its writer holds it while decompressing
    try:
        res = run_cli("index", str(gz), env={"RUN_SHARDS_CACHE": str(cache)})
        assert res.returncode == 0, res.stderr
        assert not killed.exists() and writing.exists()
        assert target.read_bytes() == b">a\nMKV\n>b\nMKVL\n"
    finally:
        os.close(held)


def test_status_while_a_run_is_planned_names_a_status_command_that_pastes(tmp_path):
    """The refusal while a run is planned named `run_shards status OUT` with OUT as it is (at 770fa95): an
    --out with a space in it pasted as two words. It is shell-quoted, as every suggested command is."""
    from pipeline.rundir.layout import RunDir
    from pipeline.rundir.locks import RunLock
    from .run_helpers import suggested_commands
    out = tmp_path / "my runs" / "out"
    planning = RunDir(out)
    planning.create()
    with RunLock(planning, "run"):
        res = run_cli("status", str(out))
        assert res.returncode == 2 and "a run is being planned there now" in res.stderr, res.stderr
        assert suggested_commands(res.stderr) == [["status", str(out)]], res.stderr
