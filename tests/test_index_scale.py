"""The index at scale (issue 28): built on disk with bounded memory and read memory-mapped, it holds the
same records as a plain in-memory reading of the FASTA (tests/test_index.py's reference parser), in the
same length order, with the same duplicate groups, whatever the spill windows; a run's stride table gives
each worker exactly its shard's rows; totals, percentiles and shard statistics from the length histogram
equal numpy's on the lengths themselves."""
from __future__ import annotations

import random
import re

import numpy as np
import pytest

from index import SequenceIndex, build, spill, stride
from index.shard_view import open_stride

from .test_index import random_fasta, reference_parse


@pytest.fixture(scope="module")
def fasta(tmp_path_factory):
    """1,500 records with repeated ids (some three times), empty records, CRLF and LF lines."""
    rng = random.Random(28)
    data = random_fasta(rng, 1500)
    data = re.sub(rb">id\d+_\d+", lambda m: b">dup%d" % rng.randrange(30) if rng.random() < 0.05 else m.group(), data)
    path = tmp_path_factory.mktemp("scale") / "x.fasta"
    path.write_bytes(data)
    return path


def reference(path):
    """Ids, lengths, offsets and sequences of a plain reading, and numpy's stable length order."""
    records = reference_parse(path.read_bytes())
    lengths = np.array([len(r["residues"]) for r in records], np.int64)
    return records, lengths, np.argsort(-lengths, kind="stable")


def check(index: SequenceIndex, path) -> None:
    records, lengths, order = reference(path)
    assert len(index) == len(records)
    assert index.ids() == [r["id"] for r in records]
    assert np.asarray(index.lengths).tolist() == lengths.tolist()
    assert np.asarray(index.offsets).tolist() == [r["offset"] for r in records]
    assert np.asarray(index.nbytes).tolist() == [r["nbytes"] for r in records]
    assert np.asarray(index.order).tolist() == order.tolist()
    every7 = range(0, len(index), 7)
    assert [index.sequence(i) for i in every7] == [records[i]["residues"] for i in every7]
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(records):
        groups.setdefault(r["id"], []).append(i)
    want = sorted((g for g in groups.values() if len(g) > 1), key=lambda g: g[0])
    assert want and index.duplicate_ids() == want


def test_the_mapped_index_holds_the_records_of_a_plain_reading(fasta):
    check(SequenceIndex.build([fasta]), fasta)


@pytest.mark.parametrize("window", [1, 7, 64, 1000])
def test_spill_windows_do_not_change_the_index(fasta, tmp_path, monkeypatch, window):
    """Windows far below the record count: the length order and the hash buckets go through many spill
    files (8 records per bucket), as a 100M-record input does with the default window."""
    monkeypatch.setattr(build, "WINDOW", window)
    real = spill.HashBuckets.__init__
    monkeypatch.setattr(spill.HashBuckets, "__init__", lambda self, n, directory=None, window=0:
                        real(self, n, directory, 8))
    index = SequenceIndex.build([fasta], target=tmp_path / "i.rsidx")
    check(index, fasta)
    check(SequenceIndex.load(tmp_path / "i.rsidx"), fasta)


def test_histogram_answers_as_numpy_does(fasta):
    index = SequenceIndex.build([fasta])
    _, lengths, order = reference(fasta)
    assert index.total_residues == int(lengths.sum()) and index.max_length == int(lengths.max())
    qs = (0, 1, 10, 25, 50, 75, 90, 99, 100)
    assert index.length_percentiles(qs) == {q: int(v) for q, v in zip(qs, np.percentile(lengths, qs, method="nearest"))}
    assert index.empty_records().tolist() == np.flatnonzero(lengths == 0).tolist()
    for world in (1, 3, 7, 64, 1499, 1500, 2000):
        stats = index.shard_stats(world)
        assert stats.sequences.tolist() == [len(order[r::world]) for r in range(world)]
        assert stats.tokens.tolist() == [int(lengths[order[r::world]].sum()) for r in range(world)]


@pytest.mark.parametrize("fixed_ids", [True, False])
@pytest.mark.parametrize("world", [1, 5, 16])
def test_each_worker_reads_exactly_its_shards_rows(fasta, tmp_path, monkeypatch, world, fixed_ids):
    """A run's copy with its stride table: each shard's view holds the rows of order[r::W], longest first,
    with the full index's lengths, ids, checksums and sequences; other positions are refused. Small scatter
    windows, and ids as fixed-width fields or as a separate blob."""
    monkeypatch.setattr(stride, "_WINDOW_BYTES", 700)
    if not fixed_ids:
        monkeypatch.setattr(stride, "_FIXED_ID", 0)
    index = SequenceIndex.build([fasta])
    path = tmp_path / "run.rsidx"
    index.save(path, world=world)
    saved = SequenceIndex.load(path)
    assert saved.fingerprint() == index.fingerprint()   # the stride table is not part of the index's identity
    seen = []
    for r in range(world):
        view = open_stride(path, r, world)
        want = np.asarray(index.order[r::world], np.int64)
        assert view.positions.tolist() == want.tolist() == saved.stride_shard(r, world).tolist()
        assert np.asarray(view.lengths[want]).tolist() == np.asarray(index.lengths)[want].tolist()
        assert np.asarray(view.checksums[want]).tolist() == np.asarray(index.checksums)[want].tolist()
        assert [view.id_bytes(int(p)) for p in want] == [index.id_bytes(int(p)) for p in want]
        assert [view.sequence(int(p)) for p in want[:20]] == [index.sequence(int(p)) for p in want[:20]]
        seen += want.tolist()
        if world > 1:
            other = int(index.order[(r + 1) % world])
            with pytest.raises(IndexError):
                view.lengths[other]
    assert sorted(seen) == list(range(len(index)))


def test_a_run_index_without_a_stride_table_is_read_whole(fasta, tmp_path):
    """Runs planned before the stride table: their workers map the whole index and take every W-th row."""
    index = SequenceIndex.build([fasta])
    index.save(tmp_path / "old.rsidx")
    view = open_stride(tmp_path / "old.rsidx", 2, 5)
    assert view.positions.tolist() == np.asarray(index.order[2::5]).tolist()
    assert view.id_bytes(int(view.positions[0])) == index.id_bytes(int(view.positions[0]))
