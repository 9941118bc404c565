"""Reading results back (issue 28): `run_shards get`, the Python reader and `run_shards export`, on a result
written by two CPU workers through the CLI: exactly the rows of result.h5 for ids at the start, middle and
end, a duplicated id renamed by the run, missing ids named in one clear error, every column through
parquet and per-id HDF5; and `get` on a result merged by the local SLURM's merge job."""
from __future__ import annotations

import datetime
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest

from index import SequenceIndex
from pipeline.errors import UserError
from pipeline.output import id_index
from pipeline.output.get import read_ids
from pipeline.output.result_reader import MissingIds, open_result

from .run_helpers import read, undocumented_files, undocumented_in_schema
from .tiny_models import REPO, run_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def result(tmp_path_factory, models):
    """A per-residue run of 62 records (one id given twice, renamed 'dupe.dup2'; two records of the same
    residues written differently), two CPU workers."""
    folder = tmp_path_factory.mktemp("reader")
    fasta = folder / "in.fasta"
    subprocess.run([sys.executable, str(REPO / "tools" / "make_fasta.py"), "--n", "60", "--seed", "9",
                    "--max-len", "120", str(fasta)], check=True, capture_output=True)
    text = fasta.read_text().replace(">SYN000000010 ", ">dupe ").replace(">SYN000000040 ", ">dupe ")
    fasta.write_text(text + ">same1\nMKVLA\nGW\n>same2 the same residues\nmkv\nlagw*\n")
    out = folder / "out"
    res = run_cli(str(fasta), "--out", str(out), "--model", models["demo"], "--gpus", "0", "--workers", "2",
                  "--per-residue", "--on-duplicate-id", "rename", "--no-progress")
    assert res.returncode == 0, res.stderr
    assert undocumented_files(out) == [] and undocumented_in_schema(out / "result.h5") == []
    with h5py.File(out / "result.h5") as f:   # an unambiguous time: it had no UTC offset (a cluster's nodes and
        created = datetime.datetime.fromisoformat(f.attrs["created"])   # its users need not share a time zone)
    assert created.utcoffset() is not None and abs(datetime.datetime.now(datetime.timezone.utc) - created).days == 0
    data = read(out / "result.h5")
    ids = [i.decode() for i in data["ids"]]
    return out, data, ids


def row_of(data: dict, k: int) -> dict:
    off = data["per_residue/offsets"]
    return {"ids": data["ids"][k].decode(), **{c: data[c][k] for c in ("index", "lengths", "num_tokens", "truncated",
                                                                       "status", "sequence_digest", "embeddings/mean",
                                                                       "computed_at", "reused_from")},
            "per_residue/values": data["per_residue/values"][off[k]:off[k + 1]]}


def same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert np.array_equal(np.asarray(got[key]), np.asarray(value)), key


