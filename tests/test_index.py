"""index/: offsets, lengths and ids on odd FASTA, errors, storage, cache reuse and invalidation, sharding."""
import os
import random
import re

import numpy as np
import pytest

from index import FastaError, InputChanged, SequenceIndex, load_or_build, records_changed, scan_fasta, sequence_text
from index import fasta_scan, sequence_index
from index.record_checksum import checksum
from index.sequence_index import IndexCorrupt, id_hashes

from .conftest import SHARED_DATA


def reference_parse(data: bytes):
    """An obviously-correct line-by-line parser: (id, offset, nbytes, residues) per record.

    Lines end at CRLF, LF or a lone CR; a header is a line starting with '>'; the id is the header's first
    run of bytes above 32; sequence lines lose their whitespace (space, tab, VT, FF) and a final '*'.
    """
    records, pos = [], 0
    for full in re.findall(rb"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+$", data):
        line = full.rstrip(b"\r\n")
        if line.startswith(b">"):
            records.append({"id": re.search(rb"[^\x00-\x20]+", line[1:]).group().decode(), "offset": pos,
                            "seq": b""})
        elif records:
            records[-1]["seq"] += line
        pos += len(full)
    assert pos == len(data)
    for r, nxt in zip(records, records[1:] + [None]):
        r["nbytes"] = (nxt["offset"] if nxt else len(data)) - r["offset"]
        seq = r["seq"].translate(None, b" \t\x0b\x0c").upper()
        r["residues"] = (seq[:-1] if seq.endswith(b"*") else seq).decode()
    return records


def check_against_reference(path, data):
    scan = scan_fasta(path)
    ref = reference_parse(data)
    assert len(scan.offsets) == len(ref)
    ids = np.split(scan.id_blob, np.cumsum(scan.id_lengths)[:-1]) if len(ref) else []
    for k, r in enumerate(ref):
        assert ids[k].tobytes().decode() == r["id"], k
        assert scan.offsets[k] == r["offset"], (k, r["id"])
        assert scan.nbytes[k] == r["nbytes"], (k, r["id"])
        assert scan.lengths[k] == len(r["residues"]), (k, r["id"])
        record = data[r["offset"]:r["offset"] + r["nbytes"]]
        assert sequence_text(record) == r["residues"]
        # the scanner's vectorised checksum equals the one a worker takes of the record it reads
        assert int(scan.checksums[k]) == checksum(record, r["offset"]), (k, r["id"])
    return scan


ODD = {
    "multi_line": b">a desc\nACDE\nFGHI\nK\n>b\nMM\n",
    "single_line": b">a\nACDEFGHIK\n>b\nMM\n",
    "blank_lines": b"\n\n>a\nAC\n\nDE\n\n\n>b x\n\nMM\n\n",
    "crlf": b">a one\r\nACDE\r\nFG\r\n>b\r\nMM\r\n",
    "cr_only": b">a one\rACDE\rFG\r>b\rMM\r",
    "cr_after_lf": b">a first\rACGTAC\rGGTT\r>b second\rMKV*\r\n",   # issue #18: b was swallowed by a
    "lf_then_cr": b">a\nAC\n>b\rMM\r>c\r\nK\n",
    "cr_before_lf_header": b">a\nAC\r\r\n>b\n\rMM\n",
    "vt_ff_in_sequence": b">a\nAC\x0bDE\x0c\nF G\x0b\n>b\n\x0cMM\n",
    "ncbi_ctrl_a": b">WP_1.1 prot [X]\x01WP_2.1 prot [Y]\nMKV\n>id\x01other x\nAC\n",
    "control_bytes_in_header": b">a\x02b\x7f desc\x1b[0m\nMK\n",
    "lowercase": b">a\nacdeFGhi\n>b\nmm\n",
    "punctuation": b">sp|P1|X_Y @#$%^[]:?; (x) {y}\nAC\n>emb|CAA1.6||gi|78\nDD\n",
    "no_final_newline": b">a\nACDE\n>b\nMMM",
    "header_last_no_newline": b">a\nAC\n>b",
    "trailing_star": b">a\nACDE*\n>b\nMM*\r\n\n>c\n*\n",
    "inner_spaces_tabs": b">a\tdesc with tab\nAC DE\tFG\n>b\nM M\n",
    "leading_blank_in_header": b">  spaced id here\nAC\n",
    "utf8_description": ">a caf\u00e9 \u03b2-lactamase\nAC\n".encode(),
}


@pytest.mark.parametrize("name", sorted(ODD))
def test_odd_fasta_matches_reference(tmp_path, name):
    path = tmp_path / f"{name}.fasta"
    path.write_bytes(ODD[name])
    check_against_reference(path, ODD[name])


def test_leading_blank_header_id_and_sequence_text(tmp_path):
    path = tmp_path / "x.fasta"
    path.write_bytes(b">  spaced id here\nac de\n*\n")
    index = SequenceIndex.build([path])
    assert index.id(0) == "spaced"
    assert index.sequence(0) == "ACDE"
    assert index.lengths[0] == 4
    assert index.header(0) == "  spaced id here"


