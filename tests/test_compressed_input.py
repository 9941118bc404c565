"""Compressed FASTA (#18 point 8): gzip and BGZF inputs run as their plain text does. BGZF is read in place
through its block table; other gzip through a decompressed copy in the cache, made once and reused while
the .gz is unchanged. Other compressions and damaged gzip data are refused by name with a command that
works; refused text names the compressed file and the line; a copy that does not fit is refused."""
from __future__ import annotations

import bz2
import gzip
import lzma
import subprocess
import sys

import numpy as np
import pytest

from index import SequenceIndex, load_or_build
from index.bgzf import BgzfStream, BgzfText, block_table

from .run_helpers import env_with, file_size_limit, read
from .test_fasta_formats import biopython_view
from .tiny_models import REPO, run_cli


@pytest.fixture()
def plain(tmp_path):
    path = tmp_path / "small.fasta"
    subprocess.run(["python3", str(REPO / "tools" / "make_fasta.py"), "--n", "30", "--seed", "8", "--max-len", "200",
                    str(path)], check=True, capture_output=True)
    return path


def _bgzip(src, dst, member: int = 1000) -> None:
    """BGZF as bgzip writes it (Biopython's writer), with members of `member` text bytes at most."""
    from Bio import bgzf
    with bgzf.BgzfWriter(str(dst), "wb") as out:
        data = src.read_bytes()
        for k in range(0, len(data), member):      # small members: records cross many member boundaries
            out.write(data[k:k + member])
            out.flush()


