"""Never computing a sequence twice (issue 28), through the CLI with two CPU workers on the demo model (its
native engine's outputs are batch-invariant on CPU):

- within a run, the records of a sequence seen earlier are not computed but written, each as a copy of the
  first one's row, bit for bit what computing it gives (proved by a run where those records come first);
- `--reuse` copies the rows of an earlier result for the sequences it holds and computes only the others,
  bit for bit what computing them gives; a result of another model or setting is refused, saying why;
- once through the local SLURM: the merge job copies the reused rows.
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from index import SequenceIndex

from .run_helpers import raw_datasets, read, suggested_commands, undocumented_files, undocumented_in_schema
from .tiny_models import REPO, run_cli

pytestmark = pytest.mark.slow

VALUES = ("embeddings/mean", "per_residue/values", "lengths", "num_tokens", "truncated", "status", "sequence_digest")


def records(path) -> list[tuple[str, str]]:
    """(header, sequence lines) of each record of a FASTA file."""
    out = []
    for chunk in path.read_text().split(">")[1:]:
        head, _, body = chunk.partition("\n")
        out.append((head, body))
    return out


def write_fasta(path, recs) -> None:
    path.write_text("".join(f">{h}\n{b}" for h, b in recs))


def rows_by_id(out) -> dict[str, dict]:
    """Every row of OUT/result.h5 by id: its value columns (per-residue values as the row's slice)."""
    data = read(out / "result.h5")
    off = data["per_residue/offsets"]
    rows = {}
    for k, i in enumerate(data["ids"]):
        row = {c: data[c][k] for c in VALUES if c != "per_residue/values"}
        row["per_residue/values"] = data["per_residue/values"][off[k]:off[k + 1]]
        row.update(index=int(data["index"][k]), computed_at=int(data["computed_at"][k]),
                   reused_from=int(data["reused_from"][k]))
        rows[i.decode()] = row
    return rows


def same_values(a: dict, b: dict) -> bool:
    return all(np.asarray(a[c]).tobytes() == np.asarray(b[c]).tobytes() and np.asarray(a[c]).shape == np.asarray(b[c]).shape
               for c in VALUES)


def shard_rows(out) -> int:
    total = 0
    for path in (out / "shards").glob("shard_*.h5"):
        with h5py.File(path) as f:
            total += len(f["index"])
    return total


def run(fasta, out, models, *extra, env=None):
    """A run of 2 shards (one worker computes both, in turn)."""
    res = run_cli(str(fasta), "--out", str(out), "--model", models["demo"], "--gpus", "0", "--workers", "1",
                  "--shards", "2", "--per-residue", "--no-progress", *extra, env=env)
    assert res.returncode == 0, res.stderr
    return res


@pytest.fixture(scope="module")
def runs(tmp_path_factory, models):
    """A: 60 records, 6 of them repeating an earlier sequence (other case, line breaks, a stop '*').
    B: 3 new records, then A's, with --reuse A. C: B's records in reverse order, computed afresh (each
    sequence first met at another record than in A and B), also writing report.html."""
    folder = tmp_path_factory.mktemp("copies")
    base = folder / "base.fasta"
    subprocess.run([sys.executable, str(REPO / "tools" / "make_fasta.py"), "--n", "54", "--seed", "5",
                    "--max-len", "90", str(base)], check=True, capture_output=True)
    recs = records(base)
    again = [(f"again{k} repeats {recs[j][0].split()[0]}", recs[j][1].lower().replace("\n", "\n\n") + "*\n")
             for k, j in enumerate((0, 7, 7, 20, 31, 53))]
    a_recs = recs[:30] + again[:3] + recs[30:] + again[3:]
    new = folder / "new.fasta"
    subprocess.run([sys.executable, str(REPO / "tools" / "make_fasta.py"), "--n", "3", "--seed", "6",
                    "--max-len", "90", str(new)], check=True, capture_output=True)
    b_recs = [(h.replace("SYN", "NEW", 1), b) for h, b in records(new)] + a_recs
    fastas = {}
    for name, rs in (("a", a_recs), ("b", b_recs), ("c", b_recs[::-1])):
        fastas[name] = folder / f"{name}.fasta"
        write_fasta(fastas[name], rs)
    outs = {k: folder / f"out_{k}" for k in "abc"}
    logs = {"a": run(fastas["a"], outs["a"], models).stderr,
            "b": run(fastas["b"], outs["b"], models, "--reuse", str(outs["a"])).stderr,
            "c": run(fastas["c"], outs["c"], models, env={"RUN_SHARDS_REPORT": "1"}).stderr}
    return fastas, outs, logs


def test_duplicates_are_computed_once_and_every_row_written(runs):
    fastas, outs, logs = runs
    out = outs["a"]
    index = SequenceIndex.build([fastas["a"]])
    rows = rows_by_id(out)
    with h5py.File(out / "result.h5") as f:
        ids = [i.decode() for i in f["ids"]]
        assert ids == index.ids() and f["index"][:].tolist() == list(range(60))   # one row per record, in order
        assert json.loads(f.attrs["copies"]) == {"records": 60, "computed": 54, "duplicates": 6, "reused": []}
    assert shard_rows(out) == 54   # each sequence computed once
    first = {}
    for i in range(len(index)):
        first.setdefault(index.sequence(i), i)
    for i, name in enumerate(ids):
        row = rows[name]
        assert row["computed_at"] == first[index.sequence(i)] and row["reused_from"] == -1
        assert bytes(row["sequence_digest"]) == hashlib.blake2b(index.sequence(i).encode(), digest_size=16).digest()
        assert same_values(row, rows[ids[row["computed_at"]]])
    assert [name for name in ids if rows[name]["computed_at"] != rows[name]["index"]] == \
        [f"again{k}" for k in range(6)]
    assert "60 records: 54 computed, 6 copied from an earlier record of the same sequence" in logs["a"]
    assert undocumented_files(out) == []


def test_each_copied_row_is_what_computing_it_gives(runs):
    """In C the records 'againK' come before the records they repeat, so C computes them: A's copies of
    them are the same bits."""
    fastas, outs, logs = runs
    a, c = rows_by_id(outs["a"]), rows_by_id(outs["c"])
    for k in range(6):
        assert c[f"again{k}"]["computed_at"] == c[f"again{k}"]["index"] or k == 1   # (again1 repeats again2's)
        assert same_values(a[f"again{k}"], c[f"again{k}"]), k


def test_reuse_computes_only_the_new_records_and_gives_the_same_bits(runs):
    fastas, outs, logs = runs
    b, c, a = rows_by_id(outs["b"]), rows_by_id(outs["c"]), rows_by_id(outs["a"])
    assert shard_rows(outs["b"]) == 3   # only the new records were computed
    with h5py.File(outs["b"] / "result.h5") as f:
        assert json.loads(f.attrs["copies"]) == {"records": 63, "computed": 3, "duplicates": 6, "reused": [54]}
        assert json.loads(f.attrs["reused_from"]) == [str(outs["a"])]
    assert sorted(b) == sorted(c)
    for name, row in b.items():
        assert same_values(row, c[name]), name   # bit-identical to computing it (C computed every sequence)
        if name.startswith("NEW"):
            assert row["reused_from"] == -1 and row["computed_at"] == row["index"]
        else:
            assert row["reused_from"] == 0 and same_values(row, a[name])
    assert f"63 records: 3 computed, 6 copied from an earlier record of the same sequence, 54 reused from " \
           f"{outs['a']}" in logs["b"]
    assert "54 reused from" in (outs["b"] / "logs" / "run.log").read_text()
    status = run_cli("status", str(outs["b"]))
    assert status.returncode == 0 and "rows: 63 records: 3 computed" in status.stdout
    report = (outs["c"] / "report.html").read_text()
    assert "<p id='copies'>Rows: 63 records: 57 computed, 6 copied" in report


def test_a_reused_result_merged_again_keeps_the_run_that_reuses_it_going(runs, tmp_path):
    """`run_shards merge A` once more (the same shards: the same rows and checksums, a new file) while a run
    that reuses A is unmerged: its merge takes A's rows as planned (at 9014c4f it refused for good, A's
    modification time having changed, advising to restore A "as it was"); a result with other rows is
    refused. B's copy plan and index deleted too: `rerun` builds both again, the plan from A as B's manifest
    records it (it was "restore both or start a new run", which computes every row again); where A holds other
    rows, status and rerun name it."""
    import shutil
    fastas, outs, _ = runs
    b2 = tmp_path / "b2"
    shutil.copytree(outs["b"], b2)
    for name in ("result.h5", "copies.rsidx", "index.rsidx"):
        (b2 / name).unlink()
    status = run_cli("status", str(b2)).stdout
    assert f"{b2 / 'index.rsidx'} is missing (deleted or moved); `run_shards rerun {b2}` builds it again" in status
    assert run_cli("merge", str(outs["a"])).returncode == 0
    res = run_cli("rerun", str(b2))
    assert res.returncode == 0, res.stderr
    for name in ("copies.rsidx", "index.rsidx"):
        assert f"{b2 / name} was missing: built again" in res.stderr, res.stderr
        assert (b2 / name).read_bytes() == (outs["b"] / name).read_bytes()
    assert raw_datasets(b2 / "result.h5") == raw_datasets(outs["b"] / "result.h5")
    a = outs["a"] / "result.h5"
    kept = tmp_path / "a_result.h5"
    shutil.copy2(a, kept)
    try:
        shutil.copy2(outs["c"] / "result.h5", a)   # other rows under A's name
        (b2 / "result.h5").unlink()
        res = run_cli("rerun", str(b2))
        assert res.returncode == 2 and "is not the result this run was planned with" in res.stderr, res.stderr
        (b2 / "copies.rsidx").unlink()
        said = f"cannot be built again: --reuse {outs['a']}: {a} is not the result this run was planned with"
        status = run_cli("status", str(b2)).stdout
        assert f"{b2 / 'copies.rsidx'} is missing, and it {said}" in status, status
        res = run_cli("rerun", str(b2))
        assert res.returncode == 2 and "Traceback" not in res.stderr and said in res.stderr, res.stderr
        restore, start_over = suggested_commands(res.stderr)
        assert restore == ["rerun", str(b2)] and start_over[:3] == ["run", str(fastas["b"]), "--out"], res.stderr
    finally:
        shutil.copy2(kept, a)


def test_a_lost_plan_is_built_again_only_from_reused_results_the_manifest_records_as_planned(runs, tmp_path):
    """What a lost copy plan's advice says for B (--reuse A), from B's own manifest: `rerun` builds it again; the
    same manifest without the reused results' records (as a run_shards before 2026-12-07 wrote it) and one whose
    result moved away say why it cannot be, each with the commands that work."""
    from pipeline.planning.copies import plan_advice, rebuildable
    from pipeline.rundir.layout import RunDir

    _, outs, _ = runs
    manifest = json.loads((outs["b"] / "manifest.json").read_text())
    run = RunDir(outs["b"])
    files = manifest["copies"]["files"]
    assert [f["given"] for f in files] == manifest["copies"]["sources"] == [str(outs["a"])]
    assert rebuildable(manifest) and plan_advice(run, manifest, "missing").endswith(
        f"`run_shards rerun {outs['b']}` builds it again and continues the run (its shards are kept)")
    earlier = json.loads(json.dumps(manifest))
    del earlier["copies"]["files"]
    said = plan_advice(run, earlier, "missing")
    assert not rebuildable(earlier) and "only it records the results this run reuses rows of" in said, said
    assert [c[:2] for c in suggested_commands(said)] == [["rerun", str(outs["b"])],
                                                         ["run", manifest["config"]["fasta"][0]]], said
    moved = json.loads(json.dumps(manifest))
    moved["copies"]["files"][0]["path"] = str(tmp_path / "gone.h5")
    said = plan_advice(run, moved, "damaged (checksum mismatch)")
    assert f"cannot be built again: --reuse {outs['a']}: {tmp_path / 'gone.h5'}: No such file" in said, said


def test_a_reused_result_gone_before_the_run_finishes_is_named_before_any_compute(runs, models, tmp_path):
    """A's result.h5 moved away after B (--reuse A) was planned and had computed part of its shards: at
    0aad780 `rerun B` computed every shard, then the merge refused ("cannot merge: ... No such file"), after
    all compute was spent. Now `rerun` and the same `run` refuse before any work, naming the file and both
    ways out, each a command that works: restore it and `rerun` (the shards computed so far are used), or start
    again without that --reuse in another directory."""
    import shutil
    fastas, outs, _ = runs
    a = tmp_path / "a"
    shutil.copytree(outs["a"], a)
    b = tmp_path / "b"
    command = (str(fastas["b"]), "--out", str(b), "--model", models["demo"], "--gpus", "0", "--workers", "1",
               "--per-residue", "--no-progress", "--reuse", str(a), "--checkpoint-every", "1", "--max-seqs", "1")
    res = run_cli(*command, env={"RUN_SHARDS_FAULT_DIE_AT": "part-written", "RUN_SHARDS_FAULT_DIE_AFTER": "1"})
    assert res.returncode == 1, res.stderr   # (stopped with its first checkpoint durable)
    parts = sorted((b / "shards").rglob("part_*.h5"))
    assert parts, res.stderr
    (a / "result.h5").rename(tmp_path / "moved.h5")
    for again in (("rerun", str(b)), command):
        res = run_cli(*again)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert f"{a / 'result.h5'}: No such file or directory" in res.stderr, res.stderr
        assert "started shard" not in res.stderr and not list((b / "shards").glob("shard_*.h5")), res.stderr
        assert sorted((b / "shards").rglob("part_*.h5")) == parts   # the work done so far is kept
        restore, start_over = suggested_commands(res.stderr.split("error: ", 1)[1])
        assert restore == ["rerun", str(b)]
        assert "--reuse" not in start_over and start_over[:3] == ["run", str(fastas["b"]), "--out"]
    res = run_cli(*start_over)   # the way out without A, in another directory
    assert res.returncode == 0, res.stderr
    (tmp_path / "moved.h5").rename(a / "result.h5")   # the other: A put back
    res = run_cli(*restore)
    assert res.returncode == 0, res.stderr
    assert raw_datasets(b / "result.h5") == raw_datasets(outs["b"] / "result.h5")
    assert read(Path(start_over[start_over.index("--out") + 1]) / "result.h5")["embeddings/mean"].tobytes() == \
        read(b / "result.h5")["embeddings/mean"].tobytes()
    (b / "result.h5").unlink()   # every shard computed, A gone again: `merge` names it too, and merges nothing
    (a / "result.h5").rename(tmp_path / "moved.h5")
    res = run_cli("merge", str(b))
    assert res.returncode == 2 and f"{a / 'result.h5'}: No such file or directory" in res.stderr, res.stderr
    (restore_again, start_over_again), = [suggested_commands(res.stderr.split("error: ", 1)[1])]
    assert restore_again == restore and "--reuse" not in start_over_again and not (b / "result.h5").exists()


def test_the_readme_schema_names_every_dataset_and_attribute_of_copies_and_reuse(runs):
    """`computed_at`, `reused_from` (column and attribute) and `copies` are in README's "Output schema", with
    every other dataset and attribute of a result with copied and reused rows (issue 37)."""
    fastas, outs, logs = runs
    for k in "ab":
        assert undocumented_in_schema(outs[k] / "result.h5") == []


def test_reuse_refuses_another_model_or_setting(runs, models, tmp_path):
    fastas, outs, logs = runs
    out = tmp_path / "refused"
    res = run_cli(str(fastas["b"]), "--out", str(out), "--model", models["demo"], "--gpus", "0", "--workers", "2",
                  "--no-progress", "--reuse", str(outs["a"]), "--pool", "cls", "--layers", "0")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert re.search(r"--reuse \S+out_a \(\S+result\.h5\) is refused: its rows were computed with --pool mean "
                     r"\(this run: cls\); with --layers -1 \(this run: 0\); with --per-residue True \(this run: "
                     r"False\)", res.stderr), res.stderr
    assert not out.exists()   # refused before anything was computed or kept
    res = run_cli(str(fastas["b"]), "--out", str(out), "--model", models["llama"], "--gpus", "0", "--workers", "2",
                  "--no-progress", "--per-residue", "--reuse", str(outs["a"]))
    assert res.returncode == 2 and "is refused: its rows were computed with another model" in res.stderr, res.stderr
    (without,) = suggested_commands(res.stderr)   # the run without that --reuse, as it was asked otherwise
    assert "--reuse" not in without and without[without.index("--model") + 1] == models["llama"], without
    assert run_cli(*without).returncode == 0 and (out / "result.h5").exists()
    shutil.rmtree(out)
    res = run_cli(str(fastas["b"]), "--out", str(out), "--model", models["demo"], "--gpus", "0", "--per-residue",
                  "--no-progress", "--reuse", str(tmp_path / "nothing"))
    assert res.returncode == 2 and "--reuse " in res.stderr and "no such result file or run directory" in res.stderr


def test_reuse_through_the_local_slurm(runs, slurm_cluster, models, tmp_path):
    fastas, outs, logs = runs
    out = tmp_path / "slurm"
    res = run_cli(str(fastas["b"]), "--out", str(out), "--model", models["demo"], "--gpus", "0", "--per-residue",
                  "--launcher", "slurm", "--shards", "2", "--wait", "--no-progress", "--reuse", str(outs["a"]),
                  env=slurm_cluster.env, timeout=600)
    assert res.returncode == 0, res.stderr
    got, want = rows_by_id(out), rows_by_id(outs["b"])
    assert sorted(got) == sorted(want)
    assert all(same_values(got[k], want[k]) and got[k]["reused_from"] == want[k]["reused_from"] for k in got)
    assert shard_rows(out) == 3


def test_a_partial_reused_result_completed_since_is_told_with_a_way_to_take_its_rows_now(runs, models, tmp_path):
    """B reuses a partial A (`merge --allow-partial`), then A is completed by its own rerun, which writes A's
    result again: B's planned rows are no longer where it planned them. Planning B warns of it; B's rerun
    refuses (as before) saying what changed, and names, besides putting the file back (which A's rerun made
    impossible) and a run without A, a new run reusing A as it is now, which works."""
    fastas, outs, _ = runs
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(outs["a"], a)
    (a / "result.h5").unlink()
    (a / "shards" / "shard_1.h5").rename(tmp_path / "shard_1.h5")
    assert run_cli("merge", str(a), "--allow-partial").returncode == 0
    command = (str(fastas["b"]), "--out", str(b), "--model", models["demo"], "--gpus", "0", "--workers", "1",
               "--shards", "2", "--per-residue", "--no-progress", "--reuse", str(a))
    res = run_cli(*command, env={"RUN_SHARDS_FAULT_DIE_AT": "part-written", "RUN_SHARDS_FAULT_DIE_AFTER": "0"})
    assert res.returncode == 1, res.stderr
    assert (f"--reuse {a}: {a / 'result.h5'} is a partial result (`merge --allow-partial`): this run copies the rows "
            f"it holds now. Completing it later (`run_shards rerun {a}`) writes it again") in res.stderr, res.stderr
    (tmp_path / "shard_1.h5").rename(a / "shards" / "shard_1.h5")
    assert run_cli("rerun", str(a)).returncode == 0   # A complete now, written again
    res = run_cli("rerun", str(b))
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert f"{a / 'result.h5'} is not the result this run was planned with (other rows or checksums: 60 rows now" \
        in res.stderr, res.stderr
    restore, without, as_now = suggested_commands(res.stderr.split("error: ", 1)[1])
    assert restore == ["rerun", str(b)] and "--reuse" not in without
    assert as_now[as_now.index("--reuse") + 1] == str(a) and as_now[as_now.index("--out") + 1] != str(b)
    res = run_cli(*as_now)
    assert res.returncode == 0, res.stderr
    got, want = rows_by_id(Path(as_now[as_now.index("--out") + 1])), rows_by_id(outs["b"])
    assert sorted(got) == sorted(want) and all(same_values(got[i], want[i]) for i in want)