def random_fasta(rng: random.Random, n: int, endings=(b"\n", b"\r\n")) -> bytes:
    """Records of random lengths and line widths; each line ends with one of `endings` (any mix)."""
    out = []
    for i in range(n):
        head = f">id{i}_{rng.randrange(10**6)}" + rng.choice(["", " desc", "\tdesc x", " a b c", "\x01id{i}b x"])
        out.append(head.encode() + rng.choice(endings))
        length = rng.choice([0, 1, 5, 60, 61, 200, 1000, 5000])
        seq = "".join(rng.choice("ACDEFGHIKLMNPQRSTVWYacgt") for _ in range(length))
        if rng.random() < 0.2:
            seq += "*"
        width = rng.choice([10, 60, 80, 10**6])
        for j in range(0, len(seq), width):
            out.append(seq[j:j + width].encode() + rng.choice(endings))
        if rng.random() < 0.2:
            out.append(rng.choice(endings))
    data = b"".join(out)
    return data[:-1] if rng.random() < 0.5 else data


MIXES = {"lf_crlf": (b"\n", b"\r\n"), "cr": (b"\r",), "lf_cr_crlf": (b"\n", b"\r", b"\r\n")}


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("block", [64, 97, 4096])
def test_block_boundaries_do_not_matter(tmp_path, monkeypatch, block, mix):
    """Tiny blocks force records (and headers, and CRLFs) to cross block boundaries everywhere."""
    rng = random.Random(block)
    data = random_fasta(rng, 300, MIXES[mix])
    path = tmp_path / "r.fasta"
    path.write_bytes(data)
    monkeypatch.setattr(fasta_scan, "BLOCK_BYTES", block)
    check_against_reference(path, data)


