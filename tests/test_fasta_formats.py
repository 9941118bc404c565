"""FASTA as it comes (issue #18): line endings in any mix, NCBI's Ctrl-A headers, VT/FF, huge records,
files that are not FASTA, comment lines, and the model's alphabet. Each case is a file written here and
put through `run_shards index` and a run; the index agrees with Biopython on every file Biopython reads.
"""
import json
import os
import random
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import h5py
import numpy as np
import pytest

from index import SequenceIndex, fasta_scan, sequence_index
from index.alphabet import alphabet_mismatch, model_alphabet, nucleotide_like
from pipeline.config import RunConfig
from pipeline.errors import UserError
from pipeline.planning.input_policies import apply_input_policies

from .conftest import SHARED_DATA
from .test_index import MIXES, ODD, random_fasta
from .tiny_models import ESM_VOCAB, REPO, run_cli

# name: (bytes, [(id, residues), ...]); ids are unique across cases so that one run can take them all.
ACCEPTED = {
    # issue #18 point 1: lone CRs after LF lines; 'b1' used to vanish inside 'a1's header
    "cr_after_lf": (b">z1\nMKV\n>a1 first\rACGTAC\rGGTT\r>b1 second\rMKV*\r\n", [("z1", 3), ("a1", 10), ("b1", 3)]),
    "mixed_endings": (b">c1\r\nMK\rVL\n\r>c2 x\rAC\n\rGT\r\n>c3\nW", [("c1", 4), ("c2", 4), ("c3", 1)]),
    # point 2: NCBI nr joins merged deflines with Ctrl-A; the id ends there, the description keeps it
    "ncbi_nr": (b">WP_1.1 30S protein S18 [X]\x01WP_2.1 30S protein S18 [Y]\nMKVL\n>WP_3.1\x01WP_4.1 other\nMA\n",
                [("WP_1.1", 4), ("WP_3.1", 2)]),
    "controls_in_header": (b">h1 \x1b[1mbold\x1b[0m\x7f caf\xc3\xa9\nMK\n", [("h1", 2)]),
    # point 3: vertical tab and form feed are whitespace
    "vt_ff": (b">v1\nMK\x0bVL\x0c\n\x0cAA\n", [("v1", 6)]),
}

# name: (bytes, message, line or None)
REFUSED = {
    "control_byte_in_sequence": (b">a\nMK\x01V\n", "binary or control byte 0x01 in the sequence data (record 'a')", 2),
    "nul_in_sequence": (b">a\rMK\rV\x00\r", "binary or control byte 0x00 in the sequence data (record 'a')", 3),
    "nul_in_header": (b">a\nMK\n>b x\x00y\nMK\n", "NUL byte (0x00) in the header (record 'b')", 3),
    "non_ascii_in_sequence": (b">a\nMK\xc3\xa9V\n", "non-ASCII byte 0xc3 in the sequence data (record 'a')", 2),
    "fastq": (b"@read1\nACGT\n+\nII;I\n@read2\nACGT\n+\n>III\n", "this is a FASTQ file", 1),
    "html": (b"<!DOCTYPE html>\n<html><head><title>404</title></head></html>\n", "this is an HTML page", 1),
    "utf16_bom": (">a desc\nMKV\n".encode("utf-16"), "UTF-16 (little-endian) text, not ASCII or UTF-8. Convert it: "
                  "iconv -f UTF-16 -t UTF-8 FILE", None),
    "utf16le": (">a desc\nMKV\n".encode("utf-16-le"), "iconv -f UTF-16LE -t UTF-8 FILE", None),
    "utf32": (">a desc\nMKV\n".encode("utf-32"), "UTF-32 (little-endian) text", None),
    "comment_before_header": (b";a comment\n>a\nMK\n", "comment line (starting with ';') before the first header", 1),
    "comment_in_record": (b">a\nMK\n;a comment\nVL\n", "comment line (starting with ';') among the sequence lines "
                          "(record 'a')", 3),
    "sequence_before_header": (b"\r\nMKV\r\n>a\r\nMK\r\n", "sequence data before the first header", 2),
}


