"""`--task variants` and the lines of its variants file (issue 37): a line that repeats an earlier line's variant
(the same id and substitutions, in any order or case) is scored once and written on both lines, with a warning
naming both; a record longer than the limit that has no variants does not stop the run (it is not run), while
one that has variants still follows --on-long."""
from __future__ import annotations

import logging
import re

import h5py
import numpy as np
import pytest

from index import SequenceIndex
from pipeline.planning.variants_file import read_variants

from .tiny_models import run_cli, save_esm

SEQUENCES = {
    "P1": "MKTAYIAKQRQISFVKSHFSRQ",
    "LONG": "MVLSPADKTNVKAAWGKVGAHAGEYGAEALERMFLSFPTTKTYFPHFDLSHGSAQVKGHG",   # 62 tokens: over --max-length 40
    "P2": "ACDEFGHIKLMNPQRSTVWY",
}
VARIANTS = "id,mutant\nP1,K2R\nP2,A1C:C2W\nP1,k2r\nP2,C2W:A1C\nP1,T3S\n"
# line 4 repeats line 2 (written in lower case), line 5 repeats line 3 (its substitutions in the other order)
REPEATS = ["line 4 (P1 k2r) repeats line 2 (written K2R there)",
           "line 5 (P2 C2W:A1C) repeats line 3 (written A1C:C2W there)"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("variant_lines")
    (root / "proteins.fasta").write_text("".join(f">{k}\n{v}\n" for k, v in SEQUENCES.items()))
    (root / "variants.csv").write_text(VARIANTS)
    return root


def test_a_repeated_variant_is_kept_on_each_line_with_a_warning_naming_both(inputs, caplog):
    path = inputs / "variants.csv"
    with SequenceIndex.build([inputs / "proteins.fasta"]) as index, caplog.at_level(logging.WARNING, "run_shards"):
        variants = read_variants(str(path), index)
    assert variants.mutant == ["K2R", "A1C:C2W", "k2r", "C2W:A1C", "T3S"]   # every line kept, in order
    assert variants.record.tolist() == [0, 2, 0, 2, 0]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and f"--variants {path}: 2 line(s) repeat the variant of an earlier line" in warned[0]
    assert all(f"{path}, {r}" in warned[0] for r in REPEATS), warned[0]
    assert "scored once" in warned[0]
    caplog.clear()
    distinct = inputs / "distinct.csv"
    distinct.write_text("id,mutant\nP1,K2R\nP2,C2W\nP1,K2R:T3S\n")   # the same position, or id, is not the same variant
    with SequenceIndex.build([inputs / "proteins.fasta"]) as index, caplog.at_level(logging.WARNING, "run_shards"):
        read_variants(str(distinct), index)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.slow
def test_repeats_are_scored_once_and_a_long_record_without_variants_does_not_stop_the_run(inputs, tmp_path):
    esm = str(save_esm(tmp_path / "esm2_style"))
    out = tmp_path / "out"
    common = ("--model", esm, "--task", "variants", "--gpus", "0", "--workers", "1", "--max-length", "40",
              "--no-progress")
    res = run_cli(str(inputs / "proteins.fasta"), "--out", str(out), "--variants", str(inputs / "variants.csv"),
                  *common)
    assert res.returncode == 0, res.stderr[-3000:]
    assert all(r in res.stderr for r in REPEATS), res.stderr[-3000:]
    with h5py.File(out / "result.h5") as f:
        g = f["variants"]
        assert g["mutant"].asstr()[:].tolist() == ["K2R", "A1C:C2W", "k2r", "C2W:A1C", "T3S"]   # one row per line
        scores = {k: g[k][:] for k in ("masked_marginal", "wt_marginal")}
        assert f["ids"].asstr()[:].tolist() == list(SEQUENCES) and f["status"][:].tolist() == [0, 0, 0]
    for values in scores.values():
        assert not np.isnan(values).any()
        assert values[2].tobytes() == values[0].tobytes() and values[3].tobytes() == values[1].tobytes()
    # once each: P1's wild type and its masked copies at {2} and {3}; P2's wild type and its copy at {1, 2}; LONG
    # (no variants) is not run
    passes = {"P1": 3, "P2": 2}
    log = (out / "logs" / "worker_0.log").read_text()
    logged = re.search(r"shard complete: \S+ \(\d+ sequences, (\d+) tokens", log)
    assert int(logged[1]) == sum((len(SEQUENCES[k]) + 2) * n for k, n in passes.items())
    # a long record that has a variant still follows --on-long (error by default): refused, named, before any work
    more = inputs / "with_long.csv"
    more.write_text(VARIANTS + "LONG,M1A\n")
    refused = tmp_path / "refused"
    res = run_cli(str(inputs / "proteins.fasta"), "--out", str(refused), "--variants", str(more), *common)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "1 sequence(s) with variants exceed the --max-length limit of 40 tokens" in res.stderr
    assert "'LONG' (60 residues)" in res.stderr and not refused.exists()
    # the one policy --task variants takes (truncate and window were offered, and refused when given)
    assert "Choose --on-long skip (kept as rows with status 1): e.g. `run_shards run " in res.stderr, res.stderr
    assert "truncate" not in res.stderr and "--on-long window" not in res.stderr


@pytest.mark.slow
def test_the_same_command_again_writes_the_variants_csv_where_it_asks(inputs, tmp_path):
    """A complete run computes nothing again, but its --variants-out copy is written where this command asks:
    a new name, or the old file deleted since (before, the command said nothing and wrote nothing)."""
    out = tmp_path / "out"

    def run(csv_out):
        res = run_cli(str(inputs / "proteins.fasta"), "--out", str(out), "--variants", str(inputs / "variants.csv"),
                      "--variants-out", str(csv_out), "--model", "demo", "--task", "variants", "--gpus", "0",
                      "--workers", "1", "--max-length", "40", "--on-long", "skip", "--no-progress")
        assert res.returncode == 0, res.stderr[-3000:]
        return res

    first = tmp_path / "first.csv"
    run(first)
    table = first.read_text()
    assert table.splitlines()[0] == "id,mutant,llr,status" and len(table.splitlines()) == 6
    again = tmp_path / "again.csv"
    res = run(again)
    assert "nothing was computed or merged again" in res.stderr
    assert f"wrote the variants table to {again}" in res.stderr
    assert again.read_text() == table
    first.unlink()
    run(first)
    assert first.read_text() == table
