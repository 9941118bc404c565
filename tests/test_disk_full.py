"""A full disk and a file size limit, for real: a small tmpfs mounted by the test (root only; skipped with
the reason elsewhere, a failure under CI=true) and `ulimit -f` in the child process.

Each run must end with a clear message and the command that continues (no traceback), keep every row made
durable, leave nothing in the run directory but what the layout documents, and after the suggested command
give the same result as a clean run. A write that fits must never be refused by an estimate.
"""
import os
import shutil
import subprocess
import sys


from .run_helpers import (assert_same, env_with, file_size_limit, log_text, read, rerun_matches, start,
                          status_rows, suggested_commands, undocumented_files, wait_for)
from .tiny_models import REPO, run_cli


def _run_limited(args, limit):
    return subprocess.run([sys.executable, str(REPO / "bin" / "run_shards"), *args], capture_output=True, text=True,
                          env=env_with(), cwd=REPO, preexec_fn=file_size_limit(limit), timeout=300)


def test_disk_fills_mid_run_then_rerun_after_freeing_space(fasta, common, reference, tmpfs):
    """The disk fills to the last byte after the first checkpoints: workers stop, the parent reports (it
    cannot even record failures or write its log), and after freeing space `rerun` finishes the run."""
    disk = tmpfs.mount("4m")
    out = disk / "out"
    proc = start(fasta, "--out", str(out), *common, env={"RUN_SHARDS_FAULT_BATCH_SLEEP": "0.3"})
    wait_for(lambda: all("checkpoint part_000000" in log_text(out, r) for r in (0, 1)), what="first checkpoints")
    filler = tmpfs.fill(disk)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, stderr
    assert "Traceback" not in stderr and "Logging error" not in stderr, stderr
    assert "no space left on the device" in stderr
    assert f"Continue with:  run_shards rerun {out}" in stderr
    assert undocumented_files(out) == []          # no half-written file, no `.failed.json.tmpNNN`
    rows = status_rows(out)
    assert all(r["durable"] >= 20 and r["durable"] <= r["of"] for r in rows.values()), rows
    assert "NOT ENOUGH" in run_cli("status", str(out)).stdout    # the reason, even where none was recorded
    filler.unlink()
    rerun_matches(out, reference)


def test_writes_that_fit_are_not_refused(fasta, common, reference, tmpfs):
    """A disk of 900 KB, where the run's files peak near 300 KB: every write fits, so the run completes. (An
    estimate that added 1 MiB to every write once refused all of them, even after computing every row.)"""
    disk = tmpfs.mount("900k")
    out = disk / "out"
    res = run_cli(fasta, "--out", str(out), *common)
    assert res.returncode == 0, res.stderr
    assert_same(read(out / "result.h5"), reference)
    assert shutil.disk_usage(disk).used < 450_000     # the margin this test relies on


def test_file_size_limit_refuses_only_files_that_exceed_it(fasta, common, reference, tmp_path):
    """`ulimit -f` above every file the run writes: the run completes. Below the largest: a clear error
    naming the limit, nothing partial kept, and `rerun` without the limit finishes."""
    ok = tmp_path / "ok"
    ok_res = _run_limited([fasta, "--out", str(ok), *common], limit=400_000)
    largest = max(p.stat().st_size for p in ok.rglob("*.h5"))
    assert ok_res.returncode == 0 and largest < 400_000, ok_res.stderr
    assert_same(read(ok / "result.h5"), reference)

    out = tmp_path / "limited"
    res = _run_limited([fasta, "--out", str(out), *common, "--checkpoint-every", "1000"], limit=40_000)
    assert res.returncode != 0
    assert "the file size limit was reached" in res.stderr and "Nothing partial was kept" in res.stderr
    # what lifts it: no free space does
    assert "raise the file size limit (`ulimit -f`) and run `run_shards rerun" in res.stderr, res.stderr
    assert "free space and run" not in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    assert undocumented_files(out) == []
    rerun_matches(out, reference)


