"""Compressed FASTA (#18 point 8): gzip and BGZF inputs run as their plain text does, through a decompressed
copy in the cache made once and reused while the .gz is unchanged; other compressions and damaged gzip
data are refused by name with a command that works."""
from __future__ import annotations

import bz2
import gzip
import lzma
import subprocess

import numpy as np
import pytest

from .run_helpers import read
from .tiny_models import REPO, run_cli


@pytest.fixture()
def plain(tmp_path):
    path = tmp_path / "small.fasta"
    subprocess.run(["python3", str(REPO / "tools" / "make_fasta.py"), "--n", "30", "--seed", "8", "--max-len", "200",
                    str(path)], check=True, capture_output=True)
    return path


def _bgzip(src, dst) -> None:
    from Bio import bgzf
    with bgzf.BgzfWriter(str(dst), "wb") as out:
        data = src.read_bytes()
        for k in range(0, len(data), 1000):      # many small blocks: many gzip members
            out.write(data[k:k + 1000])
            out.flush()


@pytest.mark.slow
def test_gzip_and_bgzf_inputs_give_the_plain_files_result(plain, common, tmp_path):
    cache = {"RUN_SHARDS_CACHE": str(tmp_path / "cache")}
    gz, bgz = tmp_path / "small.fasta.gz", tmp_path / "small.bgz.fasta.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    _bgzip(plain, bgz)
    results = {}
    for path in (plain, gz, bgz):
        out = tmp_path / f"out_{path.name}"
        res = run_cli(str(path), "--out", str(out), *common, env=cache)
        assert res.returncode == 0, res.stderr
        results[path.name] = read(out / "result.h5")
    want = results[plain.name]
    for name in (gz.name, bgz.name):
        got = results[name]
        assert sorted(got) == sorted(want)
        for key, value in want.items():
            assert np.array_equal(got[key], value, equal_nan=value.dtype.kind == "f"), (name, key)

    again = run_cli("index", str(gz), env=cache)                     # the copy is reused while the .gz is the same
    assert again.returncode == 0 and "reusing its decompressed copy" in again.stderr, again.stderr
    gz.write_bytes(gzip.compress(b">only\nMKV\n"))                   # a new .gz: decompressed again
    fresh = run_cli("index", str(gz), env=cache)
    assert fresh.returncode == 0 and "records: 1\n" in fresh.stdout and "decompressed into" in fresh.stderr
    for command in ("merge", "rerun"):                               # the run made from the old .gz sees it
        res = run_cli(command, str(tmp_path / f"out_{gz.name}"), env=cache)
        assert res.returncode == 2 and "the input FASTA no longer matches this run" in res.stderr, res.stderr
    gz.write_bytes(gzip.compress(plain.read_bytes()))                # restored: the suggested rerun works
    res = run_cli("rerun", str(tmp_path / f"out_{gz.name}"), env=cache)
    assert res.returncode == 0, res.stderr


def test_other_compressions_and_damaged_gzip_are_refused_by_name(plain, tmp_path):
    cache = {"RUN_SHARDS_CACHE": str(tmp_path / "cache")}
    data = plain.read_bytes()
    cases = {
        "in.fasta.xz": (lzma.compress(data), "xz-compressed", "xz -dc"),
        "in.fasta.bz2": (bz2.compress(data), "bzip2-compressed", "bzip2 -dc"),
        "in.fasta.zst": (b"\x28\xb5\x2f\xfd" + b"\0" * 32, "zstd-compressed", "zstd -dc"),
        "cut.fasta.gz": (gzip.compress(data)[:-40], "the gzip data ends early (the file is truncated)", "gzip -t"),
        "bad.fasta.gz": (gzip.compress(data)[:30] + b"\xff" * 200, "the gzip data is damaged", "gzip -t"),
    }
    for name, (content, message, command) in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        res = run_cli("index", str(path), env=cache)
        assert res.returncode == 2 and message in res.stderr and command in res.stderr, (name, res.stderr)
        assert str(path) in res.stderr and "Traceback" not in res.stderr
        assert not [p for p in (tmp_path / "cache").rglob("*.tmp*")], name    # no half-written copy left
