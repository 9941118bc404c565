"""Merge validation: each way shards can fail to add up gives its own specific error, and no result file.

One real two-worker run provides finished shards; each test damages a copy of them the way a bug, a
stale file or a disk could, and runs the real `run_shards merge`.
"""
import json
import shutil
import subprocess

import h5py
import numpy as np
import pytest

from pipeline.output.h5io import CorruptFile, Reader, Writer
from pipeline.output.sorted_merge import merge_sorted_runs
from pipeline.output.schema import BASE_COLUMNS, Column, RowBlock, Schema

from .conftest import SHARED_DATA
from .tiny_models import run_cli

FASTA = str(SHARED_DATA / "protein_lib.fa")
INTERNAL = ("finished", "complete", "num_sequences", "crc32", "schema")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, models):
    out = tmp_path_factory.mktemp("run") / "out"
    res = run_cli(FASTA, "--out", str(out), "--model", models["demo"], "--gpus", "0", "--workers", "2", "--no-progress")
    assert res.returncode == 0, res.stderr
    return out


@pytest.fixture
def run_copy(finished_run, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(finished_run, out)
    (out / "result.h5").unlink()
    return out


def rewrite_shard(path, change_rows=None, change_attrs=None):
    """Rewrite a shard file through the normal writer (valid checksums), with rows or attributes changed."""
    with Reader(path) as r:
        block = r.read_all()
        attrs = {k: (json.loads(v) if k in ("config", "status_codes", "fasta_files") else v)
                 for k, v in r.attrs.items() if k not in INTERNAL}
        schema = r.schema
    if change_rows:
        block = change_rows(block)
    if change_attrs:
        attrs.update(change_attrs)
    tmp = path.with_name("rewrite.tmp")
    w = Writer(tmp, schema, attrs)
    w.append(block.sorted_by_index())
    w.finish()
    tmp.replace(path)


def merge(out):
    res = run_cli("merge", str(out))
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    assert not (out / "result.h5").exists()
    return res.stderr


def test_merge_of_untouched_shards_succeeds(run_copy):
    res = run_cli("merge", str(run_copy))
    assert res.returncode == 0, res.stderr
    with h5py.File(run_copy / "result.h5") as f:
        assert f.attrs["complete"] and f["index"][:].tolist() == list(range(12))


def test_missing_shard(run_copy):
    (run_copy / "shards" / "shard_1.h5").unlink()
    err = merge(run_copy)
    assert "shard 1 is not finished" in err and f"run_shards rerun {run_copy}" in err


def test_missing_rows(run_copy):
    shard = run_copy / "shards" / "shard_1.h5"
    with Reader(shard) as r:
        dropped = r.read_all().columns["ids"][2].decode()
    rewrite_shard(shard, lambda b: b.take(np.array([0, 1, 3, 4, 5])))
    err = merge(run_copy)
    assert f"1 sequences missing from the shards (first: {dropped})" in err
    report = (run_copy / "merge_problems.tsv").read_text()
    assert report.startswith("missing\t") and dropped in report


def test_duplicate_rows(run_copy):
    with Reader(run_copy / "shards" / "shard_0.h5") as r:
        stolen = r.read_all().take(np.array([0]))
    rewrite_shard(run_copy / "shards" / "shard_1.h5",
                  lambda b: RowBlock.concat(b.schema, [b, stolen]))
    err = merge(run_copy)
    assert f"1 sequences present more than once (first: {stolen.columns['ids'][0].decode()})" in err


def test_extra_rows(run_copy):
    def add_extra(b):
        extra = b.take(np.array([0]))
        extra.columns["index"] = np.array([999], np.int64)
        extra.columns["ids"] = np.array([b"not_in_fasta"], dtype=object)
        return RowBlock.concat(b.schema, [b, extra])
    rewrite_shard(run_copy / "shards" / "shard_0.h5", add_extra)
    err = merge(run_copy)
    assert "1 rows that belong to no FASTA record of this run (first: not_in_fasta)" in err


def test_id_mismatch(run_copy):
    def rename(b):
        b.columns["ids"] = b.columns["ids"].copy()
        b.columns["ids"][0] = b"impostor"
        return b
    rewrite_shard(run_copy / "shards" / "shard_0.h5", rename)
    err = merge(run_copy)
    assert "1 rows whose id differs from the FASTA record at their position (first: impostor at record" in err


def test_shard_from_another_model(run_copy):
    rewrite_shard(run_copy / "shards" / "shard_1.h5", change_attrs={"model_fingerprint": "0123456789abcdef"})
    err = merge(run_copy)
    assert "shard_1.h5 does not belong to this run: model_fingerprint '0123456789abcdef'" in err


def test_shard_with_other_dimensions(run_copy):
    shard = run_copy / "shards" / "shard_1.h5"
    with Reader(shard) as r:
        block = r.read_all()
        attrs = {k: v for k, v in r.attrs.items() if k not in INTERNAL}
    schema = Schema(BASE_COLUMNS + (Column("embeddings/mean", "float32", 32),))
    block = RowBlock(schema, dict(block.columns, **{"embeddings/mean": block.columns["embeddings/mean"][:, :32]}))
    w = Writer(shard, schema, {k: v for k, v in attrs.items()})
    w.append(block)
    w.finish()
    err = merge(run_copy)
    assert "does not belong to this run: different columns or dimensions" in err


def test_corrupted_shard_bytes_are_caught_and_set_aside(run_copy):
    shard = run_copy / "shards" / "shard_0.h5"
    with h5py.File(shard, "r+") as f:   # flip values in place: the file still opens fine
        f["embeddings/mean"][0] = f["embeddings/mean"][0] + 1.0
    err = merge(run_copy)
    assert "checksum mismatch in embeddings/mean" in err and "set aside as shard_0.h5.corrupt" in err
    status = run_cli("status", str(run_copy)).stdout
    assert "pending" in status


def test_window_size_does_not_change_the_merge(tmp_path):
    """The bounded-memory merge gives the same file whatever the window (down to one row)."""
    schema = Schema(BASE_COLUMNS + (Column("v/values", "float32", 3, ragged=True),))
    rng = np.random.default_rng(0)
    n = 40
    lengths = rng.integers(0, 5, n)
    perm = rng.permutation(n)
    paths = []
    for k, rows in enumerate(np.array_split(perm, 3)):
        rows = np.sort(rows)
        block = RowBlock(schema, {
            "ids": np.array([f"s{i}".encode() for i in rows], dtype=object), "index": rows.astype(np.int64),
            "lengths": lengths[rows].astype(np.int32), "num_tokens": lengths[rows].astype(np.int32),
            "truncated": np.zeros(len(rows), bool), "status": np.zeros(len(rows), np.int8),
            "sequence_digest": np.zeros((len(rows), 16), np.uint8)},
            {"v/values": np.concatenate([np.full((lengths[i], 3), i, np.float32) for i in rows])},
            {"v": lengths[rows].astype(np.int64)})
        w = Writer(tmp_path / f"r{k}.h5", schema, {})
        w.append(block)
        w.finish()
        paths.append(tmp_path / f"r{k}.h5")
    outputs = []
    for budget in (1, 100, 1 << 30):
        readers = [Reader(p) for p in paths]
        w = Writer(tmp_path / f"m{budget}.h5", schema, {})
        problems = merge_sorted_runs(readers, w, np.arange(n), np.full(n, 50), budget_bytes=budget)
        w.finish()
        assert not problems
        with h5py.File(tmp_path / f"m{budget}.h5") as f:
            outputs.append((f["index"][:], f["v/values"][:], f["v/offsets"][:]))
    for index, values, offsets in outputs:
        assert index.tolist() == list(range(n))
        assert np.array_equal(np.diff(offsets), lengths)
        assert np.array_equal(values[:, 0], np.repeat(np.arange(n), lengths).astype(np.float32))


def test_a_changed_offset_or_id_index_entry_fails_the_checksums(tmp_path, finished_run):
    """A ragged group's offsets and a result's id index were in no checksum: an offset changed inside a shard
    moved values from one row to the next and the merge wrote them so (the values' own checksum holds), and an
    id index entry changed gave `get` another record's row. Both are checked now (`crc32_other`): the merge,
    `status` and every verification name the dataset."""
    schema = Schema(BASE_COLUMNS + (Column("v/values", "float32", 3, ragged=True),))
    lengths = np.array([2, 3, 1, 4], np.int64)
    rows = np.arange(4)
    block = RowBlock(schema, {
        "ids": np.array([f"s{i}".encode() for i in rows], dtype=object), "index": rows.astype(np.int64),
        "lengths": lengths.astype(np.int32), "num_tokens": lengths.astype(np.int32),
        "truncated": np.zeros(4, bool), "status": np.zeros(4, np.int8),
        "sequence_digest": np.zeros((4, 16), np.uint8)},
        {"v/values": np.concatenate([np.full((lengths[i], 3), i, np.float32) for i in rows])}, {"v": lengths})
    path = tmp_path / "shard.h5"
    w = Writer(path, schema, {})
    w.append(block)
    w.finish()
    with Reader(path) as r:
        r.verify()
    with h5py.File(path, "r+") as f:   # row 1 now starts one value early: rows 0 and 1 trade a value
        f["v/offsets"][1] = f["v/offsets"][1] - 1
    with Reader(path) as r, pytest.raises(CorruptFile, match="checksum mismatch in v/offsets"):
        r.verify()
    with Reader(path) as r:            # read in order, as the merge reads a shard
        r.read(0, 2)
        r.read(2, 4)
        with pytest.raises(CorruptFile, match="checksum mismatch in v/offsets"):
            r.verify_checksums()

    out = tmp_path / "out"
    shutil.copytree(finished_run, out)
    with h5py.File(out / "result.h5", "r+") as f:   # two records' rows swapped in the id index
        table = f["id_index/table"][:]
        asked, held = (f["ids"][int(table["row"][k])].decode() for k in (0, 1))
        table["row"][[0, 1]] = table["row"][[1, 0]]
        f["id_index/table"][...] = table
    # `get` checks each row's id against the one asked for (it reads the row's id anyway), so it says so
    # instead of printing the other record's values, and names the command that says what to do
    got = run_cli("get", str(out), asked)
    assert got.returncode != 0 and not got.stdout
    assert (f"error: {out}/result.h5 is damaged: its id index gives row {int(table['row'][0]):,} for the id "
            f"{asked!r}, and that row holds {held!r}. `run_shards status {out} --verify` checks every checksum and "
            "names what writes it again") in got.stderr, got.stderr
    status = run_cli("status", str(out), "--verify")
    assert f"result: CORRUPT ({out}/result.h5: checksum mismatch in id_index/table); run `run_shards merge {out}`" \
        in status.stdout, status.stdout
    assert run_cli("merge", str(out)).returncode == 0   # (its shards are there: merged again, intact)
    assert "checksums verified" in run_cli("status", str(out)).stdout
    assert run_cli("get", str(out), asked, "--format", "json").stdout.startswith(f'{{"ids": "{asked}"')


def test_a_complete_result_is_never_replaced_by_fewer_rows(finished_run, tmp_path):
    """Once a run is merged its shards may be deleted (README). A `merge` then refused ("shard 0 is not
    finished ... or `run_shards merge OUT --allow-partial` for the rows that exist"), and the partial merge it
    suggested wrote a result of 0 rows over the complete one; with a shard file damaged instead, one of half
    the rows. A complete result that reads back intact is kept (nothing to merge); one that fails its checksums
    is named, with the commands that build it again."""
    out = tmp_path / "out"
    shutil.copytree(finished_run, out)
    whole = (out / "result.h5").read_bytes()
    shard = out / "shards" / "shard_1.h5"   # a damaged shard beside the complete result: cut short
    shard.write_bytes(shard.read_bytes()[:shard.stat().st_size // 2])
    for extra in ((), ("--allow-partial",)):
        res = run_cli("merge", str(out), *extra)
        assert res.returncode == 0, res.stderr
        assert (f"{out} is complete: result.h5 holds all 12 rows, checksums verified; nothing was merged again "
                "(its shards could give only fewer: shard 1 is corrupt") in res.stderr, res.stderr
    shutil.rmtree(out / "shards")   # (what the README says may be deleted once merged)
    for extra in ((), ("--allow-partial",)):
        res = run_cli("merge", str(out), *extra)
        assert res.returncode == 0 and "shard 0 is not finished; shard 1 is not finished)" in res.stderr, res.stderr
    assert (out / "result.h5").read_bytes() == whole

    with h5py.File(out / "result.h5", "r+") as f:   # the complete result damaged: named, not replaced
        f["embeddings/mean"][3] = f["embeddings/mean"][3] + 1.0
    damaged = (out / "result.h5").read_bytes()
    res = run_cli("merge", str(out), "--allow-partial")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert (f"{out}/result.h5 holds all 12 rows of the run but fails its checksums" in res.stderr
            and "checksum mismatch in embeddings/mean" in res.stderr), res.stderr
    assert (out / "result.h5").read_bytes() == damaged
    move = f"mv {out}/result.h5 {out}/result.h5.corrupt"
    assert f"(`{move}`) and run `run_shards rerun {out}`" in res.stderr
    subprocess.run(move.split(), check=True)
    res = run_cli("rerun", str(out), "--no-progress")
    assert res.returncode == 0, res.stderr
    with h5py.File(out / "result.h5") as f, h5py.File(finished_run / "result.h5") as g:
        assert f.attrs["complete"] and f["ids"][:].tolist() == g["ids"][:].tolist()
        assert np.array_equal(f["embeddings/mean"][:], g["embeddings/mean"][:])


def test_an_entry_of_the_wrong_kind_is_named_before_any_work(run_copy):
    """result.h5 made a folder (a mkdir by hand), a worker's log a folder, a shard's checkpoint folder a file:
    `merge` renamed its result onto the folder (a traceback, each time `status` suggested it), and a worker
    failed on the others before it could say why, each rerun again. Every command that works in OUT names the
    entry now, before any work, and `status` says so; with it moved away, the same command works."""
    out = run_copy
    (out / "result.h5").mkdir()
    status = run_cli("status", str(out))
    said = f"{out}/result.h5 is a folder, where run_shards keeps a file. Move it out of {out} (or remove it): " \
           "no command computes or merges there until then"
    assert f"IN THE WAY: {said}" in status.stdout, status.stdout
    merged = run_cli("merge", str(out))
    assert merged.returncode == 2 and f"error: {said}" in merged.stderr, merged.stderr
    assert not list(out.glob(".result.h5.tmp*"))   # refused before the merge wrote anything
    (out / "result.h5").rmdir()
    shutil.rmtree(out / "shards" / "shard_1.parts", ignore_errors=True)
    (out / "shards" / "shard_1.parts").write_text("not a folder")
    (out / "logs" / "worker_0.log").unlink()
    (out / "logs" / "worker_0.log").mkdir()
    res = run_cli("rerun", str(out))
    assert res.returncode == 2, res.stderr
    assert (f"error: {out}/logs/worker_0.log is a folder, where run_shards keeps a file; "
            f"{out}/shards/shard_1.parts is not a folder, where run_shards keeps a folder. Move them out of {out} "
            "(or remove them)") in res.stderr, res.stderr
    res = run_cli("work", str(out), "--shard", "1")   # (a cluster task looks at its own shards' entries only)
    assert res.returncode == 2, res.stderr
    assert f"error: {out}/shards/shard_1.parts is not a folder, where run_shards keeps a folder. Move it" in res.stderr
    (out / "shards" / "shard_1.parts").unlink()
    (out / "logs" / "worker_0.log").rmdir()
    assert run_cli("merge", str(out)).returncode == 0
    assert "checksums verified" in run_cli("status", str(out)).stdout