def test_merge_on_a_full_disk_keeps_the_shards(reference_run, reference, tmpfs):
    """Shards fit, the merged result does not: the message says the shards are intact and names `merge`."""
    disk = tmpfs.mount("64m")
    out = disk / "out"
    shutil.copytree(reference_run, out)     # a finished run of fasta with common
    (out / "result.h5").unlink()
    filler = tmpfs.fill(disk)
    res = run_cli("merge", str(out))
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "no space left on the device" in res.stderr and "shards are intact" in res.stderr
    assert undocumented_files(out) == [] and not (out / "result.h5").exists()
    filler.unlink()
    (command,) = [c for c in suggested_commands(res.stderr) if c[0] == "merge"]
    res = run_cli(*command)
    assert res.returncode == 0, res.stderr
    assert_same(read(out / "result.h5"), reference)

    # A partial merge on the full disk names the partial merge again (it named a plain `merge`, which refuses a
    # run with a shard unfinished).
    (out / "result.h5").unlink()
    (out / "shards" / "shard_1.h5").unlink()
    filler = tmpfs.fill(disk)
    res = run_cli("merge", str(out), "--allow-partial")
    assert res.returncode == 2 and "no space left on the device" in res.stderr, res.stderr
    filler.unlink()
    (command,) = [c for c in suggested_commands(res.stderr) if c[0] == "merge"]
    assert command == ["merge", str(out), "--allow-partial"]
    res = run_cli(*command)
    assert res.returncode == 0 and "partial result" in res.stderr, res.stderr


def test_demo_model_cache_on_a_full_disk(fasta, common, tmpfs, tmp_path):
    """The demo model cannot be materialised: one clear line, no half-built model left in the cache, and
    no --out left behind by the refused run."""
    cache = tmpfs.mount("300k")
    assert common[0] == "--model"
    args = common[2:]     # no --model: the bundled demo model, materialised under RUN_SHARDS_CACHE
    out = tmp_path / "out"
    res = run_cli(fasta, "--out", str(out), *args, env={"RUN_SHARDS_CACHE": str(cache)})
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and "SafetensorError" not in res.stderr, res.stderr
    assert "cannot materialise the demo model" in res.stderr and "RUN_SHARDS_CACHE" in res.stderr
    assert not any("tmp" in p.name for p in (cache / "models").iterdir())
    assert not out.exists()
    res = run_cli(fasta, "--out", str(out), *args, env={"RUN_SHARDS_CACHE": str(tmp_path / "roomy")})
    assert res.returncode == 0, res.stderr



def test_a_cache_that_cannot_be_written_is_named_with_the_setting_that_moves_it(fasta, common, tmpfs, tmp_path):
    """A HOME that cannot be written (a cluster's read-only home, a service user's /nonexistent): the demo model
    goes into run_shards' cache, and the run ended in "cannot use /nonexistent: Permission denied. Run the
    command where the run directory is mounted read-write", which named the wrong folder and no way out. Now the
    cache and RUN_SHARDS_CACHE are named; set as said, the same command runs. (A read-only mount stands for
    the home: root writes through permissions.)"""
    import subprocess
    home = tmpfs.mount("1m")
    done = subprocess.run(["mount", "-o", "remount,ro", str(home)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    args = common[2:]     # no --model: the bundled demo model, materialised under the cache
    out = tmp_path / "out"
    res = run_cli(fasta, "--out", str(out), *args,
                  env={"RUN_SHARDS_CACHE": "", "XDG_CACHE_HOME": "", "HOME": str(home)})
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert f"--model demo is kept in run_shards' cache, and {home}" in res.stderr, res.stderr
    assert "point RUN_SHARDS_CACHE at a folder you can write" in res.stderr and "mounted read-write" not in res.stderr
    res = run_cli(fasta, "--out", str(out), *args,
                  env={"RUN_SHARDS_CACHE": str(tmp_path / "cache"), "XDG_CACHE_HOME": "", "HOME": str(home)})
    assert res.returncode == 0, res.stderr


def test_a_disk_that_fills_while_a_run_is_planned_is_named(fasta, common, reference, tmpfs):
    """Planning's own files (the duplicates' plan, its spill buckets) fill the disk: the message names the file
    that could not be written, so the user knows which disk to free (it said 'cannot write a file'), nothing
    is left in --out, and the same command then gives a clean run's result."""
    disk = tmpfs.mount("1m")
    out = disk / "out"
    for room in (4096, 24576):      # full while the spill buckets are flushed; while the plan is written
        filler = tmpfs.fill(disk)
        os.truncate(filler, filler.stat().st_size - room)
        res = run_cli(fasta, "--out", str(out), *common)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert f"error: cannot write {out}/" in res.stderr and "no space left on the device" in res.stderr, res.stderr
        assert "run the same command again" in res.stderr and not out.exists()
        filler.unlink()
    res = run_cli(fasta, "--out", str(out), *common)
    assert res.returncode == 0, res.stderr
    assert_same(read(out / "result.h5"), reference)
