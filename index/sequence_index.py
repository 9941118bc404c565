"""The sequence index: one row per FASTA record, in binary, versioned, checksummed storage.

Per record: byte offset (8 bytes), byte length (4), residue count (4), file number (2), id offset into the
id blob (8), its place in the length-descending order (4) and its checksum (8, record_checksum.py): 38 bytes
plus the id itself. Byte length and residue count widen to 8 bytes when some record needs it (over 4 GiB,
over 2**31 - 1 residues). The record's description is its header line, read back with positioned reads
(`header`). Offsets are in the text: for a BGZF input (read in place), the index also keeps its block table.

Every sequence read through `sequence` is checked against its record's checksum, so no result is computed
from text other than the index describes (InputChanged otherwise).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from .compressed import given_path
from .errors import FastaError, InputChanged
from .fasta_scan import FileScan, legacy_content_crc32, scan_fasta, sequence_text
from .record_checksum import add, checksum
from .source import line_number, open_text

log = logging.getLogger(__name__)

# 2: records split at lone CRs, ids end at control bytes, 64-bit lengths when needed.
# 3: a checksum per record (instead of one per file); BGZF inputs read in place, with their block tables.
# Versions 1 and 2 hold the same required arrays, so a run directory's index of any version loads (its
# sequences are then read unchecked); caches of older versions are rebuilt (their file names differ).
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
_READ_BYTES = 16 << 20   # sequence(): a record is read and cleaned piece by piece
_ONE_READ = 1 << 30      # read_record(): larger reads go into a bytearray, a pread at a time
MAGIC = b"RSIDX\x00\r\n"
_ALIGN = 64
_ARRAYS = ("offsets", "nbytes", "lengths", "file_no", "id_offsets", "id_blob", "order")
# From version 3: checksums uint64 [N]; bgzf_blocks int64 [M, 2], the block tables of the BGZF inputs one
# after another; bgzf_spans int64 [F + 1], where each input's table starts in it (empty for a plain file).
_OPTIONAL = ("checksums", "bgzf_blocks", "bgzf_spans")


class IndexCorrupt(Exception):
    """A stored index that cannot be trusted (truncated, wrong checksum, wrong version)."""


@dataclass(frozen=True)
class InputFile:
    path: str       # absolute path
    size: int
    mtime_ns: int
    content_crc32: int | None = None   # format 2's checksum of the whole file (None: not known)

    @property
    def state(self) -> tuple[str, int, int]:
        """What a stat call shows: equal states mean the file was not touched since."""
        return self.path, self.size, self.mtime_ns

    @staticmethod
    def stat(path: str | os.PathLike, content_crc32: int | None = None) -> "InputFile":
        path = os.path.abspath(os.fspath(path))
        st = os.stat(path)
        return InputFile(path, st.st_size, st.st_mtime_ns, content_crc32)


@dataclass
class ShardStats:
    """Sequences and residues per worker for a stride split, and the max/mean token imbalance."""

    sequences: np.ndarray
    tokens: np.ndarray

    @property
    def imbalance(self) -> float:
        mean = float(self.tokens.mean()) if len(self.tokens) else 0.0
        return float(self.tokens.max()) / mean if mean > 0 else 1.0


class SequenceIndex:
    """Records of one or more FASTA files in input order (position i = i-th record of the inputs)."""

    def __init__(self, inputs: Sequence[InputFile], offsets: np.ndarray, nbytes: np.ndarray,
                 lengths: np.ndarray, file_no: np.ndarray, id_offsets: np.ndarray, id_blob: np.ndarray,
                 order: np.ndarray | None = None, meta: dict | None = None, checksums: np.ndarray | None = None,
                 bgzf_blocks: np.ndarray | None = None, bgzf_spans: np.ndarray | None = None):
        self.inputs = list(inputs)
        self.offsets = offsets
        self.nbytes = nbytes
        self.lengths = lengths
        self.file_no = file_no
        self.id_offsets = id_offsets
        self.id_blob = id_blob
        self.order = order if order is not None else length_descending_order(lengths)
        self.meta = dict(meta or {})
        self.checksums = checksums
        self.bgzf_blocks = bgzf_blocks
        self.bgzf_spans = bgzf_spans
        self._texts: dict = {}

    # ----------------------------------------------------------------- building
    @classmethod
    def build(cls, paths: Iterable[str | os.PathLike], threads: int | None = None) -> "SequenceIndex":
        """Scan the files (in the given order) and check ids; FastaError on malformed input."""
        inputs, scans = [], []
        paths = list(paths)
        real = [os.path.realpath(p) for p in paths]
        for k, r in enumerate(real):
            if r in real[:k]:
                raise FastaError(os.fspath(paths[k]), "the same file is given twice",
                                 hint="Pass each FASTA file once")
        for path in paths:
            scans.append(scan_fasta(path, threads))
            inputs.append(InputFile.stat(path))
        scan = FileScan.concat(scans)
        assert scan.checksums is not None and len(scan.checksums) == len(scan.offsets), "every record has one"
        tables = [s.table if s.table is not None else _no_tables() for s in scans]
        spans = np.zeros(len(scans) + 1, np.int64)
        np.cumsum([len(t) for t in tables], out=spans[1:])
        file_no = np.concatenate([np.full(len(s.offsets), k, np.uint16) for k, s in enumerate(scans)]) \
            if scans else np.zeros(0, np.uint16)
        if len(inputs) > np.iinfo(np.uint16).max:
            raise FastaError(inputs[-1].path, "too many input files (at most 65535)")
        id_offsets = np.zeros(len(scan.id_lengths) + 1, np.int64)
        np.cumsum(scan.id_lengths, out=id_offsets[1:])
        index = cls(inputs, scan.offsets.astype(np.int64, copy=False), _narrowest(scan.nbytes, np.uint32),
                    _narrowest(scan.lengths, np.int32), file_no, id_offsets, scan.id_blob.astype(np.uint8, copy=False),
                    checksums=scan.checksums, bgzf_blocks=np.concatenate(tables) if tables else _no_tables(),
                    bgzf_spans=spans)
        index._check_ids_utf8()
        index.meta["duplicate_groups"] = index._find_duplicate_ids()
        return index

    def _check_ids_utf8(self) -> None:
        if len(self.id_blob) and self.id_blob.max() > 127:
            for i in np.unique(np.searchsorted(self.id_offsets, np.flatnonzero(self.id_blob > 127), "right") - 1):
                try:
                    self.id_bytes(int(i)).decode("utf-8")
                except UnicodeDecodeError:
                    raise FastaError(self.path_of(int(i)), "record id is not valid UTF-8",
                                     line=self.line_of(int(i)), hint="Fix the header's encoding") from None

    # ----------------------------------------------------------------- access
    def __len__(self) -> int:
        return len(self.offsets)

    @property
    def total_residues(self) -> int:
        return int(self.lengths.sum(dtype=np.int64))

    def id_bytes(self, i: int) -> bytes:
        return self.id_blob[self.id_offsets[i]:self.id_offsets[i + 1]].tobytes()

    def id(self, i: int) -> str:
        return self.id_bytes(i).decode("utf-8")

    def ids(self, positions: Iterable[int] | None = None) -> list[str]:
        blob = self.id_blob.tobytes()
        offs = self.id_offsets.tolist()
        rows = range(len(self)) if positions is None else (int(p) for p in positions)
        return [blob[offs[i]:offs[i + 1]].decode("utf-8") for i in rows]

    def path_of(self, i: int) -> str:
        return self.inputs[int(self.file_no[i])].path

    def line_of(self, i: int) -> int:
        return line_number(self.path_of(i), int(self.offsets[i]))

    def given_path_of(self, i: int) -> str:
        """The file of record i as the user gave it (a .gz rather than its decompressed copy), for messages."""
        return given_path(self.path_of(i))

    def where(self, i: int) -> str:
        """'FILE:LINE' of record i, for messages."""
        return f"{self.given_path_of(i)}:{self.line_of(i)}"

    def read_record(self, i: int, start: int = 0, stop: int | None = None) -> bytes:
        """Raw bytes of record i (header line included), or bytes [start, stop) of it, with one positioned
        read (a few for a record over 1 GiB, returned as a bytearray to spare a copy)."""
        n = int(self.nbytes[i])
        stop = n if stop is None else min(stop, n)
        size, at = max(0, stop - start), int(self.offsets[i]) + start
        try:
            if size <= _ONE_READ:
                data = self._text(i).pread(size, at)
                got = len(data)
            else:   # one pread returns at most about 2 GiB
                data = bytearray(size)
                got = self._text(i).read_into(data, at)
        except FastaError:   # a BGZF file whose blocks are no longer where its table says: replaced since
            if self.inputs[int(self.file_no[i])].state == InputFile.stat(self.path_of(i)).state:
                raise
            got, data = -1, b""
        if got != size or (start == 0 and data[:1] != b">"):
            raise InputChanged(self.path_of(i), "the file changed after it was indexed: record "
                               f"{i + 1:,} is no longer at byte {int(self.offsets[i]):,}", seq_id=self.id(i))
        return data

    def _text(self, i: int):
        k = int(self.file_no[i])
        text = self._texts.get(k)
        if text is None:
            text = self._texts[k] = open_text(self.inputs[k].path, self.block_table(k))
        return text

    def block_table(self, k: int) -> np.ndarray | None:
        """The block table of input k when it is a BGZF file read in place (bgzf.py), else None."""
        if self.bgzf_spans is None or self.bgzf_spans[k] == self.bgzf_spans[k + 1]:
            return None
        return self.bgzf_blocks[self.bgzf_spans[k]:self.bgzf_spans[k + 1]]

    def sequence(self, i: int) -> str:
        """The residues the model sees (see `index.fasta_scan.sequence_text`), read piece by piece, so a
        record takes about twice its residue count in memory, whatever its size or whitespace. The bytes
        read are checked against the record's checksum (InputChanged when they differ)."""
        n = int(self.nbytes[i])
        if n <= _READ_BYTES:
            data = self.read_record(i)
            self._verify(i, checksum(data, int(self.offsets[i])))
            return sequence_text(data)
        text, in_header, total = bytearray(), True, 0
        for at in range(0, n, _READ_BYTES):
            piece = self.read_record(i, at, at + _READ_BYTES)
            total = add(total, checksum(piece, int(self.offsets[i]) + at))
            if in_header:   # a header line may be longer than one piece
                end = _line_end(piece)
                if end < 0:
                    continue
                piece, in_header = piece[end:], False
            text += piece.translate(None, _BLANKS).upper()
        self._verify(i, total)
        if text.endswith(b"*"):
            del text[-1]
        return text.decode("ascii")

    def _verify(self, i: int, found: int) -> None:
        if self.checksums is None or int(self.checksums[i]) == found:
            return   # (an index of format 1 or 2 has no checksums: runs started before them read unchecked)
        raise InputChanged(self.path_of(i), f"the file changed after it was indexed: record {i + 1:,} (at byte "
                           f"{int(self.offsets[i]):,}) no longer holds the text the index describes (an edit in "
                           "place, same length)", seq_id=self.id(i),
                           hint="No row was computed from it. Restore the file as it was when the run started, or "
                                "start a new run on the file as it is now")

    def header(self, i: int) -> str:
        """The header line of record i without the '>' (id and description), read up to its line end."""
        n, size, data = int(self.nbytes[i]), 1 << 12, b""
        while True:
            data = self.read_record(i, 0, size)
            if _line_end(data) >= 0 or size >= n:
                break
            size *= 4
        end = _line_end(data)
        return data[1:end if end >= 0 else len(data)].decode("utf-8", "replace")

    def close(self) -> None:
        for text in self._texts.values():
            text.close()
        self._texts.clear()

    def __enter__(self) -> "SequenceIndex":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_texts"] = {}
        return state

    # ----------------------------------------------------------------- sharding
    def stride_shard(self, rank: int, world: int) -> np.ndarray:
        """Input positions of worker `rank` of `world`: every world-th record of the length-descending order."""
        assert 0 <= rank < world
        return self.order[rank::world].astype(np.int64)

    def shard_stats(self, world: int) -> ShardStats:
        seqs = np.array([len(self.order[r::world]) for r in range(world)], np.int64)
        sorted_lengths = self.lengths[self.order].astype(np.int64)
        toks = np.array([int(sorted_lengths[r::world].sum()) for r in range(world)], np.int64)
        return ShardStats(seqs, toks)

    def length_percentiles(self, qs: Sequence[float] = (0, 50, 90, 99, 100)) -> dict[float, int]:
        if len(self) == 0:
            return {q: 0 for q in qs}
        return {q: int(v) for q, v in zip(qs, np.percentile(self.lengths, qs, method="nearest"))}

    # ----------------------------------------------------------------- checks
    def duplicate_ids(self) -> list[list[int]]:
        """Groups of positions sharing an id, each in input order (found once, when the index is built)."""
        groups = self.meta.get("duplicate_groups")
        return self._find_duplicate_ids() if groups is None else [list(g) for g in groups]

    def _find_duplicate_ids(self) -> list[list[int]]:
        h = id_hashes(self.id_blob, self.id_offsets)
        repeated = _repeated_values(h)
        if len(repeated) == 0:
            return []
        groups: dict[bytes, list[int]] = {}
        for i in np.flatnonzero(np.isin(h, repeated)):
            groups.setdefault(self.id_bytes(int(i)), []).append(int(i))
        return [g for g in groups.values() if len(g) > 1]

    def empty_records(self) -> np.ndarray:
        return np.flatnonzero(self.lengths == 0)

    def with_renamed_duplicates(self, groups: list[list[int]]) -> tuple["SequenceIndex", dict[int, str]]:
        """A copy whose repeated ids get a suffix ('alpha' -> 'alpha.dup2'); returns {position: original id}."""
        renamed: dict[int, str] = {}
        taken = set(self.ids())   # a new name must not be any record's id ('a', 'a', 'a.dup2' -> 'a.dup3')
        for g in groups:
            n = 1
            for i in g[1:]:
                base, n = self.id(i), n + 1
                while f"{base}.dup{n}" in taken:
                    n += 1
                taken.add(f"{base}.dup{n}")
                renamed[i] = f"{base}.dup{n}"
        parts, offs, start = [], [0], 0
        blob = self.id_blob.tobytes()
        for i in sorted(renamed):
            parts.append(blob[self.id_offsets[start]:self.id_offsets[i]])
            parts.append(renamed[i].encode())
            start = i + 1
        parts.append(blob[self.id_offsets[start]:])
        lengths = np.diff(self.id_offsets)
        for i, new in renamed.items():
            lengths[i] = len(new.encode())
        offs = np.zeros(len(self) + 1, np.int64)
        np.cumsum(lengths, out=offs[1:])
        copy = SequenceIndex(self.inputs, self.offsets, self.nbytes, self.lengths, self.file_no, offs,
                             np.frombuffer(b"".join(parts), np.uint8).copy(), self.order, self.meta,
                             **{name: getattr(self, name) for name in _OPTIONAL})
        originals = {i: self.id(i) for i in renamed}
        copy.meta["renamed_ids"] = {str(i): originals[i] for i in sorted(originals)}
        copy.meta["duplicate_groups"] = []
        return copy, originals

    # ----------------------------------------------------------------- storage
    def fingerprint(self) -> str:
        """Checksum of the index arrays and the files' contents (what the run's manifest records)."""
        crc = 0
        for name in _ARRAYS + _OPTIONAL:
            if getattr(self, name) is not None:
                crc = zlib.crc32(_raw(getattr(self, name)), crc)
        for f in self.inputs:
            if f.content_crc32 is not None:
                crc = zlib.crc32(f.content_crc32.to_bytes(4, "little"), crc)
        return f"{crc:08x}-{len(self)}"

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically (temporary name, fsync, rename)."""
        path = os.fspath(path)
        arrays = {name: np.ascontiguousarray(getattr(self, name)) for name in _ARRAYS + _OPTIONAL
                  if getattr(self, name) is not None}
        table, pos = {}, 0
        for name, arr in arrays.items():
            table[name] = [arr.dtype.str, list(arr.shape), pos, arr.nbytes]
            pos += -(-arr.nbytes // _ALIGN) * _ALIGN
        crc = 0
        for arr in arrays.values():
            crc = zlib.crc32(_raw(arr), crc)
        header = json.dumps({
            "version": FORMAT_VERSION, "count": len(self), "arrays": table, "crc32": crc, "data_bytes": pos,
            "inputs": [vars(f) for f in self.inputs], "meta": self.meta,
        }).encode()
        head = MAGIC + np.array([FORMAT_VERSION, len(header)], "<u4").tobytes() + header
        head += b"\0" * (-len(head) % _ALIGN)
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            with open(tmp, "wb") as fh:
                fh.write(head)
                for arr in arrays.values():
                    fh.write(_raw(arr))
                    fh.write(b"\0" * (-arr.nbytes % _ALIGN))
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:   # a full disk or an interruption leaves no partial file behind
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike) -> "SequenceIndex":
        """Read a saved index; IndexCorrupt if it is truncated, altered or of another format version."""
        raw = np.fromfile(os.fspath(path), np.uint8)
        if len(raw) < 16 or raw[:8].tobytes() != MAGIC:
            raise IndexCorrupt(f"{path}: not a run_shards index")
        version, hlen = (int(x) for x in raw[8:16].view("<u4"))
        if version not in READABLE_VERSIONS:
            raise IndexCorrupt(f"{path}: index format {version}, this version reads {FORMAT_VERSION}")
        try:
            header = json.loads(raw[16:16 + hlen].tobytes())
        except ValueError:
            raise IndexCorrupt(f"{path}: unreadable header") from None
        data_start = 16 + hlen + (-(16 + hlen) % _ALIGN)
        if len(raw) != data_start + header.get("data_bytes", -1):
            raise IndexCorrupt(f"{path}: truncated or padded ({len(raw)} bytes)")
        arrays, crc = {}, 0
        for name in _ARRAYS + _OPTIONAL:
            if name not in header["arrays"] and name in _OPTIONAL:
                continue
            dtype, shape, pos, nbytes = header["arrays"][name]
            start = data_start + pos
            if start + nbytes > len(raw):
                raise IndexCorrupt(f"{path}: truncated")
            arrays[name] = raw[start:start + nbytes].view(np.dtype(dtype)).reshape(shape)
            crc = zlib.crc32(_raw(arrays[name]), crc)
        if crc != header["crc32"]:
            raise IndexCorrupt(f"{path}: checksum mismatch")
        inputs = [InputFile(**f) for f in header["inputs"]]
        return cls(inputs, meta=header.get("meta", {}), **arrays)

    def edited_inputs(self, fresh: "SequenceIndex") -> list[str]:
        """Inputs whose records hold other bytes in `fresh` (the same files indexed again, with the same
        record layout) than in this index: by the records' checksums, or for an index of format 2, by its
        whole-file checksums."""
        if self.checksums is not None:
            return [f.path for k, f in enumerate(self.inputs)
                    if not np.array_equal(self.checksums[self.file_no == k], fresh.checksums[fresh.file_no == k])]
        return [f.path for f in self.inputs
                if f.content_crc32 is not None and f.content_crc32 != legacy_content_crc32(f.path)]

    def stat_changes(self) -> list[str]:
        """Inputs whose size or modification time moved since indexing, each with what moved (empty when
        every file still has the recorded size and mtime)."""
        changes = []
        for f in self.inputs:
            try:
                now = InputFile.stat(f.path)
            except OSError as e:
                changes.append(f"{f.path}: {e.strerror.lower() if e.strerror else e}")
                continue
            if now.size != f.size:
                changes.append(f"{f.path}: size changed from {f.size} to {now.size} bytes")
            elif now.mtime_ns != f.mtime_ns:
                changes.append(f"{f.path}: modified since it was indexed")
        return changes

    def records_changed(self) -> str | None:
        """What changed in the FASTA files since this index was built, or None when their records and bytes
        are the same (a file only touched, same bytes, is accepted)."""
        changes = self.stat_changes()
        if not changes:
            return None
        try:   # mtime or size moved: only the records themselves matter
            fresh = SequenceIndex.build([f.path for f in self.inputs])
        except (OSError, FastaError) as e:
            return f"{'; '.join(changes)}; it cannot be read now: {e}"
        same = (len(fresh) == len(self) and np.array_equal(fresh.offsets, self.offsets)
                and np.array_equal(fresh.lengths, self.lengths))
        edited = self.edited_inputs(fresh) if same else []
        if not same or edited:
            detail = (f"{len(self):,} records when the run started, {len(fresh):,} now" if not same else
                      f"same records and lengths, but the contents of {', '.join(edited)} differ")
            return f"{'; '.join(changes)}; {detail}"
        if self.checksums is None and any(f.content_crc32 is None for f in self.inputs):
            log.warning("input files were touched (%s); their records have the same layout, but this run's "
                        "index predates content checksums, so edits that keep every length cannot be ruled out",
                        "; ".join(changes))
        else:
            log.info("input files were touched (%s) but their contents are unchanged", "; ".join(changes))
        return None


def _raw(arr: np.ndarray) -> memoryview:
    """The bytes of an array (of any shape, empty ones included)."""
    return memoryview(np.ascontiguousarray(arr).reshape(-1)).cast("B")


def _no_tables() -> np.ndarray:
    return np.zeros((0, 2), np.int64)


def _narrowest(values: np.ndarray, dtype) -> np.ndarray:
    """`values` as `dtype` when they all fit (the common case: 4 bytes a record), else as int64."""
    fits = len(values) == 0 or int(values.max()) <= np.iinfo(dtype).max
    return values.astype(dtype if fits else np.int64)


def _line_end(data: bytes) -> int:
    """Offset of the first CR or LF in `data`, -1 if none."""
    ends = [k for k in (data.find(b"\r"), data.find(b"\n")) if k >= 0]
    return min(ends) if ends else -1


_BLANKS = bytes(range(33))   # whitespace; the scanner refused other control bytes in sequence data


def length_descending_order(lengths: np.ndarray) -> np.ndarray:
    """Positions sorted by length, longest first, ties in input order (stable, so deterministic)."""
    if len(lengths) == 0:
        return np.zeros(0, np.uint32)
    top = int(lengths.max())
    if top < 2**16:  # numpy's stable sort is a radix sort for 16-bit keys
        key = (top - lengths).astype(np.uint16)
    else:
        key = top - lengths.astype(np.int64)
    return np.argsort(key, kind="stable").astype(np.uint32)


_HASH_BASE = np.uint64(0x100000001B3)         # odd, so invertible modulo 2**64
_HASH_BASE_INV = np.uint64(pow(0x100000001B3, -1, 2**64))
_HASH_LEN = np.uint64(0x9E3779B97F4A7C15)


# Build-time work on all ids runs on this many threads (numpy releases the GIL in sorts and ufuncs): on
# 2.7M ids of the 1 GiB bench file, hashing 0.12 s and the sort 0.15 s on one thread.
_ID_THREADS = min(4, os.cpu_count() or 1)


def _repeated_values(h: np.ndarray) -> np.ndarray:
    """The values that occur more than once in h (uint64), sorted: the two halves of the value range
    sorted on their own threads (a repeat lies within one half)."""
    high = h >= np.uint64(1 << 63)
    halves = [h[~high], h[high]] if len(h) > 1 << 16 and _ID_THREADS > 1 else [h]

    def repeats(part: np.ndarray) -> np.ndarray:
        part = np.sort(part)
        return np.unique(part[1:][part[1:] == part[:-1]])

    with ThreadPoolExecutor(len(halves)) as pool:
        return np.concatenate(list(pool.map(repeats, halves)))


def id_hashes(blob: np.ndarray, offsets: np.ndarray, chunk_bytes: int = 1 << 20) -> np.ndarray:
    """A 64-bit polynomial hash per id, vectorised: equal ids give equal hashes.

    h = sum_j (byte_j + 1) * B**j (mod 2**64), computed for a whole chunk of ids at once as a prefix sum
    of (byte + 1) * B**t over the chunk, rebased to each id's start by multiplying with B**-start. The
    ids are split among _ID_THREADS threads.
    """
    n = len(offsets) - 1
    out = np.empty(n, np.uint64)
    span = min(int(offsets[-1]) if n else 0, chunk_bytes) + 1
    powers = np.full(span, _HASH_BASE, np.uint64)
    powers[0] = 1
    np.multiply.accumulate(powers, out=powers)
    inverse = np.full(span, _HASH_BASE_INV, np.uint64)
    inverse[0] = 1
    np.multiply.accumulate(inverse, out=inverse)
    parts = np.linspace(0, n, _ID_THREADS + 1).astype(np.int64) if n > 1 << 16 else np.array([0, n])
    with ThreadPoolExecutor(len(parts) - 1) as pool:
        done = list(pool.map(lambda ab: _hash_range(blob, offsets, ab[0], ab[1], chunk_bytes, powers, inverse, out),
                             zip(parts[:-1], parts[1:])))
    return out if all(done) else _slow_hashes(blob, offsets)


def _hash_range(blob, offsets, a: int, n: int, chunk_bytes: int, powers, inverse, out) -> bool:
    """id_hashes of ids a..n-1 into out; False if an id is longer than a chunk (the caller goes slow)."""
    a, n = int(a), int(n)
    while a < n:
        # as many whole ids as fit in one chunk (at least one)
        b = max(a + 1, int(np.searchsorted(offsets, offsets[a] + chunk_bytes, "right")) - 1)
        b = min(b, n)
        lo, hi = int(offsets[a]), int(offsets[b])
        if hi - lo + 1 > len(powers):  # a single id longer than the chunk
            return False
        cs = np.zeros(hi - lo + 1, np.uint64)
        np.cumsum((blob[lo:hi].astype(np.uint64) + np.uint64(1)) * powers[:hi - lo], out=cs[1:])
        starts = offsets[a:b] - lo
        out[a:b] = (cs[offsets[a + 1:b + 1] - lo] - cs[starts]) * inverse[starts] \
            + np.diff(offsets[a:b + 1]).astype(np.uint64) * _HASH_LEN
        a = b
    return True


def _slow_hashes(blob: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    data = blob.tobytes()
    return np.array([hash(data[offsets[i]:offsets[i + 1]]) for i in range(len(offsets) - 1)],
                    np.int64).view(np.uint64)