def test_compressed_files_index_as_biopython_reads_the_plain_text(plain, tmp_path):
    """gzip and BGZF (small members, and bgzip's own 64 KiB) give the ids and lengths Biopython reads from
    the plain file, the plain file's offsets and record checksums, and the same sequences read back; BGZF
    is read where it lies (no copy; the index keeps its block table), gzip through a copy."""
    cache = tmp_path / "cache"
    with open(plain, "ab") as fh:                  # one record over several 64 KiB members
        fh.write(b">long spans members\n" + b"MKVLAGHW\n" * 30000)
    want = SequenceIndex.build([plain])
    expected = biopython_view(plain)
    assert [(want.id(i), int(want.lengths[i])) for i in range(len(want))] == expected
    gz, small, large = tmp_path / "p.fasta.gz", tmp_path / "small.bgz.gz", tmp_path / "large.bgz.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    _bgzip(plain, small)
    _bgzip(plain, large, 1 << 16)
    for path in (gz, small, large):
        index, _ = load_or_build([path], cache)
        assert [(index.id(i), int(index.lengths[i])) for i in range(len(index))] == expected, path
        for name in ("offsets", "nbytes", "checksums"):
            assert np.array_equal(getattr(index, name), getattr(want, name)), (path, name)
        assert [index.sequence(i) for i in range(len(index))] == [want.sequence(i) for i in range(len(want))]
        in_place = path != gz
        assert (index.inputs[0].path == str(path)) == in_place and (index.block_table(0) is not None) == in_place
    assert [p.name.endswith("p.fasta") for p in (cache / "decompressed").iterdir() if p.suffix != ".json"] == [True]
    text = BgzfText(str(small))
    assert len(text.table) > 30 and text.size == plain.stat().st_size
    with BgzfStream(text) as stream:               # the sequential view (error messages) agrees
        stream.seek(12345)
        assert stream.read(5000) == plain.read_bytes()[12345:17345]


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
    # The same text compressed again in other blocks: its records are where they were in the text, but the run
    # reads them through its index's block table (its workers failed "record N is no longer at byte ...", and the
    # rerun they suggested failed the same way)
    _bgzip(plain, bgz, member=777)
    res = run_cli("merge", str(tmp_path / f"out_{bgz.name}"), env=cache)
    assert res.returncode == 2 and "the input FASTA no longer matches this run" in res.stderr, res.stderr
    assert f"the same text, but {bgz} was compressed again: its BGZF blocks, through which this run reads" in res.stderr
    bgz.write_bytes(gzip.compress(b">only\nMKV\n"))                  # an edited BGZF file, read in place
    res = run_cli("merge", str(tmp_path / f"out_{bgz.name}"), env=cache)
    assert res.returncode == 2 and "the input FASTA no longer matches this run" in res.stderr, res.stderr
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
    """By `run_shards index` and by a run alike: exit code 2, the file, what it is and the command to run."""
    cache = {"RUN_SHARDS_CACHE": str(tmp_path / "cache")}
    data = plain.read_bytes()
    _bgzip(plain, tmp_path / "bgzf")
    bgzf = (tmp_path / "bgzf").read_bytes()
    flipped = bytearray(bgzf)
    flipped[len(bgzf) // 2] ^= 0x55                   # inside some member's deflate data
    cases = {
        "in.fasta.xz": (lzma.compress(data), "xz-compressed", "xz -dc"),
        "in.fasta.bz2": (bz2.compress(data), "bzip2-compressed", "bzip2 -dc"),
        "in.fasta.zst": (b"\x28\xb5\x2f\xfd" + b"\0" * 32, "zstd-compressed", "zstd -dc"),
        "cut.fasta.gz": (gzip.compress(data)[:-40], "the gzip data ends early (the file is truncated)", "gzip -t"),
        "bad.fasta.gz": (gzip.compress(data)[:30] + b"\xff" * 200, "the gzip data is damaged", "gzip -t"),
        "cut.bgz.gz": (bgzf[:-100], "the gzip data ends early (the file is truncated)", "gzip -t"),
        "bad.bgz.gz": (bytes(flipped), "the gzip data is damaged", "gzip -t"),
        # cut where a member starts: every member left inflates cleanly (gzip -t passes), the last record was cut
        # silently; only the missing end-of-file member tells
        "cutblock.bgz.gz": (bgzf[:int(block_table(str(tmp_path / "bgzf"))[-3, 0])],
                            "the BGZF end-of-file marker is missing: the file was cut short at a block boundary",
                            "gzip -dc"),
    }
    for name, (content, message, command) in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        out = tmp_path / f"out_{name}"
        for args in (["index", str(path)], [str(path), "--out", str(out), "--gpus", "0", "--no-progress"]):
            res = run_cli(*args, env=cache)
            assert res.returncode == 2 and message in res.stderr and command in res.stderr, (name, res.stderr)
            if "-compressed" in message:
                assert "| bgzip >" in res.stderr
            assert f"error: {path}: " in res.stderr and "Traceback" not in res.stderr
            assert not [p for p in (tmp_path / "cache").rglob("*.tmp*")], name    # no half-written copy left
        assert not out.exists()


def test_the_plain_alternative_of_each_refused_compression_works_on_any_name(plain, tmp_path):
    """The "(or: ...)" command of an xz, zstd or bzip2 refusal, as printed, on a download named without the
    compression's suffix: `xz -dk FILE` and `zstd -d FILE` skipped such a file ("unknown suffix") and
    `bunzip2 -k FILE` wrote FILE.out; each now writes the FASTA text beside it."""
    import re
    import shutil

    from index import compressed
    from index.errors import FastaError
    data = plain.read_bytes()
    packers = {"xz": ["xz", "-c"], "zstd": ["zstd", "-q", "-c"], "bzip2": ["bzip2", "-c"]}
    tried = 0
    for name, pack in packers.items():
        if shutil.which(pack[0]) is None:
            continue
        folder = tmp_path / name
        folder.mkdir()
        path = folder / "download 1.dat"   # no suffix the tool knows, and a space
        path.write_bytes(subprocess.run(pack, input=data, capture_output=True, check=True).stdout)
        with pytest.raises(FastaError) as refused:
            compressed.kind(path)
        (command,) = re.findall(r"\(or: (.*)\)$", refused.value.hint)
        done = subprocess.run(["bash", "-c", command], cwd=folder, capture_output=True, text=True)
        assert done.returncode == 0, (command, done.stderr)
        (made,) = [p for p in folder.iterdir() if p != path]
        assert made.read_bytes() == data, command
        tried += 1
    assert tried, "none of xz, zstd, bzip2 is installed"


# name: (text, message, line): refused text, compressed
REFUSED_INSIDE = {
    "control_byte": (b">a\nMK\n>b x\nMK\x01V\n", "binary or control byte 0x01 in the sequence data (record 'b')", 4),
    "comment": (b">a\rMK\r;note\rVL\r", "comment line (starting with ';') among the sequence lines (record 'a')", 3),
}


@pytest.mark.parametrize("name", sorted(REFUSED_INSIDE))
@pytest.mark.parametrize("compression", ["gzip", "bgzf"])
def test_refused_text_inside_a_compressed_file_names_it_and_the_line(tmp_path, compression, name):
    """A .gz (indexed through its copy) or BGZF file (read in place) whose text is refused: `run_shards index`
    and a run stop with exit code 2, naming the file the user gave and the line in its text; no traceback,
    no output directory."""
    text, message, line = REFUSED_INSIDE[name]
    plain = tmp_path / f"{name}.fasta"
    plain.write_bytes(text)
    path = tmp_path / f"{name}.fasta.gz"
    if compression == "gzip":
        path.write_bytes(gzip.compress(text))
    else:
        _bgzip(plain, path)
    plain.unlink()
    cache = {"RUN_SHARDS_CACHE": str(tmp_path / "cache")}
    for args in (["index", str(path)], [str(path), "--out", str(tmp_path / "out"), "--gpus", "0", "--no-progress"]):
        res = run_cli(*args, env=cache)
        assert res.returncode == 2, (args, res.stderr)
        assert f"error: {path}:{line}: " in res.stderr and message in res.stderr, res.stderr
        assert "Traceback" not in res.stderr + res.stdout and "error: " + str(tmp_path / "cache") not in res.stderr
        if name == "comment":   # the suggested command runs on the text, once decompressed
            plain_name = str(tmp_path / f"{name}.fasta")
            assert (f"sed '/^;/d' {plain_name} > {plain_name}.nocomments.fasta (first decompress it: gzip -dc "
                    f"{path} > {plain_name})") in res.stderr, res.stderr
    assert not (tmp_path / "out").exists()


def test_gzip_copy_that_does_not_fit_is_refused_and_leaves_nothing(plain, tmp_path):
    """The decompressed copy meets a full disk (here a file size limit, which fails writes the same way):
    exit code 2, a message naming the .gz, the cache and what to do; no half-written copy left."""
    gz = tmp_path / "p.fasta.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    cache = tmp_path / "cache"
    res = subprocess.run([sys.executable, str(REPO / "bin" / "run_shards"), "index", str(gz)], capture_output=True,
                         text=True, env=env_with(RUN_SHARDS_CACHE=cache), cwd=REPO, timeout=300,
                         preexec_fn=file_size_limit(plain.stat().st_size // 2))
    assert res.returncode == 2, res.stderr
    assert f"error: {gz}: no space to decompress it into {cache / 'decompressed'}" in res.stderr, res.stderr
    assert "RUN_SHARDS_CACHE" in res.stderr and "Traceback" not in res.stderr
    assert [p.name for p in (cache / "decompressed").iterdir()] == []


def test_run_refusals_name_the_gz_not_its_copy(tmp_path):
    """Duplicate ids and empty records found in a .gz (read through its copy in the cache) are listed at
    FILE.gz:LINE, the file the user gave."""
    gz = tmp_path / "d.fasta.gz"
    gz.write_bytes(gzip.compress(b">a\nMK\n>a\nVL\n>e\n\n>f\nMK\n"))
    cache = {"RUN_SHARDS_CACHE": str(tmp_path / "cache")}
    run = [str(gz), "--out", str(tmp_path / "out"), "--gpus", "0", "--no-progress"]
    res = run_cli(*run, env=cache)
    assert res.returncode == 2 and \
        f"1 duplicate sequence id(s) in the input, on 2 records: 'a' at {gz}:1, {gz}:3." in res.stderr, \
        res.stderr
    res = run_cli(*run, "--on-duplicate-id", "rename", env=cache)
    assert res.returncode == 2 and f"1 record(s) have no residues: {gz}:5 'e'." in res.stderr, res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and str(tmp_path / "cache") not in errors[0] and "Traceback" not in res.stderr


def test_gzip_with_a_read_only_cache_is_refused_naming_the_cache(plain, tmp_path):
    """The cache on a read-only mount: a .gz cannot get its decompressed copy. The refusal names the .gz, the
    cache and both ways out (it said "Run the command where the run directory is mounted read-write", of a run
    directory that was writable), and the plain file its hint makes runs with that cache."""
    import os
    import shlex
    from .run_helpers import skip_or_fail
    if os.geteuid() != 0:
        skip_or_fail("a read-only bind mount needs root")
    gz = tmp_path / "p.fasta.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    real, cache = tmp_path / "real", tmp_path / "cache"
    real.mkdir()
    cache.mkdir()
    if subprocess.run(["mount", "--bind", str(real), str(cache)], capture_output=True).returncode != 0:
        skip_or_fail("cannot bind-mount here")
    try:
        assert subprocess.run(["mount", "-o", "remount,ro,bind", str(cache)], capture_output=True).returncode == 0
        env = {"RUN_SHARDS_CACHE": str(cache)}
        res = run_cli(str(gz), "--out", str(tmp_path / "out"), "--gpus", "0", "--no-progress", env=env)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert f"error: {gz}: cannot write its decompressed copy into {cache / 'decompressed'} (Read-only file " \
               "system)" in res.stderr and "Point RUN_SHARDS_CACHE at a folder you can write" in res.stderr, res.stderr
        assert "run directory" not in res.stderr
        hint = res.stderr.split("from htslib): ")[1].strip()
        assert subprocess.run(["bash", "-c", hint], capture_output=True).returncode == 0, hint
        res = run_cli("index", shlex.split(hint)[-1], env=env)
        assert res.returncode == 0 and "records: 30" in res.stdout, res.stderr
    finally:
        subprocess.run(["umount", str(cache)], capture_output=True)