def _reference_checksum(record: bytes, offset: int, kind: int = 2) -> int:
    """record_checksum.py's definition in plain Python integers: sum over the 64-bit words k that hold the
    record's bytes (little-endian, other bytes zero) of word * W(k) + (word >> 32) * H(k) (kind 1: without the
    second term) mod 2**64, W(k) = (SplitMix64(k mod 2**19) | 1) * S(k), H(k) = (SplitMix64(2**19 + k mod 2**19)
    | 1) * S(k), S(k) = SplitMix64(k >> 19) | 1, or 1 for the first 2**19 words."""
    def mix(k):
        m = 2**64 - 1
        z = (k * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & m
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        return z ^ (z >> 31)
    lead = offset % 8
    padded = bytes(lead) + record + bytes(-(lead + len(record)) % 8)
    total = 0
    for j in range(0, len(padded), 8):
        k = offset // 8 + j // 8
        segment = (mix(k >> 19) | 1) if k >> 19 else 1
        word = int.from_bytes(padded[j:j + 8], "little")
        total += word * (mix(k % 2**19) | 1) * segment
        if kind == 2:
            total += (word >> 32) * (mix(2**19 + k % 2**19) | 1) * segment
    return total % 2**64


@pytest.mark.parametrize("block", [64, 4096, 4 << 20])
def test_record_checksums_see_every_byte(tmp_path, monkeypatch, block):
    """Each record's checksum is fixed by its bytes and place alone, whatever the block size; a one-residue
    edit (same lengths, same offsets) changes that record's checksum and no other, including at the last
    byte of a block; reading the edited record through the old index is refused, naming it."""
    monkeypatch.setattr(fasta_scan, "BLOCK_BYTES", block)
    data = random_fasta(random.Random(5), 100)
    a, b = tmp_path / "a.fa", tmp_path / "b.fa"
    a.write_bytes(data)
    b.write_bytes(data)
    ia, ib = SequenceIndex.build([a]), SequenceIndex.build([b])
    assert ia.checksums.dtype == np.uint64 and np.array_equal(ia.checksums, ib.checksums)
    for i in (0, 1, len(ia) // 2, len(ia) - 1):
        record = data[int(ia.offsets[i]):int(ia.offsets[i] + ia.nbytes[i])]
        assert int(ia.checksums[i]) == _reference_checksum(record, int(ia.offsets[i]))
    residues = [i for i, c in enumerate(data) if 65 <= c <= 90 and data.rfind(b">", 0, i) < data.rfind(b"\n", 0, i)]
    for pos in (residues[0], residues[-1], max(i for i in residues if i < block) if block < len(data) else residues[5]):
        edited = bytearray(data)
        edited[pos] = ord("W") if data[pos] != ord("W") else ord("A")
        b.write_bytes(bytes(edited))
        ib = SequenceIndex.build([b])
        assert np.array_equal(ib.lengths, ia.lengths) and np.array_equal(ib.offsets, ia.offsets)
        record = int(np.searchsorted(ia.offsets, pos, "right")) - 1
        assert np.flatnonzero(ib.checksums != ia.checksums).tolist() == [record]
        assert ia.edited_inputs(ib) == [str(a)] and ib.fingerprint() != ia.fingerprint()
        stale = SequenceIndex(ib.inputs, ia.offsets, ia.nbytes, ia.lengths, ia.file_no, ia.id_offsets, ia.id_blob,
                              checksums=ia.checksums)       # the index as it was, reading the edited file
        with pytest.raises(InputChanged, match=f"record {record + 1:,} .*no longer holds the text") as e:
            stale.sequence(record)
        assert e.value.seq_id == ia.id(record) and e.value.path == str(b)
        other = record - 1 if record else record + 1
        assert stale.sequence(other) == ia.sequence(other)               # the others read as before


def test_checksum_catches_every_single_byte_change():
    rng = random.Random(3)
    record = b">x y\n" + bytes(rng.choice(b"ACDEFGHIKLMNPQRSTVWY") for _ in range(70)) + b"\n"
    for offset in (0, 5, (1 << 22) - 20):            # any alignment, and across a 4 MiB segment's end
        want = checksum(record, offset)
        assert want == _reference_checksum(record, offset)
        for pos in range(len(record)):
            for delta in (1, 2, 32, 128, 255):
                edited = bytearray(record)
                edited[pos] = (edited[pos] + delta) % 256
                assert checksum(bytes(edited), offset) != want, (offset, pos, delta)


def test_two_edits_in_the_top_bytes_of_words_change_the_checksum():
    """Found by a red team at 9185f6a: with word * W(k) alone (kind 1), a change confined to byte 7 of a word
    counts 2**56 times, so two residues edited at byte 7 of their words cancel whenever c * W(a) + d * W(b) = 0
    mod 256, one pair of letters in 256: a continued run took the edited record for the indexed one and merged
    its old row. With each word's high half (kind 2) every such pair is seen."""
    letters = b"ACDEFGHIKLMNPQRSTVWY"
    rng = random.Random(7)
    text = b">r\n" + bytes(rng.choice(letters) for _ in range(400)) + b"\n"
    seen = 0
    for a, b in ((7 + 8 * 5, 7 + 8 * 9), (7 + 8 * 20, 7 + 8 * 21), (7 + 8 * 30, 7 + 8 * 44)):
        for new_a in letters:
            for new_b in letters:
                edited = bytearray(text)
                edited[a], edited[b] = new_a, new_b
                if edited == text or checksum(bytes(edited), 0, kind=1) != checksum(text, 0, kind=1):
                    continue
                seen += 1   # kind 1 misses it; kind 2 (the default) must not
                assert checksum(bytes(edited), 0) != checksum(text, 0), (a, b, chr(new_a), chr(new_b))
                assert checksum(bytes(edited), 0) == _reference_checksum(bytes(edited), 0)
    assert seen >= 3   # (the pairs kind 1 misses exist at each place tried)


def test_an_index_of_format_4_checks_reads_and_edits_with_its_own_checksums(tmp_path, monkeypatch):
    """A run planned before kind 2 keeps its index (format 4, kind 1 checksums): its reads are checked with kind
    1, and a continuation, which indexes the files anew (kind 2), compares by reading them with the old index."""
    path = tmp_path / "a.fa"
    path.write_bytes(b">a\nMKVL\n>b\nACDEFG\n")
    new = SequenceIndex.build([path])
    assert new.checksum_kind == 2 and int(new.checksums[1]) == _reference_checksum(b">b\nACDEFG\n", 8)
    kind_1 = np.array([_reference_checksum(b">a\nMKVL\n", 0, kind=1),
                       _reference_checksum(b">b\nACDEFG\n", 8, kind=1)], np.uint64)
    old = SequenceIndex(new.inputs, new.offsets, new.nbytes, new.lengths, new.file_no, new.id_offsets, new.id_blob,
                        checksums=kind_1, meta={"duplicate_groups": []})
    monkeypatch.setattr(sequence_index, "FORMAT_VERSION", 4)
    old.save(tmp_path / "v4.rsidx")
    monkeypatch.undo()
    loaded = SequenceIndex.load(tmp_path / "v4.rsidx")
    assert loaded.checksum_kind == 1 and loaded.sequence(1) == "ACDEFG"
    assert loaded.edited_inputs(SequenceIndex.build([path])) == []
    loaded.save(tmp_path / "again.rsidx")   # (a run's copy saved again keeps the kind it holds)
    assert SequenceIndex.load(tmp_path / "again.rsidx").checksum_kind == 1
    path.write_bytes(b">a\nMKVL\n>b\nACDEFW\n")
    assert loaded.edited_inputs(SequenceIndex.build([path])) == [str(path)]
    with pytest.raises(InputChanged, match="no longer holds the text"):
        loaded.sequence(1)


def test_index_of_format_2_still_loads_and_compares(tmp_path, monkeypatch):
    """A run started before record checksums keeps working: its index loads, reads unchecked, and an edit
    in place is still told by format 2's whole-file checksum."""
    path = tmp_path / "a.fa"
    path.write_bytes(b">a\nMKVL\n>b\nACDEFG\n")
    new = SequenceIndex.build([path])
    old = SequenceIndex(new.inputs, new.offsets, new.nbytes, new.lengths, new.file_no, new.id_offsets, new.id_blob)
    old.inputs = [sequence_index.InputFile.stat(path, fasta_scan.legacy_content_crc32(path))]
    monkeypatch.setattr(sequence_index, "FORMAT_VERSION", 2)
    old.save(tmp_path / "v2.rsidx")
    monkeypatch.undo()
    loaded = SequenceIndex.load(tmp_path / "v2.rsidx")
    assert loaded.checksums is None and loaded.sequence(1) == "ACDEFG"
    assert loaded.edited_inputs(SequenceIndex.build([path])) == []
    path.write_bytes(b">a\nMKVL\n>b\nACDEFW\n")
    assert loaded.sequence(1) == "ACDEFW"                      # unchecked, as before
    assert loaded.edited_inputs(SequenceIndex.build([path])) == [str(path)]


def test_real_files_match_reference():
    for name in ("protein_lib.fa", "ncbi_standard_aa.fasta", "dups.fasta"):
        path = SHARED_DATA / name
        check_against_reference(path, path.read_bytes())


def test_several_files_keep_order_and_file_numbers(tmp_path):
    a, b = tmp_path / "a.fa", tmp_path / "b.fa"
    a.write_bytes(b">x1\nAAA\n>x2\nCC\n")
    b.write_bytes(b">y1\nDDDD\n")
    index = SequenceIndex.build([a, b])
    assert index.ids() == ["x1", "x2", "y1"]
    assert index.file_no.tolist() == [0, 0, 1]
    assert [index.sequence(i) for i in range(3)] == ["AAA", "CC", "DDDD"]
    assert index.path_of(2) == str(b)


@pytest.mark.parametrize("content,message,line", [
    (b"", "no FASTA records: the file is empty", None),
    (b"\n\n  \n", "no FASTA records: the file holds no '>' header", None),
    (b"ACDE\n>a\nAC\n", "sequence data before the first header", 1),
    (b"\n\nACDE\n>a\nAC\n", "sequence data before the first header", 3),
    (b">a\nAC\x00DE\n", "binary or control byte 0x00 in the sequence data", 2),
    (b">a\rAC\rDE\x01\r", "binary or control byte 0x01 in the sequence data", 3),
    (b">a\nAC\n>b\nMM\xff\xfe\n", "non-ASCII byte 0xff in the sequence data", 4),
    (b">a\nMK\xc3\xa9V\n", "non-ASCII byte 0xc3", 2),
    (b">a\nMK\x7fV\n", "control byte 0x7f in the sequence data", 2),
    (b">a\nMK\n>b\x00c desc\nMK\n", "NUL byte (0x00) in the header", 3),
    (b"\xef\xbb\xbf>a\nMKV\n", "starts with a UTF-8 byte-order mark", 1),
    (b"\x89PNG\r\n\x1a\n\x00\x00", "binary data", 1),
    (b";comment\n>a\nMK\n", "comment line (starting with ';') before the first header", 1),
    (b">a\nMK\r;comment\rMK\r", "comment line (starting with ';') among the sequence lines", 3),
    (b"@r1\nACGT\n+\nIIII\n", "FASTQ file", 1),
    (b"\n<!DOCTYPE html>\n<html><body>Not found</body></html>\n", "HTML page", 1),
    (">a\nMKV\n".encode("utf-16"), "UTF-16 (little-endian) text", None),
    (">a desc\nMKV\n".encode("utf-16-be"), "UTF-16 (big-endian) text", None),
    (">a\nMKV\n".encode("utf-32"), "UTF-32 (little-endian) text", None),
    (b"\x1f\x8b\x08\x00rest", "gzip-compressed", None),
    (b">a\nAC>DE\n>b\nM\n", "'>' in the sequence data: a header starts at the beginning of its line", 2),
    (b">a\nAC\n  >b\nM\n", "'>' in the sequence data", 3),   # an indented header: it would join b to a
    (b">a desc -> x\nAC\n\t>b\nM\n", "'>' in the sequence data", 3),   # (a '>' in a description is fine)
    (b">a\nAC\n>\nMM\n", "header has no id", 3),
    (b">a\nAC\n>   \nMM\n", "header has no id", 3),
])
@pytest.mark.parametrize("block", [7, 4 << 20])
def test_bad_fasta_errors_name_file_and_line(tmp_path, monkeypatch, content, message, line, block):
    """The same error whether it is found by a block's vectorised pass or while streaming a record that
    crosses blocks (7-byte blocks)."""
    monkeypatch.setattr(fasta_scan, "BLOCK_BYTES", block)
    path = tmp_path / "bad.fasta"
    path.write_bytes(content)
    with pytest.raises(FastaError) as err:
        SequenceIndex.build([path])
    assert message in str(err.value)
    assert str(path) in str(err.value)
    assert err.value.line == line


@pytest.mark.parametrize("block", [8, 4 << 20])
def test_binary_error_names_the_record(tmp_path, monkeypatch, block):
    """Found in a block or while streaming a record that crosses blocks, the error names line and record."""
    monkeypatch.setattr(fasta_scan, "BLOCK_BYTES", block)
    path = tmp_path / "bad.fasta"
    path.write_bytes(b">first\nAC\n>second x\rMM\r\nMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMMM\x01M\n")
    with pytest.raises(FastaError) as err:
        SequenceIndex.build([path])
    assert err.value.seq_id == "second" and err.value.line == 5
    assert "byte 0x01 in the sequence data" in str(err.value)


def test_missing_and_directory_inputs(tmp_path):
    with pytest.raises(FastaError, match="file not found"):
        SequenceIndex.build([tmp_path / "nope.fasta"])
    with pytest.raises(FastaError, match="is a directory"):
        SequenceIndex.build([tmp_path])
    with pytest.raises(FastaError, match=r"-: no such file, and standard input \('-'\) is not read\. The index needs"):
        SequenceIndex.build(["-"])
    (tmp_path / "a.fa").write_bytes(b">a\nMK\n")
    with pytest.raises(FastaError, match="the same file is given twice"):
        SequenceIndex.build([tmp_path / "a.fa", str(tmp_path / "." / "a.fa")])


def test_invalid_utf8_id(tmp_path):
    path = tmp_path / "x.fasta"
    path.write_bytes(b">ok\nA\n>bad\xe9id\nA\n")
    with pytest.raises(FastaError, match="not valid UTF-8") as err:
        SequenceIndex.build([path])
    assert err.value.line == 3


def test_duplicate_ids_found_across_files(tmp_path):
    index = SequenceIndex.build([SHARED_DATA / "dups.fasta"])
    assert index.duplicate_ids() == [[0, 3]]
    other = tmp_path / "o.fasta"
    other.write_bytes(b">beta\nAA\n>zeta\nC\n")
    index = SequenceIndex.build([SHARED_DATA / "dups.fasta", other])
    assert sorted(index.duplicate_ids()) == [[0, 3], [1, 5]]


def test_renamed_duplicates_never_take_an_existing_id(tmp_path):
    fasta = tmp_path / "d.fa"
    fasta.write_bytes(b">a\nMK\n>a\nMV\n>a.dup2\nML\n>a\nMA\n>a.dup3\nMC\n")
    index = SequenceIndex.build([str(fasta)])
    renamed, originals = index.with_renamed_duplicates(index.duplicate_ids())
    assert renamed.ids() == ["a", "a.dup4", "a.dup2", "a.dup5", "a.dup3"]
    assert renamed.duplicate_ids() == [] and originals == {1: "a", 3: "a"}


def test_renamed_duplicates_keep_originals():
    index = SequenceIndex.build([SHARED_DATA / "dups.fasta"])
    renamed, originals = index.with_renamed_duplicates(index.duplicate_ids())
    assert renamed.ids() == ["alpha", "beta", "gamma", "alpha.dup2", "delta"]
    assert originals == {3: "alpha"}
    assert renamed.duplicate_ids() == []
    assert renamed.sequence(3) == "ACGTA"


def test_id_hash_equal_ids_equal_hashes_across_chunks():
    ids = [b"a", b"bb", b"a", b"abc", b"cba", b"bb", b"x" * 50, b"x" * 50]
    blob = np.frombuffer(b"".join(ids), np.uint8)
    offs = np.concatenate([[0], np.cumsum([len(i) for i in ids])]).astype(np.int64)
    for chunk in (4, 64, 1 << 20):
        h = id_hashes(blob, offs, chunk_bytes=chunk)
        assert h[0] == h[2] and h[1] == h[5] and h[6] == h[7]
        assert len(set(h.tolist())) == 5


def test_empty_records_are_reported():
    # record 'c' has only a '*' and is empty once the stop symbol is dropped
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".fa", delete=False) as fh:
        fh.write(b">a\nAC\n>b\n\n>c\n*\n>d\nM\n")
    try:
        index = SequenceIndex.build([fh.name])
        assert index.empty_records().tolist() == [1, 2]
    finally:
        os.unlink(fh.name)


def test_save_load_roundtrip_and_corruption(tmp_path):
    index = SequenceIndex.build([SHARED_DATA / "protein_lib.fa"])
    path = tmp_path / "i.rsidx"
    index.save(path)
    loaded = SequenceIndex.load(path)
    assert loaded.fingerprint() == index.fingerprint()
    assert loaded.ids() == index.ids()
    assert np.array_equal(loaded.order, index.order)
    assert loaded.sequence(3) == index.sequence(3)
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(IndexCorrupt, match="checksum"):
        SequenceIndex.load(path)
    path.write_bytes(bytes(raw[: len(raw) // 2]))
    with pytest.raises(IndexCorrupt, match="truncated"):
        SequenceIndex.load(path)
    path.write_bytes(b"garbage")
    with pytest.raises(IndexCorrupt):
        SequenceIndex.load(path)


def test_cache_reused_then_invalidated_by_mtime_size_and_corruption(tmp_path, caplog):
    fasta = tmp_path / "in.fasta"
    fasta.write_bytes(b">a\nACDE\n>b\nMM\n")
    first, reused = load_or_build([fasta])
    assert not reused
    again, reused = load_or_build([fasta])
    assert reused and again.ids() == ["a", "b"]

    st = os.stat(fasta)
    os.utime(fasta, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000))  # same size, newer mtime
    _, reused = load_or_build([fasta])
    assert not reused

    fasta.write_bytes(b">a\nACDE\n>b\nMM\n>c\nW\n")  # size changes
    rebuilt, reused = load_or_build([fasta])
    assert not reused and rebuilt.ids() == ["a", "b", "c"]

    from index import cache_path
    cached = cache_path([fasta])
    cached.write_bytes(cached.read_bytes()[:-10])
    with caplog.at_level("WARNING"):
        rebuilt, reused = load_or_build([fasta])
    assert not reused and rebuilt.ids() == ["a", "b", "c"]
    assert "corrupt" in caplog.text


def test_order_is_length_descending_stable():
    index = SequenceIndex.build([SHARED_DATA / "protein_lib.fa"])
    lengths = index.lengths[index.order]
    assert np.all(np.diff(lengths) <= 0)
    for a, b in zip(index.order[:-1], index.order[1:]):
        if index.lengths[a] == index.lengths[b]:
            assert a < b


@pytest.mark.parametrize("world", [1, 2, 3, 5, 16])
def test_stride_shards_cover_everything_once(tmp_path, world):
    rng = random.Random(world)
    path = tmp_path / "r.fasta"
    path.write_bytes(random_fasta(rng, 101))
    index = SequenceIndex.build([path])
    shards = [index.stride_shard(r, world) for r in range(world)]
    together = np.concatenate(shards)
    assert sorted(together.tolist()) == list(range(len(index)))   # no gap, no overlap
    assert [len(s) for s in shards] == [len(range(r, len(index), world)) for r in range(world)]
    again = SequenceIndex.build([path])
    assert all(np.array_equal(a, again.stride_shard(r, world)) for r, a in enumerate(shards))  # deterministic
    stats = index.shard_stats(world)
    assert stats.sequences.sum() == len(index)
    assert stats.tokens.sum() == index.total_residues
    assert stats.imbalance >= 1.0


def test_duplicate_ids_found_in_large_indexes_in_both_halves_of_the_hash_range():
    """Over 65,536 ids the hashes are computed and sorted in parts on threads: repeats in either half of
    the hash range, and ids split across the parts, are all found."""
    from index.sequence_index import _repeated_values, id_hashes
    ids = [f"id{i}".encode() for i in range(70000)] + [b"id5", b"id69999", b"id35000", b"id35000"]
    blob = np.frombuffer(b"".join(ids), np.uint8)
    offsets = np.zeros(len(ids) + 1, np.int64)
    np.cumsum([len(x) for x in ids], out=offsets[1:])
    h = id_hashes(blob, offsets)
    assert np.array_equal(h, id_hashes(blob, offsets, chunk_bytes=64))   # chunking changes nothing
    repeated = set(_repeated_values(h).tolist())
    assert repeated == {int(h[5]), int(h[69999]), int(h[35000])}


# ------------------------------------------------------------------ edits the size and mtime do not show
def _same_size_edit(text: bytes) -> bytes:
    """`text` with the first two residues of its first record swapped (same size, same layout)."""
    first = text.index(b"\n") + 1
    edited = text[:first] + text[first + 1:first + 2] + text[first:first + 1] + text[first + 2:]
    assert edited != text and len(edited) == len(text)
    return edited


def test_cache_sees_an_edit_that_keeps_size_and_mtime(tmp_path, caplog):
    """An edit written in place with the mtime set back (`touch -r`), and another file of the same size and
    mtime renamed into place (`mv`): the cache is not reused, the index holds the text as it is now (the cache
    compared size and mtime alone and gave the old text's index, as current)."""
    fasta = tmp_path / "in.fasta"
    fasta.write_bytes(b">a\nACDEFG\n>b\nMMKL\n")
    old, reused = load_or_build([fasta])
    assert not reused
    st = os.stat(fasta)
    with open(fasta, "r+b") as fh:   # written in place: the same inode
        fh.write(_same_size_edit(fasta.read_bytes()))
    os.utime(fasta, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (os.stat(fasta).st_size, os.stat(fasta).st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    with caplog.at_level("INFO"):
        index, reused = load_or_build([fasta])
    assert not reused and "stale" in caplog.text
    assert index.sequence(0) == "CADEFG"

    other = tmp_path / "other.fasta"
    other.write_bytes(b">a\nACDEFG\n>b\nWWKL\n")
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(other, fasta)
    assert (os.stat(fasta).st_size, os.stat(fasta).st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    index, reused = load_or_build([fasta])
    assert not reused and [index.sequence(0), index.sequence(1)] == ["ACDEFG", "WWKL"]
    again, reused = load_or_build([fasta])
    assert reused   # (and while nothing changes, it is reused)


def test_a_run_index_tells_an_edit_that_keeps_size_and_mtime(tmp_path):
    """What `rerun`, a continued run and the check before the merge ask (`records_changed`): an edit with the
    mtime set back is found (it was accepted unread, so a rerun merged rows of the old text as the file's)."""
    fasta = tmp_path / "in.fasta"
    fasta.write_bytes(b">a\nACDEFG\n>b\nMMKL\n")
    index = SequenceIndex.build([fasta])
    assert records_changed(index) is None
    st = os.stat(fasta)
    text = fasta.read_bytes()
    with open(fasta, "r+b") as fh:
        fh.write(_same_size_edit(text))
    os.utime(fasta, ns=(st.st_atime_ns, st.st_mtime_ns))
    changed = records_changed(index)
    assert changed is not None and "its size and modification time are as they were" in changed \
        and "the contents of" in changed, changed
    with open(fasta, "r+b") as fh:   # restored: the same bytes, only touched
        fh.write(text)
    assert records_changed(index) is None


def test_a_run_index_reads_a_file_whose_stat_moved_with_the_same_text_once(tmp_path, monkeypatch):
    """A chmod (or `cp -p` onto a node's own disk at the same path) moves the change time or inode and keeps the
    text: the first check reads the file and says nothing changed; later checks (every `status`, array task and
    worker) take that reading from the index cache instead of reading the whole file again. An edit after it is
    still found."""
    fasta = tmp_path / "in.fasta"
    text = b">a\nACDEFG\n>b\nMMKL\n"
    fasta.write_bytes(text)
    index = SequenceIndex.build([fasta])
    os.chmod(fasta, 0o600)
    os.chmod(fasta, 0o644)
    assert index.stat_changes() != []
    builds = []
    real_build = sequence_index.index_build.build_file
    monkeypatch.setattr(sequence_index.index_build, "build_file",
                        lambda paths, *a, **k: builds.append(paths) or real_build(paths, *a, **k))
    assert records_changed(index) is None and len(builds) == 1
    assert records_changed(index) is None and records_changed(index) is None and len(builds) == 1
    st = os.stat(fasta)
    with open(fasta, "r+b") as fh:
        fh.write(_same_size_edit(text))
    os.utime(fasta, ns=(st.st_atime_ns, st.st_mtime_ns))
    changed = records_changed(index)
    assert changed is not None and "the contents of" in changed and len(builds) == 2, changed


def test_index_of_a_file_from_before_change_times_compares_what_it_recorded(tmp_path):
    """A run planned before the change time and inode were recorded is not refused for lacking them."""
    fasta = tmp_path / "in.fasta"
    fasta.write_bytes(b">a\nACDEFG\n")
    index = SequenceIndex.build([fasta])
    f = index.inputs[0]
    old = sequence_index.InputFile(f.path, f.size, f.mtime_ns)
    assert old.unchanged(sequence_index.InputFile.stat(fasta))
    index.inputs = [old]
    assert index.stat_changes() == [] and records_changed(index) is None


def test_an_index_header_keeps_its_inputs_as_older_versions_read_them(tmp_path):
    """The change time and inode sit beside the header's "inputs", whose entries keep the fields an older
    run_shards builds its InputFile from (with them inside, it failed with a TypeError on a newer run
    directory); they are read back."""
    from index import index_file
    fasta = tmp_path / "in.fasta"
    fasta.write_bytes(b">a\nACDEFG\n")
    index = SequenceIndex.build([fasta])
    index.save(tmp_path / "saved.rsidx")
    header = index_file.Mapped(tmp_path / "saved.rsidx", sequence_index.READABLE_VERSIONS).header
    assert [set(f) for f in header["inputs"]] == [{"path", "size", "mtime_ns", "content_crc32"}]
    st = os.stat(fasta)
    assert [(f.ctime_ns, f.inode) for f in SequenceIndex.load(tmp_path / "saved.rsidx").inputs] == \
        [(st.st_ctime_ns, st.st_ino)]


def test_gzip_replaced_by_one_of_the_same_size_and_mtime_is_decompressed_again(tmp_path):
    """A plain .gz renamed over by another of the same size and mtime: its decompressed copy (and the index of
    it) was reused, so the run computed the old sequences under the new file's name."""
    import gzip
    path, other = tmp_path / "in.fasta.gz", tmp_path / "new.fasta.gz"
    text = b">a\nACDEFG\n>b\nMMKL\n"
    path.write_bytes(gzip.compress(text, compresslevel=0, mtime=0))   # stored: the size follows the text's
    old, _ = load_or_build([path])
    assert old.sequence(0) == "ACDEFG"
    other.write_bytes(gzip.compress(_same_size_edit(text), compresslevel=0, mtime=0))
    st = os.stat(path)
    assert os.stat(other).st_size == st.st_size
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(other, path)
    index, reused = load_or_build([path])
    assert not reused and index.sequence(0) == "CADEFG"


def test_a_file_appended_to_while_it_is_indexed_is_refused(tmp_path, monkeypatch):
    """Another process appends records while the scan runs (here, after its first piece): the index would
    miss them (and cut a record being written), yet the stat taken after the scan made it look current, so the
    cache gave it to every later run. Now the build is refused, naming the file and what to do."""
    from index import build
    fasta = tmp_path / "growing.fasta"
    fasta.write_bytes(b">a\nACDEFG\n>b\nMMKL\n>c\nMKV")   # record c is being written

    class Appended(build.ScanStream):
        def __iter__(self):
            for k, piece in enumerate(super().__iter__()):
                if k == 0:
                    with open(fasta, "ab") as fh:
                        fh.write(b"LLWW\n>d\nPPPP\n")
                yield piece
    monkeypatch.setattr(build, "ScanStream", Appended)
    with pytest.raises(FastaError, match=r"growing\.fasta: the file changed while it was being indexed \(size "
                                         r"changed from 24 to 37 bytes\)\. Something is still writing it"):
        load_or_build([fasta])
    monkeypatch.undo()
    index, reused = load_or_build([fasta])   # (no index was cached from the scan)
    assert not reused and index.ids() == ["a", "b", "c", "d"] and index.sequence(2) == "MKVLLWW"


def test_a_pipe_is_refused_with_what_to_do(tmp_path):
    """`run_shards index <(zcat x.gz)` (or `cat x | run_shards index /dev/stdin`): a clear refusal, not a
    traceback ending in "Illegal seek"."""
    import shutil
    import subprocess
    import sys
    from .tiny_models import REPO
    if shutil.which("bash") is None:
        pytest.skip("needs bash for a process substitution")
    fasta = tmp_path / "in.fasta"
    fasta.write_bytes(b">a\nACDEFG\n")
    cli = f"{sys.executable} {REPO / 'bin' / 'run_shards'}"
    for line in (f"{cli} index <(cat {fasta})", f"cat {fasta} | {cli} index /dev/stdin"):
        res = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=120)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert re.search(r"/dev/\S+: is a pipe, not a file: .*Save the FASTA to a file and pass its path",
                         res.stderr), res.stderr
    res = subprocess.run(["bash", "-c", f"{cli} index /dev/stdin < {fasta}"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and "records: 1" in res.stdout, res.stderr   # (a file on standard input is one)


def test_a_file_on_standard_input_is_recorded_by_its_own_path(tmp_path):
    """`run_shards run /dev/stdin < in.fasta`: the run records in.fasta, which `rerun` (with another standard
    input) and workers elsewhere can open; it recorded /dev/stdin, so a later `rerun` read its own standard
    input and refused the run as changed ("size changed from N to 0 bytes")."""
    import json
    import subprocess
    import sys
    from .tiny_models import REPO
    fasta, out = tmp_path / "in.fasta", tmp_path / "out"
    fasta.write_bytes(b">a\nACDEFG\n>b\nMMKL\n>c\nWWW\n")
    cli = [sys.executable, str(REPO / "bin" / "run_shards")]
    with open(fasta, "rb") as stdin:
        res = subprocess.run([*cli, "run", "/dev/stdin", "--out", str(out), "--gpus", "0", "--workers", "1",
                              "--shards", "2", "--no-progress"], stdin=stdin, capture_output=True, text=True,
                             timeout=300)
    assert res.returncode == 0, res.stderr
    assert json.loads((out / "manifest.json").read_text())["config"]["fasta"] == [str(fasta)]
    (out / "result.h5").unlink()
    (out / "shards" / "shard_1.h5").unlink()
    res = subprocess.run([*cli, "rerun", str(out), "--no-progress"], stdin=subprocess.DEVNULL, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0 and (out / "result.h5").exists(), res.stderr


def test_the_cache_folder_is_absolute_with_its_home_expanded(tmp_path, monkeypatch):
    """RUN_SHARDS_CACHE='~/cache' (quoted in a job script) made a folder named '~' wherever the command started,
    and a relative value named another cache from each current directory; an empty value is unset."""
    from index.cache import cache_dir
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RUN_SHARDS_CACHE", "~/cache")
    assert cache_dir() == tmp_path / "home" / "cache"
    monkeypatch.setenv("RUN_SHARDS_CACHE", "rel/cache")
    assert cache_dir() == tmp_path / "rel" / "cache"
    monkeypatch.setenv("RUN_SHARDS_CACHE", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "run_shards"


def test_the_index_sizes_its_threads_on_the_cpus_the_process_may_run_on(tmp_path):
    """A SLURM task bound to one CPU of a 64-core node (its cpuset), or `taskset -c 0`, scanned with 8 threads and
    hashed ids with 4: the index counted the node's cores. It now counts the process's affinity, and the index
    it builds is the same."""
    import subprocess
    import sys

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU here: an affinity of one changes nothing")
    fasta = tmp_path / "in.fasta"
    fasta.write_text("".join(f">s{i}\n{'MKTAYIAKQR' * (1 + i % 7)}\n" for i in range(50)))
    code = ("import os, sys; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from index import SequenceIndex; from index.fasta_scan import ScanStream; import index.id_hash as h; "
            "index = SequenceIndex.build([sys.argv[1]]); "
            "print(ScanStream(sys.argv[1]).threads, h._ID_THREADS, len(index), index.total_residues)")
    out = subprocess.run([sys.executable, "-c", code, str(fasta)], capture_output=True, text=True, check=True,
                         cwd=SHARED_DATA.parents[1]).stdout.split()
    whole = SequenceIndex.build([str(fasta)])
    assert out == ["1", "1", "50", str(whole.total_residues)]


def test_a_file_given_twice_under_two_names_is_refused_naming_both(tmp_path):
    """A hard link (or a bind mount) to a file given beside it was indexed twice: every id a duplicate, and the
    advice --on-duplicate-id rename computed every record twice. Refused as the same file, by device and inode
    as by path, naming both paths, by the index and through the cache."""
    (tmp_path / "a.fa").write_bytes(b">a\nMK\n>b\nMV\n")
    os.link(tmp_path / "a.fa", tmp_path / "hard.fa")
    os.symlink("a.fa", tmp_path / "soft.fa")
    (tmp_path / "other.fa").write_bytes(b">c\nMK\n")
    for twin in ("hard.fa", "soft.fa"):
        paths = [str(tmp_path / "a.fa"), str(tmp_path / "other.fa"), str(tmp_path / twin)]
        for build in (SequenceIndex.build, lambda p: load_or_build(p, tmp_path / "cache")):
            with pytest.raises(FastaError) as err:
                build(paths)
            assert str(err.value) == f"{paths[2]}: the same file is given twice (also as {paths[0]}). Pass each " \
                                     f"FASTA file once"
    index, _ = load_or_build([tmp_path / "a.fa", tmp_path / "other.fa"], tmp_path / "cache")
    assert index.ids() == ["a", "b", "c"]


def test_more_fasta_files_than_open_files_allowed_run_and_equal_one_file(tmp_path, models):
    """Every input file stayed open for the life of the index: a run over 300 FASTA files (one per protein, as
    they are often downloaded) under a limit of 200 open files (soft and hard: nothing a user may raise)
    stopped, planning or in a worker. Now each read opens its file past index.sequence_index.HELD_TEXTS of
    them, and the result equals the run over the same records in one file, bit for bit."""
    import resource
    import subprocess
    import sys

    import h5py

    from index.sequence_index import HELD_TEXTS
    from .tiny_models import REPO
    rng = random.Random(2)
    folder = tmp_path / "one per protein"
    folder.mkdir()
    n = 300
    assert n > HELD_TEXTS
    texts = [f">p{i} protein {i}\n{''.join(rng.choices('ACDEFGHIKLMNPQRSTVWY', k=rng.randrange(5, 40)))}\n"
             for i in range(n)]
    paths = []
    for i, text in enumerate(texts):
        paths.append(folder / f"p{i:03d}.fa")
        paths[-1].write_text(text)
    (tmp_path / "all.fa").write_text("".join(texts))

    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200))

    results = []
    for name, inputs, preexec in (("many", paths, limit), ("one", [tmp_path / "all.fa"], None)):
        out = tmp_path / name
        res = subprocess.run([sys.executable, str(REPO / "bin" / "run_shards"), "run", *map(str, inputs), "--out",
                              str(out), "--model", models["demo"], "--gpus", "0", "--workers", "2", "--no-progress"],
                             capture_output=True, text=True, timeout=300, cwd=REPO, preexec_fn=preexec,
                             env={**os.environ, "RUN_SHARDS_REPORT": "0"})
        assert res.returncode == 0, res.stderr[-3000:]
        with h5py.File(out / "result.h5") as f:
            results.append((f["ids"][:].tolist(), f["status"][:].tolist(), f["embeddings/mean"][:]))
    (ids, status, values), (ids1, status1, values1) = results
    assert ids == ids1 == [f"p{i}".encode() for i in range(n)] and status == status1 == [0] * n
    assert np.array_equal(values, values1)