def picks(ids: list[str]) -> list[int]:
    return [0, len(ids) // 2, len(ids) - 1, ids.index("dupe.dup2"), ids.index("dupe")]


def test_reader_returns_exactly_the_rows_of_the_result(result):
    out, data, ids = result
    with open_result(out) as res:
        assert len(res) == len(ids) == 62
        assert res.ids is not None   # the merge wrote the id index
        for k in picks(ids):
            same(res.get(ids[k]), row_of(data, k))
            same(res.at_position(int(data["index"][k])), row_of(data, k))
            assert np.array_equal(res.per_residue(k, "per_residue/values"), row_of(data, k)["per_residue/values"])
        assert res.rows([ids[-1], ids[0]]).tolist() == [61, 0]
        chunks = list(res.chunks(7, ["ids", "embeddings/mean", "per_residue/values"]))
        assert [i for c in chunks for i in c["ids"]] == ids
        assert np.array_equal(np.concatenate([c["embeddings/mean"] for c in chunks]), data["embeddings/mean"])
        flat = [v for c in chunks for v in c["per_residue/values"]]
        assert all(np.array_equal(flat[k], row_of(data, k)["per_residue/values"]) for k in range(len(ids)))
        with pytest.raises(MissingIds, match=r"2 id\(s\) not in .*result.h5: 'nope', 'SYN'\. "):
            res.rows(["nope", ids[3], "SYN"])


def test_each_row_has_the_digest_of_its_residues(result):
    """BLAKE2b-128 of the residues as the index reads them: the two records of the same residues (other
    line breaks, lower case, a stop '*') share it, every other row has its own."""
    out, data, ids = result
    index = SequenceIndex.build([out.parent / "in.fasta"])
    want = [hashlib.blake2b(index.sequence(i).encode(), digest_size=16).digest() for i in range(len(index))]
    assert [bytes(d) for d in data["sequence_digest"][data["index"]]] == want
    same1, same2 = ids.index("same1"), ids.index("same2")
    assert bytes(data["sequence_digest"][same1]) == bytes(data["sequence_digest"][same2])
    assert len({bytes(d) for d in data["sequence_digest"]}) == len(ids) - 1


def test_the_id_index_is_sorted_hashes_with_their_rows(result):
    out, data, ids = result
    with h5py.File(out / "result.h5") as f:
        table = f["id_index/table"]
        assert table.chunks is None   # contiguous: a lookup reads no chunk index
        table = table[:]
        hashes, rows = table["hash"], table["row"]
        assert np.all(hashes[1:] >= hashes[:-1]) and sorted(rows.tolist()) == list(range(len(ids)))
        assert hashes.tolist() == id_index.hashes_of([ids[r] for r in rows]).tolist()
        assert table["check"].tolist() == id_index.hashes_of([ids[r] for r in rows], check=True).tolist()
        assert f["id_index/fence"][:].tolist() == hashes[::id_index.BLOCK].tolist()


def test_an_id_index_of_the_earlier_layout_is_read(result, tmp_path):
    """Results merged before the check hash have `hashes` and `rows`: each match is checked by its id."""
    out, data, ids = result
    copy = tmp_path / "result.h5"
    copy.write_bytes((out / "result.h5").read_bytes())
    with h5py.File(copy, "r+") as f:
        table = f["id_index/table"][:]
        del f["id_index/table"]
        f["id_index"].create_dataset("hashes", data=table["hash"], chunks=(4,))
        f["id_index"].create_dataset("rows", data=table["row"], chunks=(4,))
        del f["id_index/fence"]
        f["id_index"].create_dataset("fence", data=table["hash"][::4])
        f["id_index"].attrs["block"] = 4
    with open_result(copy) as res:
        assert not res.ids.checked
        for k in picks(ids):
            same(res.get(ids[k]), row_of(data, k))
        with pytest.raises(MissingIds, match="'gone'"):
            res.rows(["gone"])


def test_an_old_result_without_id_index_is_searched(result, tmp_path):
    out, data, ids = result
    copy = tmp_path / "result.h5"
    copy.write_bytes((out / "result.h5").read_bytes())
    with h5py.File(copy, "a") as f:
        del f["id_index"]
    with open_result(copy) as res:
        assert res.ids is None
        same(res.get(ids[30]), row_of(data, 30))
        with pytest.raises(MissingIds, match="'gone'"):
            res.rows(["gone"])


def test_get_through_the_cli_in_each_format(result, tmp_path):
    out, data, ids = result
    chosen = [ids[k] for k in picks(ids)]
    tsv = run_cli("get", str(out), *chosen)
    assert tsv.returncode == 0, tsv.stderr
    lines = tsv.stdout.splitlines()
    assert lines[0].split("\t") == ["ids", "index", "lengths", "num_tokens", "truncated", "status", "sequence_digest",
                                    "embeddings/mean", "per_residue/values", "computed_at", "reused_from"]
    for line, k in zip(lines[1:], picks(ids)):
        cells = line.split("\t")
        assert cells[0] == ids[k] and int(cells[1]) == data["index"][k]
        assert np.array_equal(np.array(cells[6].split(","), np.uint8), data["sequence_digest"][k])
        assert np.array_equal(np.array(cells[7].split(","), np.float32), data["embeddings/mean"][k])
        per_residue = np.array([t.split(",") for t in cells[8].split(";")], np.float16)
        assert np.array_equal(per_residue, row_of(data, k)["per_residue/values"])

    ids_file = tmp_path / "ids.txt"
    ids_file.write_text("\n".join(chosen[:2]) + "\n\n")
    js = run_cli("get", str(out / "result.h5"), chosen[2], "--ids-from", str(ids_file), "--format", "json")
    assert js.returncode == 0, js.stderr
    objects = [json.loads(line) for line in js.stdout.splitlines()]
    assert [o["ids"] for o in objects] == [chosen[2], chosen[0], chosen[1]]
    for o, k in zip(objects, [picks(ids)[2], picks(ids)[0], picks(ids)[1]]):
        same({c: np.asarray(v, dtype=np.asarray(row_of(data, k)[c]).dtype) if c != "ids" else v
              for c, v in o.items()}, row_of(data, k))

    npz = tmp_path / "rows.npz"
    done = subprocess.run([sys.executable, str(REPO / "bin" / "run_shards"), "get", str(out), "--ids-from", "-",
                           "--format", "npy", "-o", str(npz)], input="\n".join(chosen), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    with np.load(npz) as arrays:
        assert arrays["ids"].tolist() == chosen
        assert np.array_equal(arrays["embeddings/mean"], data["embeddings/mean"][picks(ids)])
        offsets = arrays["per_residue/values.offsets"]
        for j, k in enumerate(picks(ids)):
            assert np.array_equal(arrays["per_residue/values"][offsets[j]:offsets[j + 1]],
                                  row_of(data, k)["per_residue/values"])


def test_get_names_missing_ids_and_other_mistakes_in_one_line(result, tmp_path):
    out, _, ids = result
    missing = run_cli("get", str(out), ids[0], "nope", "dupe.dup9")
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert re.match(r"error: 2 id\(s\) not in .*result\.h5: 'nope', 'dupe\.dup9'\. ", missing.stderr), missing.stderr
    assert missing.stdout == ""
    header = run_cli("get", str(out), f">{ids[0]} its description")   # a FASTA header line pasted as the id
    assert header.returncode == 2 and (f"'>{ids[0]} its description' is looked up as written: `--ids-from FILE` "
                                       "reads FASTA header lines") in header.stderr, header.stderr
    planned = tmp_path / "planned"   # (a run directory whose result is not merged yet)
    planned.mkdir()
    shutil.copy(out / "manifest.json", planned)
    for args, message in (((str(out),), "no ids given"),
                          ((str(out), ids[0], "--format", "npy"), "--format npy writes a file"),
                          ((str(tmp_path / "none"), ids[0]), "no such result file or run directory"),
                          ((str(tmp_path), ids[0]), "is not a run_shards run directory (it holds neither "
                                                    "result.h5 nor manifest.json): give the --out folder of a run"),
                          ((str(out.parent), ids[0]), "is not a run_shards run directory"),
                          ((str(planned), ids[0]), "holds no result.h5 yet: `run_shards status")):
        res = run_cli("get", *args)
        assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert read_ids(["a"], "-", io.StringIO(">b desc\n\nc\n")) == ["a", "b", "c"]
    assert read_ids([], "-", io.StringIO(">>x desc\n> y\n>\n")) == [">x", "y"]   # '>x' is the id of '>>x'
    with pytest.raises(UserError, match=r"no ids given \(standard input has header lines without an id, a '>' and "
                                        r"nothing after it: line\(s\) 1, 3\)"):
        read_ids([], "-", io.StringIO(">\n\n>  \n"))
    # -o in a folder that does not exist: named before any work (at 9014c4f export ended in pyarrow's traceback
    # and get advised a read-write mount of the run directory)
    from pipeline.output.export import export
    from pipeline.output.get import get
    nowhere = tmp_path / "no_such_folder"
    for write in (lambda: get(out, [ids[0]], "json", nowhere / "rows.json"),
                  lambda: get(out, [ids[0]], "npy", nowhere / "rows.npz"),
                  lambda: export(out, "parquet", nowhere / "r.parquet"),
                  lambda: export(out, "per-id-h5", nowhere / "r.h5", "embeddings/mean")):
        with pytest.raises(UserError, match=f"-o {nowhere}/.*: the directory {nowhere} does not exist; create it"):
            write()
    assert not nowhere.exists()
    with pytest.raises(UserError, match="--ids-from .*nothing.txt"):
        read_ids([], str(tmp_path / "nothing.txt"))


def _fail_after(real, calls: int, fail):
    """`real`, failing with `fail()` from its call number calls + 1 on."""
    count = iter(range(calls))
    return lambda *args, **kwargs: real(*args, **kwargs) if next(count, None) is not None else fail()


def _interrupt():
    raise KeyboardInterrupt


EARLIER = b"the user's earlier file\n"


@pytest.mark.parametrize("fmt", ["tsv", "json", "npy"])
def test_get_o_failing_mid_write_leaves_the_earlier_file_and_no_temporary(result, tmp_path, monkeypatch, fmt):
    """`get -o` wrote its target in place: a failure while writing (a value that cannot be encoded, a full
    disk, Ctrl-C) left half a file, or an empty one, where the result was asked for, over the file that was
    there. Now it is written under a temporary name renamed into place: the target keeps its earlier content
    and the temporary is removed, whatever the failure (KeyboardInterrupt too)."""
    from pipeline.output import get as rows
    out, _, ids = result
    unencodable = "\udc80".__str__   # (a lone surrogate: UTF-8 cannot write it)
    where, what, fail = {"tsv": (rows, "_cell", unencodable), "json": (rows.json, "dumps", unencodable),
                         "npy": (np.lib.format, "write_array", _interrupt)}[fmt]
    target = tmp_path / f"rows.{fmt}"
    target.write_bytes(EARLIER)
    with monkeypatch.context() as patched:   # (the first rows or arrays written, then the failure)
        patched.setattr(where, what, _fail_after(getattr(where, what), 3, fail))
        with pytest.raises((KeyboardInterrupt, UnicodeEncodeError)):
            rows.get(out, ids, fmt, target)
    assert target.read_bytes() == EARLIER and sorted(tmp_path.iterdir()) == [target]
    assert rows.get(out, ids[:2], fmt, target) == f"wrote 2 row(s) to {target}"   # and the same call works
    assert target.read_bytes() != EARLIER


@pytest.mark.parametrize("fmt,writes", [("per-id-h5", "per_id_name"), ("parquet", "_arrow_column")])
def test_export_interrupted_mid_write_leaves_the_earlier_file_and_no_temporary(result, tmp_path, monkeypatch, fmt,
                                                                               writes):
    """export shares get's temporary file renamed into place (rundir.layout.atomic_path)."""
    from pipeline.output import export as exports
    out, _, _ = result
    target = tmp_path / f"result.{fmt}"
    target.write_bytes(EARLIER)
    monkeypatch.setattr(exports, writes, _fail_after(getattr(exports, writes), 3, _interrupt))
    with pytest.raises(KeyboardInterrupt):
        exports.export(out, fmt, target, "embeddings/mean" if fmt == "per-id-h5" else None)
    assert target.read_bytes() == EARLIER and sorted(tmp_path.iterdir()) == [target]


def test_export_parquet_round_trips_every_column(result, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    out, data, ids = result
    done = run_cli("export", str(out), "--format", "parquet")
    assert done.returncode == 0, done.stderr
    table = pq.read_table(out / "result.parquet")
    (out / "result.parquet").unlink()
    assert table.column_names == ["ids", "index", "lengths", "num_tokens", "truncated", "status", "sequence_digest",
                                  "embeddings/mean", "per_residue/values", "computed_at", "reused_from"]
    assert table.column("ids").to_pylist() == ids
    for name in ("index", "lengths", "num_tokens", "truncated", "status", "computed_at", "reused_from"):
        assert np.array_equal(table.column(name).to_numpy(), data[name]), name
    for name, dtype in (("embeddings/mean", np.float32), ("sequence_digest", np.uint8)):
        assert np.array_equal(np.array(table.column(name).to_pylist(), dtype), data[name]), name
    per_residue = table.column("per_residue/values").to_pylist()
    for k in range(len(ids)):
        assert np.array_equal(np.array(per_residue[k], np.float16).reshape(-1, 64),
                              row_of(data, k)["per_residue/values"]), k
    attrs = json.loads(table.schema.metadata[b"run_shards"])
    assert attrs["task"] == "embed" and attrs["num_sequences"] == 62


def test_export_parquet_widens_float16_for_older_readers_only_when_asked(result, tmp_path):
    """Parquet's FLOAT16 type (per-residue values stored as float16) is read by pyarrow 15 and later, DuckDB and
    Polars; pyarrow 14 cannot open such a file at all ("Thrift LogicalType that is not recognized"). The default
    keeps the stored type; --widen-float16 writes float32, the very same values, and applies to parquet only."""
    pq = pytest.importorskip("pyarrow.parquet")
    import run_shards
    from pipeline.errors import UserError
    out, data, ids = result
    kept = run_shards.export(out, "parquet", tmp_path / "kept.parquet")
    wide = run_shards.export(out, "parquet", tmp_path / "wide.parquet", widen_float16=True)
    assert str(pq.read_schema(kept).field("per_residue/values").type.value_type.value_type) == "halffloat"
    table = pq.read_table(wide)
    assert str(table.schema.field("per_residue/values").type.value_type.value_type) == "float"
    assert table.schema.field("embeddings/mean").type == pq.read_schema(kept).field("embeddings/mean").type
    per_residue = table.column("per_residue/values").to_pylist()
    for k in range(len(ids)):
        values = np.array(per_residue[k], np.float32).reshape(-1, 64)
        assert np.array_equal(values, row_of(data, k)["per_residue/values"].astype(np.float32)), k
    with pytest.raises(UserError, match="applies only to --format parquet"):
        run_shards.export(out, "per-id-h5", tmp_path / "x.h5", widen_float16=True)
    assert not (tmp_path / "x.h5").exists()
    with pytest.raises(UserError, match="--column applies only to --format per-id-h5"):   # (at 17c2823: ignored)
        run_shards.export(out, "parquet", tmp_path / "x.parquet", "embeddings/mean")
    assert not (tmp_path / "x.parquet").exists()


def test_export_per_id_h5_as_uniprot_per_protein(result, tmp_path):
    out, data, ids = result
    target = tmp_path / "per-protein.h5"
    done = run_cli("export", str(out), "--format", "per-id-h5", "-o", str(target))
    assert done.returncode == 0, done.stderr
    with h5py.File(target) as f:
        assert sorted(f) == sorted(ids) and f.attrs["column"] == "embeddings/mean"
        for k, i in enumerate(ids):
            assert np.array_equal(f[i][:], data["embeddings/mean"][k])
    residues = run_cli("export", str(out), "--format", "per-id-h5", "--column", "per_residue/values", "-o",
                       str(tmp_path / "per-residue.h5"))
    assert residues.returncode == 0, residues.stderr
    with h5py.File(tmp_path / "per-residue.h5") as f:
        for k in picks(ids):
            assert np.array_equal(f[ids[k]][:], row_of(data, k)["per_residue/values"])
    wrong = run_cli("export", str(out), "--format", "per-id-h5", "--column", "lengths")
    assert wrong.returncode == 2 and "a model output column, not lengths" in wrong.stderr


def test_export_reads_per_residue_values_within_its_budget_where_long_records_cluster(models, tmp_path,
                                                                                     monkeypatch):
    """A FASTA sorted by length: 400 peptides of 8 residues, then 12 records of 3,000. export cut the rows by the
    file's mean bytes per row, so the last range held all 12 long records, 23 times its budget (at UniProt's
    scale, a few thousand titin-like records after a million peptides, tens of GB read at once). Every range
    export reads now stays within ROW_GROUP_BYTES (a single row larger than that alone), and the values
    written are the file's."""
    pq = pytest.importorskip("pyarrow.parquet")
    from pipeline.output import export as exports
    from pipeline.output.result_reader import ResultFile
    rng = np.random.default_rng(0)
    letters = np.array(list("ACDEFGHIKLMNPQRSTVWY"))
    fasta = tmp_path / "sorted.fasta"
    fasta.write_text("".join(f">s{i}\n{''.join(rng.choice(letters, 8))}\n" for i in range(400))
                     + "".join(f">L{i}\n{''.join(rng.choice(letters, 3000))}\n" for i in range(12)))
    out = tmp_path / "out"
    res = run_cli(str(fasta), "--out", str(out), "--model", models["demo"], "--gpus", "0", "--workers", "1",
                  "--per-residue", "--no-progress")
    assert res.returncode == 0, res.stderr
    data = read(out / "result.h5")
    width = data["per_residue/values"].shape[1]
    budget = 200_000   # bytes: 1,000 residues of 64 float16 values, a third of one long record
    monkeypatch.setattr(exports, "ROW_GROUP_BYTES", budget)
    reads = []
    slice_of = ResultFile._slice

    def counted(self, c, a, b):
        values = slice_of(self, c, a, b)
        if c.ragged:
            reads.append((b - a, sum(v.nbytes for v in values)))
        return values
    monkeypatch.setattr(ResultFile, "_slice", counted)
    exports.export(out, "per-id-h5", tmp_path / "per-residue.h5", "per_residue/values")
    assert reads and all(size <= budget or rows == 1 for rows, size in reads), reads
    assert sum(rows for rows, _ in reads) == 412
    with h5py.File(tmp_path / "per-residue.h5") as f:
        off = data["per_residue/offsets"]
        for k, seq_id in enumerate(data["ids"]):
            assert np.array_equal(f[seq_id.decode()][:], data["per_residue/values"][off[k]:off[k + 1]])
    target = exports.export(out, "parquet", tmp_path / "r.parquet")
    meta = pq.ParquetFile(target).metadata
    rows = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
    starts = np.concatenate([[0], np.cumsum(rows)])
    off = data["per_residue/offsets"]
    sizes = [(off[b] - off[a]) * width * 2 for a, b in zip(starts[:-1], starts[1:])]
    assert all(size <= budget or n == 1 for n, size in zip(rows, sizes)), list(zip(rows, sizes))
    values = pq.read_table(target).column("per_residue/values").to_pylist()
    assert all(np.array_equal(np.array(values[k], np.float16).reshape(-1, width),
                              data["per_residue/values"][off[k]:off[k + 1]]) for k in (0, 399, 400, 411))


def test_get_on_a_result_merged_by_slurm(slurm_cluster, models, tmp_path):
    fasta = tmp_path / "in.fasta"
    subprocess.run([sys.executable, str(REPO / "tools" / "make_fasta.py"), "--n", "12", "--seed", "3",
                    "--max-len", "80", str(fasta)], check=True, capture_output=True)
    out = tmp_path / "out"
    res = run_cli(str(fasta), "--out", str(out), "--model", models["demo"], "--gpus", "0", "--launcher", "slurm",
                  "--shards", "2", "--wait", "--no-progress", env=slurm_cluster.env, timeout=600)
    assert res.returncode == 0, res.stderr
    data = read(out / "result.h5")
    got = run_cli("get", str(out), "SYN000000011", "SYN000000000", "--format", "json")
    assert got.returncode == 0, got.stderr
    rows = [json.loads(line) for line in got.stdout.splitlines()]
    for row, k in zip(rows, (11, 0)):
        assert row["ids"] == data["ids"][k].decode() and row["index"] == k
        assert np.array_equal(np.array(row["embeddings/mean"], np.float32), data["embeddings/mean"][k])


def test_per_id_names_escape_slashes_and_leave_out_rows_without_values(tmp_path):
    """A '/' would make HDF5 groups: written as '%2F' (and '%' as '%25'), and an id '.', HDF5's name of the
    file's root (at 9014c4f a traceback: "name already exists"), as '%2E'; said in an attribute; a row skipped
    by its status has no values to write."""
    from pipeline.output.export import export
    from pipeline.output.h5io import Writer
    from pipeline.output.schema import BASE_COLUMNS, Column, RowBlock, Schema
    schema = Schema(BASE_COLUMNS + (Column("embeddings/mean", "float32", 3),))
    rows = 5
    w = Writer(tmp_path / "result.h5", schema, {"task": "embed"})
    w.append(RowBlock(schema, {"ids": np.array([b"a/b", b"50%", b"c", b".", b".."], dtype=object),
                               "index": np.arange(rows), "lengths": np.ones(rows, np.int32),
                               "num_tokens": np.ones(rows, np.int32), "truncated": np.zeros(rows, bool),
                               "status": np.array([0, 2, 1, 0, 0], np.int8),
                               "sequence_digest": np.zeros((rows, 16), np.uint8),
                               "embeddings/mean": np.arange(15, dtype=np.float32).reshape(5, 3)}))
    w.finish()
    target = export(tmp_path / "result.h5", "per-id-h5")
    with h5py.File(target) as f:
        assert sorted(f) == ["%2E", "..", "50%25", "a%2Fb"] and f.attrs["name_escaping"].startswith("3 id(s) ")
        assert f["a%2Fb"][:].tolist() == [0, 1, 2] and f["50%25"][:].tolist() == [3, 4, 5]
        assert f["%2E"][:].tolist() == [9, 10, 11] and f[".."][:].tolist() == [12, 13, 14]


def test_an_id_hashes_the_same_whatever_the_process_hashed_before():
    """`get` hashes one short id in a fresh process (small power tables, grown later); the merge hashed
    millions (large tables): both give the hash written out by hand, h = sum (byte + 1) B**j + len L."""
    from index import id_hash

    def by_hand(ident: bytes, check: bool) -> int:
        base, length = (id_hash._CHECK_BASE, id_hash._CHECK_LEN) if check else (id_hash._HASH_BASE, id_hash._HASH_LEN)
        return (sum((b + 1) * pow(int(base), j, 2**64) for j, b in enumerate(ident)) + len(ident) * int(length)) % 2**64

    rng = np.random.default_rng(3)
    ids = [b"P12345", b"x", bytes(rng.integers(33, 127, 3000, dtype=np.uint8))] \
        + [b"A0A%07d" % k for k in range(2000)]
    for check in (False, True):
        id_hash._TABLES.clear()
        first = [int(id_index.hashes_of([i], check=check)[0]) for i in ids[:3]]   # tables grown one id at a time
        together = id_index.hashes_of(ids, check=check).tolist()
        assert first == together[:3] and together == [by_hand(i, check) for i in ids]


def _text_result(path) -> list[str]:
    """A result of generate's columns (a text per row, as a BPE model's line-break tokens write it) and a
    score, written by the merge's own writer; the texts it holds."""
    from pipeline.output.h5io import Writer
    from pipeline.output.schema import BASE_COLUMNS, STR, Column, RowBlock, Schema
    texts = ["MKV\nLAGW\nQ", "tab\there", "back\\slash\r\n", ""]
    schema = Schema(BASE_COLUMNS + (Column("generate/text", STR), Column("score/logprob_sum", "float64")))
    rows = len(texts)
    w = Writer(path, schema, {"task": "generate"})
    w.append(RowBlock(schema, {"ids": np.array([b"a", b"b", b"c", b"d"], dtype=object), "index": np.arange(rows),
                               "lengths": np.ones(rows, np.int32), "num_tokens": np.ones(rows, np.int32),
                               "truncated": np.zeros(rows, bool), "status": np.zeros(rows, np.int8),
                               "sequence_digest": np.zeros((rows, 16), np.uint8),
                               "generate/text": np.array(texts, dtype=object),
                               "score/logprob_sum": np.array([-1.5, -2.25, 0.0, np.nan])}))
    w.finish()
    return texts


def test_get_tsv_keeps_a_text_with_line_breaks_and_tabs_on_its_row(tmp_path):
    """generate/text of a BPE model (ProtGPT2 writes a line break every 60 residues) holds newlines: at
    17f6bc6 `get` printed them as they are, splitting a row over several lines and shifting its cells.
    Now a tab, newline, CR and backslash are escaped (\\t \\n \\r \\\\): a row per line, each cell in place."""
    texts = _text_result(tmp_path / "result.h5")
    done = run_cli("get", str(tmp_path / "result.h5"), "a", "b", "c", "d")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split("\n")
    assert lines[-1] == "" and len(lines) == 1 + 4 + 1   # the header, a line per id
    header = lines[0].split("\t")
    cells = [dict(zip(header, line.split("\t"))) for line in lines[1:-1]]
    assert all(len(line.split("\t")) == len(header) for line in lines[1:-1])
    assert [c["generate/text"] for c in cells] == ["MKV\\nLAGW\\nQ", "tab\\there", "back\\\\slash\\r\\n", ""]
    unescape = {"\\\\": "\\", "\\t": "\t", "\\n": "\n", "\\r": "\r"}
    assert [re.sub(r"\\[\\tnr]", lambda m: unescape[m.group()], c["generate/text"]) for c in cells] == texts
    assert [c["score/logprob_sum"] for c in cells] == ["-1.5", "-2.25", "0.0", "nan"]


def test_per_id_h5_of_a_text_or_score_column(tmp_path):
    """At 17f6bc6 `export --format per-id-h5 --column generate/text` ended in h5py's traceback ("No conversion
    path for dtype('<U')"), and a score column was written as arrays of shape (1,). Now a text is a UTF-8
    string and a score a scalar, as h5py writes each."""
    from pipeline.output.export import export
    texts = _text_result(tmp_path / "result.h5")
    done = run_cli("export", str(tmp_path / "result.h5"), "--format", "per-id-h5", "--column", "generate/text",
                   "-o", str(tmp_path / "text.h5"))
    assert done.returncode == 0, done.stderr
    with h5py.File(tmp_path / "text.h5") as f:
        assert [f[i].shape for i in "abcd"] == [()] * 4
        assert [f[i].asstr()[()] for i in "abcd"] == texts
    with h5py.File(export(tmp_path / "result.h5", "per-id-h5", tmp_path / "score.h5", "score/logprob_sum")) as f:
        assert [f[i].shape for i in "abcd"] == [()] * 4
        assert [f[i][()] for i in "abc"] == [-1.5, -2.25, 0.0] and np.isnan(f["d"][()])


def test_ids_from_a_file_not_in_utf8_is_named_with_its_line(result, tmp_path):
    """At 17f6bc6 an --ids-from file (or standard input) with bytes that are not UTF-8 ended in a traceback
    (UnicodeDecodeError; UnicodeEncodeError from stdin). Now: the source, the line and its bytes (exit 2).
    A UTF-8 BOM, as Windows editors write, is not part of the first id."""
    out, _, ids = result
    latin1 = tmp_path / "ids.txt"
    latin1.write_bytes(f"{ids[0]}\nprot\xe9ine\n".encode("latin-1"))
    for args, stdin, source in ((("--ids-from", str(latin1)), None, str(latin1)),
                                (("--ids-from", "-"), latin1.read_bytes(), "standard input")):
        done = subprocess.run([sys.executable, str(REPO / "bin" / "run_shards"), "get", str(out), *args],
                              input=stdin, capture_output=True)
        err = done.stderr.decode()
        assert done.returncode == 2 and "Traceback" not in err, err
        assert f"error: --ids-from {source}, line 2: the id is not UTF-8 text (its bytes: b'prot\\xe9ine')" in err
    bom = tmp_path / "bom.txt"
    bom.write_bytes(b"\xef\xbb\xbf" + f"{ids[3]}\n{ids[0]}\n".encode())
    assert read_ids([], str(bom)) == [ids[3], ids[0]]


def test_reader_refuses_a_wrong_argument_in_words(result):
    """At 17f6bc6: per_residue(row past the end) was a ValueError from unpacking, chunks(0) one from range(),
    chunks(-5) yielded nothing, chunks(size, "ids") looked up the columns 'i', 'd', 's', and ids as bytes (h5py's
    f["ids"][:] without .asstr()) were all missing. Now: a UserError saying what to pass, and bytes read as UTF-8."""
    out, data, ids = result
    with open_result(out) as res:
        for bad in (len(ids), -1):
            with pytest.raises(UserError, match=f"row {bad} is out of range: .* has 62 rows"):
                res.per_residue(bad, "per_residue/values")
        for size in (0, -5, 2.5):
            with pytest.raises(UserError, match=f"chunks\\(\\) takes a number of rows of at least 1 .*not {size}"):
                next(res.chunks(size))
        with pytest.raises(UserError, match=re.escape("not one column as text ('ids'): chunks(10, ['ids'])")):
            next(res.chunks(10, "ids"))
        assert res.rows(data["ids"][[5, 0]]).tolist() == [5, 0] and res.get(ids[7].encode())["ids"] == ids[7]
        assert np.array_equal(res.per_residue(61, "per_residue/values"), row_of(data, 61)["per_residue/values"])


def test_o_through_a_symbolic_link_writes_the_file_it_names(result, tmp_path):
    """At 17f6bc6 the rename of `get -o`/`export -o` put a new file in place of a link (a results folder
    linked into a project, say), leaving the file it named with its old content. Now the file is written
    where the link points, and the link stays."""
    out, data, ids = result
    (tmp_path / "shared").mkdir()
    for args, name in ((("get", str(out), ids[0]), "rows.tsv"),
                       (("export", str(out), "--format", "per-id-h5", "--column", "embeddings/mean"), "per-protein.h5")):
        (tmp_path / "shared" / name).write_bytes(EARLIER)
        (tmp_path / name).symlink_to(tmp_path / "shared" / name)
        done = run_cli(*args, "-o", str(tmp_path / name))
        assert done.returncode == 0, done.stderr
        assert (tmp_path / name).is_symlink() and (tmp_path / name).resolve() == tmp_path / "shared" / name
        assert (tmp_path / "shared" / name).read_bytes() != EARLIER
        assert {p.name for p in (tmp_path / "shared").iterdir()} <= {"per-protein.h5", "rows.tsv"}   # no temporary left
    assert (tmp_path / "shared" / "rows.tsv").read_text().splitlines()[1].split("\t")[0] == ids[0]
    with h5py.File(tmp_path / "shared" / "per-protein.h5") as f:
        assert np.array_equal(f[ids[0]][:], data["embeddings/mean"][0])


def test_per_id_h5_offers_only_model_output_columns(tmp_path):
    """A merged result's bookkeeping columns `computed_at` and `reused_from` are not model outputs: at ca44de4
    a result of two pooled embeddings was refused as having '4 output columns (embeddings/mean, embeddings/cls,
    computed_at, reused_from)', and `--column computed_at` wrote a per-id file of row numbers."""
    from pipeline.output.export import export
    from pipeline.output.h5io import Writer
    from pipeline.output.schema import BASE_COLUMNS, Column, RowBlock, Schema
    schema = Schema(BASE_COLUMNS + (Column("embeddings/mean", "float32", 3),
                                    Column("embeddings/cls", "float32", 3))).with_result_columns()
    rows = 2
    w = Writer(tmp_path / "result.h5", schema, {"task": "embed"})
    w.append(RowBlock(schema, {"ids": np.array([b"a", b"b"], dtype=object), "index": np.arange(rows),
                               "lengths": np.ones(rows, np.int32), "num_tokens": np.ones(rows, np.int32),
                               "truncated": np.zeros(rows, bool), "status": np.zeros(rows, np.int8),
                               "sequence_digest": np.zeros((rows, 16), np.uint8),
                               "embeddings/mean": np.zeros((rows, 3), np.float32),
                               "embeddings/cls": np.ones((rows, 3), np.float32),
                               "computed_at": np.arange(rows), "reused_from": np.full(rows, -1, np.int16)}))
    w.finish()
    with pytest.raises(UserError) as refused:
        export(tmp_path / "result.h5", "per-id-h5")
    assert "has 2 output columns (embeddings/mean, embeddings/cls); choose" in str(refused.value)
    for bookkeeping in ("computed_at", "reused_from"):
        with pytest.raises(UserError, match=f"a model output column, not {bookkeeping}"):
            export(tmp_path / "result.h5", "per-id-h5", tmp_path / "x.h5", bookkeeping)
    with h5py.File(export(tmp_path / "result.h5", "per-id-h5", tmp_path / "cls.h5", "embeddings/cls")) as f:
        assert f["b"][:].tolist() == [1, 1, 1]


def test_get_json_is_standard_json_with_nan_and_infinities():
    """`get --format json` wrote a float16 value past its range as `Infinity` (Python's json default), which
    strict parsers (JavaScript's JSON.parse, jq) refuse: an infinity is "inf" / "-inf", a NaN null, and every
    line parses as standard JSON."""
    import json

    import numpy as np

    from pipeline.output.get import _json_lines

    def strict(text):
        return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))

    records = [{"ids": "a", "score": np.float64(-np.inf),
                "vector": np.array([1.5, np.inf, -np.inf, np.nan], np.float32),
                "per_residue": np.array([[np.inf, 0.25], [np.nan, -2.0]], np.float16)}]
    (line,) = list(_json_lines(records))
    assert strict(line) == {"ids": "a", "score": "-inf", "vector": [1.5, "inf", "-inf", None],
                            "per_residue": [["inf", 0.25], [None, -2.0]]}


# (">lead" is the id of the FASTA header ">>lead")
ODD_IDS = ["back\\slash", "a\\tb", "a\u00a0b", "c\u3000d", "e\u0085f", "prot\u00e9ine_\u03b1", "=SUM(A1)", ">lead"]


def _odd_ids_result(path, ids: list[str] = ODD_IDS) -> None:
    """A result whose ids a FASTA can hold (every byte above 0x20, DEL and UTF-8 past ASCII included), written by
    the merge's own writer."""
    from pipeline.output.h5io import Writer
    from pipeline.output.schema import BASE_COLUMNS, Column, RowBlock, Schema
    schema = Schema(BASE_COLUMNS + (Column("embeddings/mean", "float32", 2),))
    rows = len(ids)
    w = Writer(path, schema, {"task": "embed"})
    w.append(RowBlock(schema, {"ids": np.array([i.encode() for i in ids], dtype=object),
                               "index": np.arange(rows), "lengths": np.ones(rows, np.int32),
                               "num_tokens": np.ones(rows, np.int32), "truncated": np.zeros(rows, bool),
                               "status": np.zeros(rows, np.int8), "sequence_digest": np.zeros((rows, 16), np.uint8),
                               "embeddings/mean": np.arange(2 * rows, dtype=np.float32).reshape(rows, 2)}))
    w.finish()


def test_get_tsv_ids_come_back_exactly_through_cut_and_ids_from(tmp_path):
    """At 9ef7cd6 the TSV escaped a backslash in an id too ('back\\\\slash'), so `cut -f1` (or pandas) gave ids
    the FASTA does not hold and `--ids-from` of them refused them as missing; and `--ids-from` split lines and
    ids at Unicode's spaces (U+00A0, U+3000, U+0085), which a FASTA id holds, asking for 'a' instead of
    'a\\u00a0b'. An id holds no tab nor line break: written as it is, and read back as the FASTA reads it."""
    _odd_ids_result(tmp_path / "result.h5")
    done = run_cli("get", str(tmp_path / "result.h5"), *ODD_IDS)
    assert done.returncode == 0, done.stderr
    first = [line.split("\t")[0] for line in done.stdout.rstrip("\n").split("\n")[1:]]
    assert first == ODD_IDS
    listed = tmp_path / "ids.txt"
    listed.write_bytes(("\n".join(reversed(first)) + "\r\n>" + ODD_IDS[0] + " a description\n").encode())
    again = run_cli("get", str(tmp_path / "result.h5"), "--ids-from", str(listed), "--format", "json")
    assert again.returncode == 0, again.stderr
    rows = [json.loads(line) for line in again.stdout.splitlines()]
    assert [r["ids"] for r in rows] == ODD_IDS[::-1] + ODD_IDS[:1]
    assert [r["index"] for r in rows] == list(range(len(ODD_IDS)))[::-1] + [0]


def test_ids_from_reads_a_line_starting_with_gt_as_the_id_the_result_holds(tmp_path):
    """At 9185f6a every --ids-from line lost one leading '>' (a FASTA header's mark), so `cut -f1` of the TSV gave
    back '>P1', the id of the header '>>P1', and get returned the row of 'P1' (exit 0), or refused 'P1' as missing.
    Now such a line is the header's id or the id as written, whichever the result holds; both: refused, saying how
    to name the one meant."""
    from pipeline.output.get import get, read_ids
    _odd_ids_result(tmp_path / "result.h5", [">P1", "P1", ">>Q2", "R3"])
    asked = read_ids([], "-", io.StringIO(">>Q2\n>R3 desc\n>>>Q2\n"))
    assert [json.loads(r)["index"] for r in get(tmp_path, asked, "json").splitlines()] == [2, 3, 2]
    for line in (">P1", ">P1 a description", ">>P1"):
        if line == ">>P1":   # ('>P1' as written is held; its header reading, '>P1' too: '>>P1' is the header of '>P1')
            assert json.loads(get(tmp_path, read_ids([], "-", io.StringIO(line)), "json"))["index"] == 0
            continue
        with pytest.raises(UserError, match=r"--ids-from standard input, line 1: '>P1' may be the FASTA header of "
                                            r"'P1' or the id '>P1', and .*result.h5 holds both: name the one you mean "
                                            r"after OUT, .*`run_shards get .*result.h5 '>P1'`"):
            get(tmp_path, read_ids([], "-", io.StringIO(line)), "json")
    named = run_cli("get", str(tmp_path / "result.h5"), ">P1", "P1", "--format", "json")   # (as written after OUT)
    assert [json.loads(r)["index"] for r in named.stdout.splitlines()] == [0, 1], named.stderr
    with pytest.raises(MissingIds, match="1 id\\(s\\) not in .*: 'Z9'"):
        get(tmp_path, read_ids([], "-", io.StringIO(">Z9\n")), "json")


def test_per_id_h5_names_are_marked_utf8(tmp_path):
    """At 9ef7cd6 the per-id file's dataset names were created with HDF5's default character set, ASCII,
    holding an id's UTF-8 bytes: readers that go by the mark misread 'protéine_α'. Now marked UTF-8, as h5py's
    create_dataset marks a name."""
    from pipeline.output.export import export
    _odd_ids_result(tmp_path / "result.h5")
    with h5py.File(export(tmp_path / "result.h5", "per-id-h5", tmp_path / "per-id.h5", "embeddings/mean")) as f:
        assert sorted(f) == sorted(ODD_IDS)
        assert {n: f.id.links.get_info(n.encode()).cset for n in f} == {n: h5py.h5t.CSET_UTF8 for n in ODD_IDS}
        assert f["c\u3000d"][:].tolist() == [6.0, 7.0]


def test_ids_from_standard_input_are_utf8_whatever_the_locale(tmp_path):
    """`--ids-from -` read standard input in the locale's encoding while a file is read as UTF-8: under a Latin-1
    locale (here PYTHONIOENCODING) 'protéine_α' arrived as mojibake and was refused as missing. Standard input's
    bytes are decoded as UTF-8, as the FASTA's and a file's are."""
    _odd_ids_result(tmp_path / "result.h5")
    env = {**os.environ, "PYTHONIOENCODING": "latin-1"}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, str(REPO / "bin" / "run_shards"), "get", str(tmp_path / "result.h5"),
                           "--ids-from", "-", "--format", "json", "-o", str(tmp_path / "rows.json")],
                          input="\n".join(ODD_IDS).encode(), capture_output=True, env=env, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    rows = [json.loads(line) for line in (tmp_path / "rows.json").read_text(encoding="utf-8").splitlines()]
    assert [r["ids"] for r in rows] == ODD_IDS