def write_case(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / f"{name}.fasta"
    path.write_bytes(data)
    return path


def biopython_view(path) -> list[tuple[str, int]] | None:
    """(id, residues) per record as Biopython reads the file, after our normalisation (the id ends at the
    first byte below 33, as Ctrl-A ends it for NCBI; whitespace and a final '*' removed); None if Biopython
    refuses the file."""
    from Bio import SeqIO
    try:
        records = list(SeqIO.parse(str(path), "fasta"))
    except ValueError:
        return None
    out = []
    for rec in records:
        seq = re.sub(r"[ \t\r\n\x0b\x0c]", "", str(rec.seq)).upper()
        out.append((re.match(r"[^\x00-\x20]*", rec.id).group(), len(seq) - seq.endswith("*")))
    return out


def our_view(path) -> list[tuple[str, int]]:
    index = SequenceIndex.build([path])
    return [(index.id(i), int(index.lengths[i])) for i in range(len(index))]


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_accepted_case_through_index_command(tmp_path, name):
    data, records = ACCEPTED[name]
    path = write_case(tmp_path, name, data)
    res = run_cli("index", str(path))
    assert res.returncode == 0, res.stderr
    assert f"records: {len(records)}\n" in res.stdout
    assert f"residues: {sum(n for _, n in records)}\n" in res.stdout
    assert our_view(path) == records
    assert biopython_view(path) == records


def test_accepted_cases_run(tmp_path, models):
    """One run over every accepted case: the rows hold exactly the records and residue counts expected."""
    paths = [str(write_case(tmp_path, name, ACCEPTED[name][0])) for name in sorted(ACCEPTED)]
    out = tmp_path / "out"
    res = run_cli(*paths, "--out", str(out), "--model", models["demo"], "--gpus", "0", "--workers", "1",
                  "--no-progress")
    assert res.returncode == 0, res.stderr
    with h5py.File(out / "result.h5") as f:
        ids = [x.decode() for x in f["ids"][:]]   # h5py reads variable-length strings as bytes
        lengths = f["lengths"][:].tolist()
        status = f["status"][:].tolist()
    expected = [r for name in sorted(ACCEPTED) for r in ACCEPTED[name][1]]
    assert list(zip(ids, lengths)) == expected
    assert set(status) == {0}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_case_names_file_and_line(tmp_path, name):
    """`run_shards index` and a run both stop with exit code 2 and the same one-line message, no traceback,
    and the run leaves no output directory behind."""
    data, message, line = REFUSED[name]
    path = write_case(tmp_path, name, data)
    where = f"{path}:{line}" if line else f"{path}"
    for args in (["index", str(path)], [str(path), "--out", str(tmp_path / "out"), "--gpus", "0", "--no-progress"]):
        res = run_cli(*args)
        assert res.returncode == 2, (args, res.stderr)
        assert f"error: {where}: " in res.stderr and message.replace("FILE", str(path)) in res.stderr, res.stderr
        assert "Traceback" not in res.stderr + res.stdout
    assert not (tmp_path / "out").exists()


def bio_files(tmp_path) -> list[Path]:
    """Every file the comparison with Biopython covers: real files, odd cases, generated mixes."""
    files = sorted(SHARED_DATA.glob("*.fa*")) + sorted(Path("/work/shared/data").glob("*.fa*"))
    for name, data in {**ODD, **{k: v for k, (v, _) in ACCEPTED.items()}}.items():
        files.append(write_case(tmp_path, f"case_{name}", data))
    for mix, endings in MIXES.items():
        for seed in range(3):
            data = random_fasta(random.Random(seed), 200, endings)
            rng = random.Random(seed)   # and VT/FF in sequence lines, which Biopython keeps as characters
            data = re.sub(rb"(?<=[A-Za-z])(?=[A-Za-z])", lambda m: rng.choice([b"", b"", b"", b"\x0b", b"\x0c", b" "]),
                          data[:20000]) + data[20000:]
            files.append(write_case(tmp_path, f"random_{mix}_{seed}", data))
    return files


def test_index_agrees_with_biopython(tmp_path, monkeypatch):
    """Ids and residue counts equal Biopython's (normalised as ours) on every file Biopython accepts, with
    blocks small enough that records and CRLFs cross block boundaries, and with the default blocks."""
    compared = 0
    for path in bio_files(tmp_path):
        expected = biopython_view(path)
        if expected is None:   # Biopython refuses blank lines before the first header, for one
            continue
        for block in (61, fasta_scan.BLOCK_BYTES):
            monkeypatch.setattr(fasta_scan, "BLOCK_BYTES", block)
            assert our_view(path) == expected, (path, block)
        compared += 1
    assert compared >= 25


PEAK_RSS_BOUND = 256 << 20


@pytest.mark.parametrize("line,megabytes", [(b"ACGT" * 15 + b"\n", 300), (b"A \r\n\x0b", 64)],
                         ids=["300MB_wrapped", "64MB_mostly_whitespace"])
def test_huge_record_is_indexed_in_bounded_memory(tmp_path, line, megabytes):
    """A huge record is indexed in a child process whose peak RSS stays under a bound that does not depend
    on the record's size: the record is streamed through blocks, never read whole (before: about 2x its
    size, 600 MB here; 20x when mostly whitespace, 1.3 GB here)."""
    path = tmp_path / "huge.fasta"
    chunk = line * ((1 << 20) // len(line))
    with open(path, "wb") as fh:
        fh.write(b">huge one record\n")
        for _ in range(megabytes):
            fh.write(chunk)
        fh.write(b"*\n>small\nMKV\n")
    residues = megabytes * (len(chunk) - len(re.sub(rb"[A-Z]", b"", chunk)))
    # The child's own high-water mark: VmHWM belongs to its address space, whereas getrusage's ru_maxrss
    # also counts this (large) pytest process, whose peak a child started by vfork + exec inherits.
    child = textwrap.dedent(f"""
        import json, re, sys
        sys.path.insert(0, {str(REPO)!r})
        from index import SequenceIndex
        index = SequenceIndex.build([{str(path)!r}], threads=2)
        status = open("/proc/self/status").read()
        print(json.dumps({{"peak": int(re.search(r"VmHWM:\\s*(\\d+) kB", status).group(1)) * 1024,
                           "ids": index.ids(), "lengths": index.lengths.tolist()}}))
    """)
    try:
        res = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr
        got = json.loads(res.stdout)
        assert got["ids"] == ["huge", "small"] and got["lengths"] == [residues, 3]
        assert got["peak"] < PEAK_RSS_BOUND, got["peak"]
    finally:
        path.unlink()


def test_reading_records_loops_over_short_reads(tmp_path, monkeypatch):
    """pread returns at most about 2 GiB, so reading a record over that takes several reads: simulated here
    with reads of at most 1000 bytes and pieces of 4 KiB (a header longer than a piece, too)."""
    header = b">long " + b"d" * 5000 + b"\r"
    body = b"".join(bytes(random.Random(1).choices(b"ACDEFGHIKLMNPQRSTVWY", k=60)) + b"\r\n" for _ in range(300))
    path = tmp_path / "r.fasta"
    path.write_bytes(header + body + b"*\n>next\nMK\n")
    index = SequenceIndex.build([path])
    want = body.replace(b"\r\n", b"").decode()
    preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, at: preadv(fd, [memoryview(bufs[0])[:1000]], at))
    monkeypatch.setattr(sequence_index, "_ONE_READ", 100)
    monkeypatch.setattr(sequence_index, "_READ_BYTES", 4096)
    assert bytes(index.read_record(0)) == header + body + b"*\n"
    assert index.sequence(0) == want and index.lengths[0] == len(want)
    assert index.header(0) == header[1:-1].decode()
    assert index.sequence(1) == "MK"


def test_lengths_over_int32_are_kept_sorted_first_and_refused_by_a_run(tmp_path, monkeypatch):
    """A record over 2**31 - 1 residues: 64-bit from the scanner to the saved index (never a wrap), sorted
    first, and refused clearly by a run, whose output column `lengths` is int32."""
    path = tmp_path / "x.fasta"
    path.write_bytes(b">a\nMK\n>b\nMKV\n>c\nM\n")
    from index import build

    class HugeScan(build.ScanStream):
        def __iter__(self):
            for piece in super().__iter__():
                piece.lengths[1], piece.nbytes[1] = 3_000_000_000, 5 << 30
                yield piece
    monkeypatch.setattr(build, "ScanStream", HugeScan)
    index = SequenceIndex.build([path])
    assert index.lengths.dtype == np.int64 and index.nbytes.dtype == np.int64
    assert index.lengths.tolist() == [2, 3_000_000_000, 1] and index.order.tolist() == [1, 0, 2]
    index.save(tmp_path / "i.rsidx")
    loaded = SequenceIndex.load(tmp_path / "i.rsidx")
    assert loaded.lengths.tolist() == index.lengths.tolist() and loaded.order.tolist() == [1, 0, 2]
    with pytest.raises(UserError, match=r"1 record\(s\) have more than 2,147,483,647 residues, more than the "
                                        r"output's `lengths` column \(int32\) holds: .*x.fasta:3 'b' "
                                        r"\(3,000,000,000 residues\)"):
        apply_input_policies(index, RunConfig(fasta=[str(path)], out=str(tmp_path / "out")))


def test_model_alphabet_from_the_vocabulary():
    from pipeline.models import demo as demo_model
    assert model_alphabet(ESM_VOCAB) == "protein"
    assert model_alphabet(demo_model.VOCAB) == "protein"
    assert model_alphabet(["[PAD]", "[UNK]", "A", "C", "G", "T", "N"]) == "nucleotide"
    kmers = ["".join(random.Random(k).choices("ACGT", k=6)) for k in range(500)]
    assert model_alphabet(["<unk>", "<cls>", *kmers, "A", "C", "G", "T", "N"]) == "nucleotide"
    words = ["the", "protein", "Ġof", *"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"] * 10
    assert model_alphabet(words) is None   # a text tokenizer reads anything: not checked


def test_nucleotide_like_threshold_and_warning(tmp_path, monkeypatch):
    path = tmp_path / "m.fasta"
    path.write_bytes(b">p1\nMKVLAAGIVE\n>d90\nACGTACGTAM\n>d80\nacgtuacgMM\n>dl\nacgtn\r\nNNACG*\n>e\n\n")
    index = SequenceIndex.build([path])
    assert nucleotide_like(index).tolist() == [False, True, False, True, False]

    protein = alphabet_mismatch(index, ESM_VOCAB)
    assert protein.startswith("2 of 5 record(s) look like nucleotides") and "'d90', 'dl'" in protein
    dna = alphabet_mismatch(index, ["<pad>", "A", "C", "G", "T", "N"])
    assert dna.startswith("2 of 5 record(s) look like protein") and "'p1', 'd80'" in dna
    assert alphabet_mismatch(index, ["the", "a", "b"]) is None

    # the counts are cached beside the index cache: a second check does not read the FASTA again
    monkeypatch.setattr("index.alphabet.ScanStream", lambda *a, **k: pytest.fail("read again"))
    assert alphabet_mismatch(index, ESM_VOCAB) == protein


def test_dna_given_to_a_protein_model_warns_once_before_any_work(tmp_path, models):
    path = tmp_path / "mixed.fasta"
    path.write_bytes(b">p1\nMKVLAAGIVEEL\n>d1 dna\nACGTACGTNNACGTAGCTAGCTAGCA\n>d2\nacgtuacgtacgt\n")
    out = tmp_path / "out"
    res = run_cli(str(path), "--out", str(out), "--model", models["esm"], "--gpus", "0", "--workers", "1",
                  "--no-progress")
    assert res.returncode == 0, res.stderr
    warnings = [ln for ln in res.stderr.splitlines() if "look like nucleotides" in ln]
    assert len(warnings) == 1 and "2 of 3 record(s)" in warnings[0] and "'d1', 'd2'" in warnings[0]
    assert res.stderr.index("look like nucleotides") < res.stderr.index("started shard 0")
    with h5py.File(out / "result.h5") as f:
        assert f["status"][:].tolist() == [0, 0, 0] and f["lengths"][:].tolist() == [12, 26, 13]
