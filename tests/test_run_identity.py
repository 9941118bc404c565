"""A run's identity is what it computes, not how its options were spelled (issue 37), through the real CLI on
a tiny ESM-2-style checkpoint (native engine on CPU: batch-invariant, so a continued run's bytes are a clean
run's):

- `--reuse` of a result holding every record ends with a merged result, a crash in planning leaves --out as
  it was, and the same command on a finished run leaves its result as it is;
- the model's identity covers every file its tokenizer reads: a changed vocab.txt is refused by `rerun`, by
  a continued `run` and by `--reuse`, naming the file; run directories and results written before it
  recorded them keep working;
- a continued run compares settings as they resolved (the model's path however written, the defaults that
  `auto` becomes), and a real change is refused with commands that work;
- no output option may name a file the run reads;
- an edit keeping size and mtime is seen (its change time moved) by the index cache and by `rerun`; a stale
  cache that looks current even so is indexed anew by a new run, and the refusal where it cannot be names
  `run_shards index --rebuild`;
- `status`, `get` and the --reuse refusal say the truth about what is durable, missing or the cause.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys

import h5py
import numpy as np
import pytest

from index import InputChanged, SequenceIndex
from index.stride import Only

from .run_helpers import raw_datasets, skip_or_fail, status_rows, suggested_commands, undocumented_files
from .tiny_models import REPO, run_cli

pytestmark = pytest.mark.slow

COMMON = ("--gpus", "0", "--workers", "1", "--max-tokens-per-batch", "500", "--checkpoint-every", "4",
          "--no-progress")
STOP = {"RUN_SHARDS_FAULT_DIE_AT": "part-written", "RUN_SHARDS_FAULT_DIE_AFTER": "1"}


@pytest.fixture(scope="module")
def fasta(tmp_path_factory):
    path = tmp_path_factory.mktemp("fasta") / "in.fasta"
    subprocess.run([sys.executable, str(REPO / "tools" / "make_fasta.py"), "--n", "24", "--seed", "7",
                    "--max-len", "120", str(path)], check=True, capture_output=True)
    return path


@pytest.fixture(scope="module")
def finished(fasta, models, tmp_path_factory):
    """A clean run of the tiny ESM checkpoint over `fasta`."""
    out = tmp_path_factory.mktemp("finished") / "out"
    res = run_cli(str(fasta), "--out", str(out), "--model", models["esm"], *COMMON)
    assert res.returncode == 0, res.stderr
    return out


def stopped_run(fasta, model, out, *extra) -> None:
    """A run whose worker was killed while writing its second checkpoint: one checkpoint durable."""
    res = run_cli(str(fasta), "--out", str(out), "--model", str(model), *COMMON, *extra, env=STOP)
    assert res.returncode == 1, res.stderr
    assert status_rows(out)[0]["state"] == "failed"


def copy_model(models, tmp_path):
    return shutil.copytree(models["esm"], tmp_path / "esm_copy")


def swap_vocab_lines(model) -> None:
    path = model / "vocab.txt"
    lines = path.read_text().splitlines()
    lines[4], lines[5] = lines[5], lines[4]   # L and A trade ids: every sequence tokenizes otherwise
    path.write_text("\n".join(lines) + "\n")


def files_of(out) -> dict:
    return {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


# ----------------------------------------------------------------------------------------- 1. --reuse of all
def test_reuse_of_every_record_merges_and_the_same_command_then_does_nothing(fasta, finished, models, tmp_path):
    """A subset of the records and the same file again, all held by the reused result: exit 0, a merged
    result of the reused rows, no worker and no shard file; `status` reads it; the same command again says
    the run is complete and leaves result.h5 as it is."""
    subset = tmp_path / "subset.fasta"
    text = fasta.read_text()
    subset.write_text(">" + ">".join(text.split(">")[1:6]))   # 5 of its 24 records
    with h5py.File(finished / "result.h5") as f:
        want = {i.decode(): row.tobytes() for i, row in zip(f["ids"][:], f["embeddings/mean"][:])}
    for source, records in ((subset, 5), (fasta, 24)):
        out = tmp_path / f"reuse_{source.stem}"
        command = (str(source), "--out", str(out), "--model", models["esm"], *COMMON, "--reuse", str(finished))
        res = run_cli(*command)
        assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
        assert "0 to compute" in res.stderr and "started shard" not in res.stderr
        with h5py.File(out / "result.h5") as f:
            assert f.attrs["complete"]
            got = {i.decode(): row.tobytes() for i, row in zip(f["ids"][:], f["embeddings/mean"][:])}
        assert len(got) == records and got == {k: want[k] for k in got}
        assert not list((out / "shards").iterdir()) and undocumented_files(out) == []
        status = run_cli("status", str(out))
        assert status.returncode == 0 and "complete" in status.stdout, status.stderr
        before = os.stat(out / "result.h5")
        again = run_cli(*command)
        assert again.returncode == 0, again.stderr
        assert f"{out} is complete: result.h5 holds all {len(got)} rows; nothing was computed or merged again" \
            in again.stderr
        after = os.stat(out / "result.h5")
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_a_stride_table_of_no_records(tmp_path):
    """The run index of a run that copies every record: a stride table of one empty shard (at b99ea2f its
    ids' blob could not be reshaped)."""
    path = tmp_path / "a.fasta"
    path.write_text(">a\nMKV\n>bb\nMK\n")
    SequenceIndex.build([path]).save(tmp_path / "run.rsidx", world=1, only=Only(0, lambda p: np.zeros(len(p), bool)))
    run = SequenceIndex.load(tmp_path / "run.rsidx")
    assert len(run) == 2 and run.stride_shard(0, 1).tolist() == [] and run.shard_stats(1).sequences.tolist() == [0]


def test_a_crash_in_planning_leaves_out_as_it_was(fasta, models, tmp_path):
    """A bug's traceback while the plan is written into OUT (index and copy plan there, no manifest yet):
    an --out the command created is removed, one that existed is left as it was (empty), and the same
    command then runs."""
    crash = {"RUN_SHARDS_FAULT_PLAN_CRASH": "1"}
    new = tmp_path / "new"
    res = run_cli(str(fasta), "--out", str(new), "--model", models["esm"], *COMMON, env=crash)
    assert res.returncode == 1 and "injected crash" in res.stderr
    assert not new.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    res = run_cli(str(fasta), "--out", str(empty), "--model", models["esm"], *COMMON, env=crash)
    assert res.returncode == 1 and list(empty.iterdir()) == []
    res = run_cli(str(fasta), "--out", str(empty), "--model", models["esm"], *COMMON)
    assert res.returncode == 0, res.stderr
    # Killed there instead (SIGKILL: nothing undone): status and rerun name the command that starts it again
    # (they said "the `run_shards run` command that made it", which a script cannot follow), and it works.
    killed = tmp_path / "killed"
    res = run_cli(str(fasta), "--out", str(killed), "--model", models["esm"], *COMMON,
                  env={"RUN_SHARDS_FAULT_PLAN_CRASH": "kill"})
    assert res.returncode == -signal.SIGKILL and (killed / "index.rsidx").exists()
    said = [run_cli(*words, str(killed)).stderr for words in (["status"], ["rerun"])]
    again = re.search(r"killed before its manifest.json was written\): `run_shards (run .*)` starts it again", said[0])
    assert again and said[1] == said[0], said
    assert f"--out {killed} " in again[1] and str(fasta) in again[1]
    res = run_cli(*shlex.split(again[1]))
    assert res.returncode == 0, res.stderr
    assert (killed / "result.h5").exists()


def test_a_run_refused_by_the_lock_leaves_the_run_planning_there_alone(fasta, tmp_path):
    """The same command started twice (a second terminal): the second is refused while the first plans, and
    must not undo the first's plan as if it were its own (at 9014c4f it removed shards/, logs/, the index and
    the lock: the first run's workers then failed, and a third command could take the lock beside it)."""
    from pipeline.errors import RunDirError
    from pipeline.rundir.layout import RunDir
    from pipeline.rundir.locks import RunLock
    import run_shards
    out = tmp_path / "out"
    planning = RunDir(out)
    planning.create()
    (out / "index.rsidx").write_bytes(b"the first command's index, being written")
    with RunLock(planning, "run"):
        before = sorted(p.relative_to(out) for p in out.rglob("*"))
        with pytest.raises(RunDirError, match="is in use by another run_shards command"):
            run_shards.run(str(fasta), out=str(out), gpus=0, workers=1, show_progress=False)
        assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
        assert {".lock", "shards", "logs", "index.rsidx"} <= {p.name for p in out.iterdir()}
        # status and rerun meanwhile say what is there (at 9014c4f: "not a run_shards output directory")
        for command in (run_shards.status, run_shards.rerun):
            with pytest.raises(RunDirError, match=rf"a run is being planned there now \(pid {os.getpid()} on "):
                command(str(out))
    with pytest.raises(RunDirError, match="a run stopped there while it was planned .* the `run_shards run` command"):
        run_shards.status(str(out))   # its planner was killed


# ----------------------------------------------------------------------------------------- 2. the tokenizer
def test_a_tokenizer_changed_mid_run_is_refused_naming_the_file(fasta, finished, models, tmp_path):
    """vocab.txt changed while a run was stopped: `rerun` and the same `run` refuse, naming vocab.txt, and
    each way out they name works: restored, the run finishes with the clean run's bytes; a new run on the
    changed checkpoint runs elsewhere. --reuse of a result of the other tokenizer is refused likewise."""
    model = copy_model(models, tmp_path)
    out = tmp_path / "out"
    stopped_run(fasta, model, out)
    original = (model / "vocab.txt").read_bytes()
    swap_vocab_lines(model)
    res = run_cli("rerun", str(out), "--no-progress")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert f"the model checkpoint of this run, {model}, changed since the run started (vocab.txt changed)" \
        in res.stderr, res.stderr
    (new_run,) = suggested_commands(res.stderr)
    res = run_cli(str(fasta), "--out", str(out), "--model", str(model), *COMMON)
    assert res.returncode == 2 and "(changed: model checkpoint: vocab.txt changed)" in res.stderr, res.stderr
    res = run_cli(str(fasta), "--out", str(tmp_path / "other"), "--model", str(model), *COMMON,
                  "--reuse", str(finished))
    assert res.returncode == 2 and "is refused: its rows were computed with another model" in res.stderr
    assert "vocab.txt changed" in res.stderr, res.stderr
    assert run_cli(*new_run).returncode == 0                # the way out on the checkpoint as it is now
    (model / "vocab.txt").write_bytes(original)            # the other: restore it, and the run finishes
    res = run_cli("rerun", str(out), "--no-progress")
    assert res.returncode == 0, res.stderr
    assert raw_datasets(out / "result.h5")["embeddings/mean"] == raw_datasets(finished / "result.h5")["embeddings/mean"]


def test_runs_and_results_written_before_the_tokenizer_was_recorded_keep_working(fasta, finished, models,
                                                                                  tmp_path):
    """A manifest without the model's files or resolved settings (as b99ea2f wrote them) continues, its
    config.json and weights compared; a result without them is reused, a warning saying what was compared."""
    out = tmp_path / "old"
    stopped_run(fasta, models["esm"], out)
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["model"]["files"], manifest["attrs"]["resolved"], manifest["attrs"]["model_files"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    res = run_cli(str(fasta), "--out", str(out), "--model", models["esm"], *COMMON)
    assert res.returncode == 0, res.stderr
    assert "only its config.json and weights are compared" in res.stderr
    old_result = tmp_path / "old_result.h5"
    shutil.copy(finished / "result.h5", old_result)
    with h5py.File(old_result, "a") as f:
        del f.attrs["resolved"], f.attrs["model_files"]
    res = run_cli(str(fasta), "--out", str(tmp_path / "reused"), "--model", models["esm"], *COMMON,
                  "--reuse", str(old_result))
    assert res.returncode == 0, res.stderr
    assert "written before results recorded the model's tokenizer files: only its config.json and weights are " \
           "compared, and --max-length as given" in res.stderr


# ----------------------------------------------------------------------------------------- 4. resolved values
def test_the_same_run_however_spelled_continues(fasta, finished, models, tmp_path):
    """Planned with a relative --model and the defaults; continued with the absolute path (trailing slash)
    and every default spelled out: the same run, finished with the clean run's bytes."""
    out = tmp_path / "out"
    stopped_run(fasta, os.path.relpath(models["esm"], REPO), out)
    limit = json.loads((out / "manifest.json").read_text())["max_tokens"]
    res = run_cli(str(fasta), "--out", str(out), "--model", models["esm"] + "/", *COMMON, "--dtype", "float32",
                  "--engine", "native", "--input-format", "plain", "--max-length", str(limit))
    assert res.returncode == 0, res.stderr
    assert "holds this same run: continuing from its checkpoints" in res.stderr
    assert raw_datasets(out / "result.h5")["embeddings/mean"] == raw_datasets(finished / "result.h5")["embeddings/mean"]


def test_score_method_auto_and_pll_are_the_same_run_and_a_real_change_is_refused(models, tmp_path):
    fasta = tmp_path / "short.fasta"
    fasta.write_text("".join(f">s{k}\n{'MKTAYIAKQRLGDE'[k % 5:] * 2}\n" for k in range(12)))
    out = tmp_path / "out"
    stopped_run(fasta, models["esm"], out, "--task", "score")
    res = run_cli(str(fasta), "--out", str(out), "--model", models["esm"], *COMMON, "--task", "score",
                  "--dtype", "bfloat16")
    assert res.returncode == 2 and "other settings (changed: --dtype (float32 -> bfloat16))" in res.stderr, res.stderr
    commands = suggested_commands(res.stderr)
    assert ["rerun", str(out)] in commands and any(c[0] == "run" for c in commands)
    res = run_cli(str(fasta), "--out", str(out), "--model", models["esm"], *COMMON, "--task", "score",
                  "--score-method", "pll")
    assert res.returncode == 0, res.stderr
    with h5py.File(out / "result.h5") as f:
        assert f.attrs["score_method"] == "pll" and f.attrs["complete"]


# ----------------------------------------------------------------------------------------- 5. output options
def test_output_options_never_name_a_file_the_run_reads(models, tmp_path):
    """--variants-out onto the FASTA, the variants file or the run's manifest; export -o and get -o onto the
    FASTA, a model file, the result itself: refused before any work, naming the option and the file, which
    keeps its bytes."""
    fasta, variants = tmp_path / "in.fasta", tmp_path / "variants.csv"
    fasta.write_text(">P1\nMKTAYIAKQRQISFVK\n>P2\nACDEFGHIKLMNPQRSTVWY\n")
    variants.write_text("id,mutant\nP1,M1A\nP2,A1C\n")
    kept = {p: p.read_bytes() for p in (fasta, variants)}
    out = tmp_path / "out"
    base = (str(fasta), "--out", str(out), "--model", models["esm"], "--task", "variants", "--variants",
            str(variants), *COMMON)
    for target, what in ((fasta, "is the input FASTA"), (variants, "is the --variants file"),
                         (out / "manifest.json", "is one of the run directory's own files"),
                         (models["esm"] + "/vocab.txt", "lies in the model checkpoint's folder")):
        res = run_cli(*base, "--variants-out", str(target))
        assert res.returncode == 2 and f"--variants-out {target} {what}" in res.stderr, res.stderr
        assert not out.exists()
    assert run_cli(*base, "--variants-out", str(tmp_path / "scores.csv")).returncode == 0
    model_file = os.path.join(models["esm"], "vocab.txt")
    kept[model_file] = open(model_file, "rb").read()
    for command in (("export", str(out), "--format", "per-id-h5", "--column", "score/masked_marginal", "-o"),
                    ("get", str(out), "P1", "-o")):
        for target in (fasta, model_file, out / "result.h5"):
            res = run_cli(*command, str(target))
            assert res.returncode == 2 and f"-o {target} " in res.stderr and "nothing was written" in res.stderr, \
                res.stderr
    assert all(open(p, "rb").read() == data for p, data in kept.items())

    # --out among the run directory's own entries: a run at OUT/.rs-trial was accepted, and the next command
    # in OUT removed it with OUT's spill folders, result and all, without a word.
    for inside, entry in ((out / ".rs-trial", ".rs-trial"), (out / "shards" / "mine", "shards")):
        res = run_cli(str(fasta), "--out", str(inside), "--model", models["esm"], *COMMON)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert (f"--out {inside} lies in the run directory {out}, under its own {entry!r}, which that run's "
                "commands remove or replace; choose an --out outside it") in res.stderr, res.stderr
        assert not inside.exists()
    from pipeline.rundir.layout import RunDir
    nested, spill = out / ".rs-stride-older", out / ".rs-merge-x1y2z3"   # (one put there before the refusal)
    for folder in (nested, spill):
        folder.mkdir()
    (nested / "manifest.json").write_text("{}")
    assert RunDir(out).remove_stale_temporaries() == [spill.name] and nested.is_dir() and not spill.exists()


# ----------------------------------------------------------------------------------------- 8. the index cache
def test_a_stale_index_cache_is_indexed_anew_and_the_way_out_is_named(fasta, models, tmp_path):
    """An edit keeping the file's size and mtime: its change time moved, so `run_shards index` builds anew. Where
    a file system's coarse times keep even that (here: the cache written again with the old text's records
    under the file's stat as it is now), a brand-new run sees a record's checksum differ and indexes the file
    anew (its rows are the edited sequences'), and `index --rebuild` rebuilds; reading a stale index names
    that command."""
    from index import InputFile, cache_path
    path = tmp_path / "edited.fasta"
    shutil.copy(fasta, path)
    assert run_cli("index", str(path)).returncode == 0
    stale = SequenceIndex.build([path])
    st = os.stat(path)
    text = path.read_text()
    first = text.index("\n") + 1
    edited = text[:first] + text[first + 1] + text[first] + text[first + 2:]   # two residues swapped
    assert edited != text
    path.write_text(edited)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert "index: built" in run_cli("index", str(path)).stdout
    stale.inputs = [InputFile.stat(path)]   # what a file system with coarse times would show
    stale.save(cache_path([path]))
    assert "index: reused cached" in run_cli("index", str(path)).stdout
    with pytest.raises(InputChanged, match=r"run_shards index --rebuild \S+edited\.fasta"):
        stale.sequence(0)
    out = tmp_path / "out"
    res = run_cli(str(path), "--out", str(out), "--model", models["esm"], *COMMON)
    assert res.returncode == 0, res.stderr
    assert "is stale" in res.stderr and "indexing the input anew" in res.stderr
    fresh = SequenceIndex.build([path])
    with h5py.File(out / "result.h5") as f:
        digests = [bytes(d) for d in f["sequence_digest"][:]]
    assert digests == [hashlib.blake2b(fresh.sequence(i).encode(), digest_size=16).digest() for i in range(len(fresh))]
    assert "index: built" in run_cli("index", "--rebuild", str(path)).stdout


def test_rerun_refuses_an_edit_that_kept_size_and_mtime(fasta, models, tmp_path):
    """A finished shard holds a record's row; the record is then edited in place with the mtime set back, and
    another shard is computed again: `rerun` refuses, naming the change and both ways out (it merged the old
    text's row as the file's, the file's size and mtime being as they were)."""
    path, out = tmp_path / "in.fasta", tmp_path / "out"
    shutil.copy(fasta, path)
    res = run_cli(str(path), "--out", str(out), "--model", models["esm"], "--shards", "2", *COMMON)
    assert res.returncode == 0, res.stderr
    (out / "result.h5").unlink()
    (out / "shards" / "shard_1.h5").unlink()
    index = SequenceIndex.load(out / "index.rsidx")
    i = int(index.stride_shard(0, 2)[0])   # a record of the finished shard 0
    at = int(index.offsets[i])
    st = os.stat(path)
    data = bytearray(path.read_bytes())
    residue = data.index(b"\n", at) + 1
    data[residue] = ord("W") if data[residue] != ord("W") else ord("A")
    with open(path, "r+b") as fh:
        fh.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    res = run_cli("rerun", str(out), "--no-progress")
    assert res.returncode == 2 and "the input FASTA no longer matches this run" in res.stderr, res.stderr
    assert f"the contents of {path} differ" in res.stderr and not (out / "result.h5").exists()
    suggested = suggested_commands(res.stderr)
    assert [c[:2] for c in suggested] == [["rerun", str(out)], ["run", str(path)]], suggested
    res = run_cli(*suggested[1], "--no-progress")   # the new run on the file as it is now: its rows are the edit's
    assert res.returncode == 0, res.stderr
    with h5py.File(tmp_path / "out-2" / "result.h5") as f:
        assert bytes(f["sequence_digest"][i]) == hashlib.blake2b(SequenceIndex.build([path]).sequence(i).encode(),
                                                                 digest_size=16).digest()
    shutil.copy(fasta, path)   # restored (another inode's bytes copied in: its times moved): the rerun goes on
    res = run_cli("rerun", str(out), "--no-progress")
    assert res.returncode == 0 and (out / "result.h5").exists(), res.stderr


# ----------------------------------------------------------------------------------------- 10. the truth
def test_status_reads_a_copied_run_on_a_read_only_mount(finished, tmp_path):
    """A run directory copied elsewhere (its shards' `.verified` records name other inodes) and mounted read-only:
    `status` reads the shards instead of trusting the records, and works (at 9014c4f it ended in "cannot use
    shards/.shard_0.verified.tmpN: Read-only file system", though status works anywhere)."""
    if os.geteuid() != 0:
        skip_or_fail("a read-only bind mount needs root")
    real, out = tmp_path / "real", tmp_path / "out"
    shutil.copytree(finished, real)
    out.mkdir()
    mounted = subprocess.run(["mount", "--bind", str(real), str(out)], capture_output=True, text=True)
    if mounted.returncode != 0:
        skip_or_fail(f"cannot bind-mount here: {mounted.stderr.strip()}")
    try:
        remount = subprocess.run(["mount", "-o", "remount,ro,bind", str(out)], capture_output=True, text=True)
        assert remount.returncode == 0, remount.stderr
        res = run_cli("status", str(out))
        assert res.returncode == 0, res.stderr
        assert "NOT WRITABLE here" in res.stdout and status_rows(out)[0]["state"] == "complete", res.stdout
        # the page's command is named for where the directory is writable (it read as if it worked here)
        assert f"`run_shards report {out}` writes, where {out} is writable," in res.stdout, res.stdout
        res = run_cli("export", str(out), "--format", "parquet")   # without -o: its default place is named as such
        assert res.returncode == 2 and f"the default output (-o FILE writes elsewhere) {out}/result.parquet: the " \
            f"directory {out} is not writable" in res.stderr, res.stderr
    finally:
        subprocess.run(["umount", str(out)], capture_output=True)


def test_a_fasta_moved_away_is_named_and_no_command_names_its_old_path(models, tmp_path):
    """The FASTA moved (or renamed) after a run stopped: `rerun` says to put it back, and suggests no new run
    on the path where nothing is (at 9014c4f: `run_shards run OLD_PATH --out OUT-2 ...`, which fails)."""
    fasta = tmp_path / "in.fasta"
    fasta.write_text(">a\nMKTAYIAKQR\n>b\nGSHMKT\n")
    out = tmp_path / "out"
    assert run_cli(str(fasta), "--out", str(out), "--model", models["esm"], *COMMON).returncode == 0
    (out / "result.h5").unlink()
    fasta.rename(tmp_path / "moved.fasta")
    res = run_cli("rerun", str(out))
    assert res.returncode == 2 and f"Put {fasta} back where it was" in res.stderr, res.stderr
    assert suggested_commands(res.stderr) == [["rerun", str(out)]], res.stderr


def test_a_result_lost_after_its_shards_were_deleted_is_made_again_by_the_command_status_names(finished,
                                                                                                 tmp_path):
    """The README lets OUT/shards/ be deleted once result.h5 is written. If result.h5 is then damaged (or
    deleted), `status` names the command that makes it again, and that command gives the same bytes (at
    9014c4f status named `merge`, which has no shards to merge, and `rerun` failed on every shard with
    "cannot lock shards/shard_0.lock", as if the run directory were read-only)."""
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    shutil.rmtree(out / "shards")
    assert "; the run is finished" in run_cli("status", str(out)).stdout   # (it said: finishing needs about N more)
    with open(out / "result.h5", "r+b") as fh:
        fh.truncate(4096)
    status = run_cli("status", str(out))
    assert "result: CORRUPT" in status.stdout, status.stdout
    commands = [c for c in suggested_commands(status.stdout) if c[0] != "report"]
    assert commands == [["rerun", str(out)]], status.stdout
    res = run_cli(*commands[0])
    assert res.returncode == 0, res.stderr
    assert raw_datasets(out / "result.h5") == raw_datasets(finished / "result.h5")


def test_status_get_and_the_reuse_refusal_say_the_truth(fasta, finished, models, tmp_path):
    """An interrupted run's status says what is planned and what is durable; a continued run names a default
    budget by its value; `get` of an id a partial result lacks says why and what computes it; the --reuse
    refusal names --no-batch-invariant, --engine hf and bfloat16 as the cause, not a small budget."""
    out = tmp_path / "out"
    stopped_run(fasta, models["esm"], out)
    rows = status_rows(out)
    status = run_cli("status", str(out)).stdout
    assert f"rows: 24 records: 24 to compute ({rows[0]['durable']} computed and durable so far)" in status, status
    assert "24 computed" not in status
    partial = tmp_path / "partial"
    shutil.copytree(out, partial)
    assert run_cli("merge", str(partial), "--allow-partial").returncode == 0
    assert ["rerun", str(partial)] in suggested_commands(run_cli("status", str(partial)).stdout)   # what finishes it
    with h5py.File(partial / "result.h5") as f:
        lacking = f["missing_ids"][0].decode()
    res = run_cli("get", str(partial), lacking)
    assert res.returncode == 2 and f"1 id(s) missing from {partial / 'result.h5'}, a partial result" in res.stderr
    assert [["rerun", str(partial)]] == suggested_commands(res.stderr), res.stderr
    res = run_cli(str(fasta), "--out", str(out), "--model", models["esm"], *COMMON[:4], *COMMON[6:])
    assert res.returncode == 0 and "--max-tokens-per-batch default 4096 (was 500)" in res.stderr, res.stderr
    # The cause of outputs that are not batch-invariant is named where the reused result's are: on a CPU where
    # MKL's strict mode holds (Intel); elsewhere (an AMD EPYC) neither run's are, and the option is named alone.
    with h5py.File(finished / "result.h5") as f:
        claimed = bool(f.attrs["batch_invariant"])
    for option, changed, cause in (
            (("--no-batch-invariant",), "--batch-invariant True (this run: False)",
             "this run's are not: --no-batch-invariant"),
            (("--engine", "hf"), "--engine native (this run: hf)", "this run's are not: --engine hf"),
            (("--dtype", "bfloat16"), "--dtype float32 (this run: bfloat16)",
             "this run's are not: bfloat16 products on CPU run through oneDNN")):
        res = run_cli(str(fasta), "--out", str(tmp_path / "refused"), "--model", models["esm"], *COMMON, *option,
                      "--reuse", str(finished))
        refusal = res.stderr.split("error: ", 1)[-1]   # (bfloat16's warning before it names a budget rightly)
        assert res.returncode == 2 and changed in refusal and "budget" not in refusal, res.stderr
        assert (cause in refusal) == claimed, res.stderr


def test_a_variants_run_planned_before_the_llr_counted_the_end_term_is_neither_continued_nor_mixed(tmp_path):
    """The demo model (a causal LM whose tokenizer ends each sequence with its end token): a variants run planned
    by a run_shards whose llr left that term out (its manifest without `llr_end_term`) is refused by the same
    command, naming the difference, with a command for a new run that works; and `rerun` of its unfinished shard
    stops in the worker before computing a row (no result mixes both llr definitions)."""
    fasta, variants = tmp_path / "in.fasta", tmp_path / "v.csv"
    fasta.write_text(">P1\nMKTAYIAKQRQISFVKSHFSRQ\n")
    variants.write_text("id,mutant\nP1,K2R\nP1,Q22W\n")
    out = tmp_path / "out"
    command = (str(fasta), "--out", str(out), "--model", "demo", "--task", "variants", "--variants", str(variants),
               "--gpus", "0", "--workers", "1", "--no-progress")
    assert run_cli(*command).returncode == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["attrs"].pop("llr_end_term") is True
    (out / "manifest.json").write_text(json.dumps(manifest))   # as the earlier run_shards planned it

    res = run_cli(*command)
    assert res.returncode == 2 and "planned by an earlier run_shards" in res.stderr, res.stderr
    assert "llr leaving out the sequences' end-of-sequence term" in res.stderr
    (retry,) = suggested_commands(res.stderr)
    assert run_cli(*retry).returncode == 0   # the new run it names
    with h5py.File(tmp_path / "out-2" / "result.h5") as f:
        assert f.attrs["llr_end_term"] and np.isfinite(f["variants/llr"][:]).all()

    (out / "result.h5").unlink()
    (out / "shards" / "shard_0.h5").unlink()   # its shard unfinished: `rerun` computes it anew
    res = run_cli("rerun", str(out), "--no-progress")
    assert res.returncode != 0 and "llr leaving out the sequences' end-of-sequence term" in res.stderr, res.stderr
    assert {tuple(c[:2]) for c in suggested_commands(res.stderr)} == {("run", str(fasta))}, res.stderr   # no rerun
    assert not (out / "result.h5").exists() and not (out / "shards" / "shard_0.h5").exists()
