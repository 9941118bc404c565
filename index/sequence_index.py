"""The sequence index: one row per FASTA record, in binary, versioned, checksummed storage.

Per record: byte offset (8 bytes), byte length (4), residue count (4), file number (2), id offset into the
id blob (8), its place in the length-descending order (4) and its checksum (8, record_checksum.py): 38 bytes
plus the id itself. Byte length and residue count widen to 8 bytes when some record needs it (over 4 GiB,
over 2**31 - 1 residues). The record's description is its header line, read back with positioned reads
(`header`). Offsets are in the text: for a BGZF input (read in place), the index also keeps its block table,
and a histogram of the lengths (totals, percentiles and shard statistics without reading every length).

The index is built on disk with bounded memory (build.py) and read memory-mapped (index_file.py): a reader
touches only the pages of the rows it reads. A run's copy also holds the stride table its workers read
(stride.py, shard_view.py).

Every sequence read through `sequence` is checked against its record's checksum, so no result is computed
from text other than the index describes (InputChanged otherwise).
"""
from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import zlib
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from . import build as index_build, index_file, input_file, stride as stride_table
from .compressed import given_path
from .errors import FastaError, InputChanged
from .fasta_scan import legacy_content_crc32, sequence_text
from .id_hash import _repeated_values, id_hashes
from .index_file import IndexCorrupt
from .input_file import InputFile
from . import record_checksum
from .record_checksum import add, checksum
from .source import line_number, open_text

log = logging.getLogger(__name__)

# 2: records split at lone CRs, ids end at control bytes, 64-bit lengths when needed.
# 3: a checksum per record (instead of one per file); BGZF inputs read in place, with their block tables.
# 4: built and read with bounded memory (build.py, index_file.py): memory-mapped, a histogram of the lengths,
#    and in a run's copy the stride table of its shards (stride.py).
# 5: the records' checksums of record_checksum.KIND 2 (with each word's high half), said in meta's
#    `checksum_kind`; an index of version 3 or 4 holds KIND 1 checksums and is checked with them.
# Versions 1 and 2 hold the same required arrays, so a run directory's index of any version loads (its
# sequences are then read unchecked); caches of older versions are rebuilt (their file names differ).
FORMAT_VERSION = index_build.FORMAT_VERSION
READABLE_VERSIONS = (1, 2, 3, 4, 5)
_READ_BYTES = 16 << 20   # sequence(): a record is read and cleaned piece by piece
HELD_TEXTS = 256         # input files kept open between reads (more: opened per read, see _reading)
_ONE_READ = 1 << 30      # read_record(): larger reads go into a bytearray, a pread at a time
MAGIC = index_file.MAGIC
_ARRAYS = ("offsets", "nbytes", "lengths", "file_no", "id_offsets", "id_blob", "order")
# The arrays every index version holds, alike for the same records (a run directory's index by an earlier
# run_shards is matched on them: planning/continued.py).
RECORD_ARRAYS = _ARRAYS
# From version 3: checksums uint64 [N]; bgzf_blocks int64 [M, 2], the block tables of the BGZF inputs one
# after another; bgzf_spans int64 [F + 1], where each input's table starts in it (empty for a plain file).
# From version 4: length_values int64 [D] (the distinct lengths, longest first) and length_counts int64 [D].
_OPTIONAL = ("checksums", "bgzf_blocks", "bgzf_spans", "length_values", "length_counts")


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
                 bgzf_blocks: np.ndarray | None = None, bgzf_spans: np.ndarray | None = None,
                 length_values: np.ndarray | None = None, length_counts: np.ndarray | None = None):
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
        if length_values is None:
            values, counts = np.unique(np.asarray(lengths, np.int64), return_counts=True)
            length_values, length_counts = values[::-1].copy(), counts[::-1].astype(np.int64)
        self.length_values, self.length_counts = length_values, length_counts
        self._texts: dict = {}
        self._mapped: index_file.Mapped | None = None   # the file this index's arrays are views of
        self._crc: int | None = None                     # the header's checksum of those arrays
        self._loaded: dict = {}                          # the arrays as mapped (a replaced one is not the file's)
        self.stride: dict | None = None                  # a run's stride table (stride.py), when it has one

    # ----------------------------------------------------------------- building
    @classmethod
    def build(cls, paths: Iterable[str | os.PathLike], threads: int | None = None,
              target: str | os.PathLike | None = None) -> "SequenceIndex":
        """Scan the files (in the given order) and check ids; FastaError on malformed input. The index is
        built on disk with bounded memory (build.py) into `target` (default: a temporary file, removed
        once mapped) and returned memory-mapped."""
        if target is not None:
            index_build.build_file(paths, target, threads)
            return cls.load(target, verify=False)
        fd, tmp = tempfile.mkstemp(prefix="run_shards-index-", suffix=".rsidx")
        os.close(fd)
        try:
            index_build.build_file(paths, tmp, threads)
            return cls.load(tmp, verify=False)
        finally:
            os.unlink(tmp)

    # ----------------------------------------------------------------- access
    def __len__(self) -> int:
        return len(self.offsets)

    @property
    def total_residues(self) -> int:
        return int((self.length_values.astype(np.int64) * self.length_counts).sum())

    @property
    def max_length(self) -> int:
        return int(self.length_values[0]) if len(self.length_values) else 0

    def release(self) -> None:
        """Drop this process's copies of the index pages read so far (after a pass over whole arrays)."""
        if self._mapped is not None:
            self._mapped.release()

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
            with self._reading(i) as text:
                if size <= _ONE_READ:
                    data = text.pread(size, at)
                    got = len(data)
                else:   # one pread returns at most about 2 GiB
                    data = bytearray(size)
                    got = text.read_into(data, at)
        except FastaError:   # a BGZF file whose blocks are no longer where its table says: replaced since
            if self.inputs[int(self.file_no[i])].unchanged(InputFile.stat(self.path_of(i))):
                raise
            got, data = -1, b""
        if got != size or (start == 0 and data[:1] != b">"):
            raise InputChanged(self.path_of(i), "the file changed after it was indexed: record "
                               f"{i + 1:,} is no longer at byte {int(self.offsets[i]):,}", seq_id=self.id(i))
        return data

    @contextlib.contextmanager
    def _reading(self, i: int):
        """The text of record i's file, to read from within the block. Up to HELD_TEXTS input files each stay
        open for later reads; with more, each read opens its file and closes it after: every file held open
        for the life of the index stopped a run of 3,000 FASTA files (one per protein, a common download) at
        `ulimit -n` 1,024 with 'too many open files', past what a user may raise. (Not a least-recently-used
        set of open files: the token counter reads on a thread of its own, and closing a file another read is
        using would let its descriptor's number name another file.)"""
        k = int(self.file_no[i])
        if len(self.inputs) > HELD_TEXTS:
            text = open_text(self.inputs[k].path, self.block_table(k))
            try:
                yield text
            finally:
                text.close()
            return
        text = self._texts.get(k)
        if text is None:
            text = self._texts[k] = open_text(self.inputs[k].path, self.block_table(k))
        yield text

    def block_table(self, k: int) -> np.ndarray | None:
        """The block table of input k when it is a BGZF file read in place (bgzf.py), else None."""
        if self.bgzf_spans is None or self.bgzf_spans[k] == self.bgzf_spans[k + 1]:
            return None
        return self.bgzf_blocks[self.bgzf_spans[k]:self.bgzf_spans[k + 1]]

    def sequence(self, i: int, keep_case: bool = False) -> str:
        """The residues the model sees (see `index.fasta_scan.sequence_text`; with `keep_case` not upper-cased),
        read piece by piece, so a record takes about twice its residue count in memory, whatever its size or
        whitespace. The bytes read are checked against the record's checksum (InputChanged when they differ)."""
        n = int(self.nbytes[i])
        if n <= _READ_BYTES:
            data = self.read_record(i)
            self._verify(i, checksum(data, int(self.offsets[i]), self.checksum_kind))
            return sequence_text(data, keep_case)
        text, in_header, total = bytearray(), True, 0
        for at in range(0, n, _READ_BYTES):
            piece = self.read_record(i, at, at + _READ_BYTES)
            total = add(total, checksum(piece, int(self.offsets[i]) + at, self.checksum_kind))
            if in_header:   # a header line may be longer than one piece
                end = _line_end(piece)
                if end < 0:
                    continue
                piece, in_header = piece[end:], False
            piece = piece.translate(None, _BLANKS)
            text += piece if keep_case else piece.upper()
        self._verify(i, total)
        if text.endswith(b"*"):
            del text[-1]
        return text.decode("ascii")

    @property
    def checksum_kind(self) -> int:
        """The kind of its records' checksums (record_checksum.KINDS): an index keeps the kind it was built with."""
        return int(self.meta.get("checksum_kind", record_checksum.KIND))

    def _verify(self, i: int, found: int) -> None:
        if self.checksums is None or int(self.checksums[i]) == found:
            return   # (an index of format 1 or 2 has no checksums: runs started before them read unchecked)
        if not self._stat_unchanged(int(self.file_no[i])):
            hint = ("No row was computed from it. Restore the file as it was when the run started, or start a new "
                    "run on the file as it is now")
        else:   # an edit that kept every time stat shows (coarse times): its cached index looks current
            hint = ("No row was computed from it. Restore the file as it was when it was indexed; or, to use it as "
                    "it is now, index it anew with `run_shards index --rebuild FILE` (its size and times are "
                    "as they were, so its cached index looks current) and start a new run on it (in "
                    "another --out where a run was planned on the old text)")
        raise InputChanged(self.path_of(i), f"the file changed after it was indexed: record {i + 1:,} (at byte "
                           f"{int(self.offsets[i]):,}) no longer holds the text the index describes (an edit in "
                           "place, same length)", seq_id=self.id(i), hint=hint)

    def _stat_unchanged(self, k: int) -> bool:
        """Whether input k still shows the size, times and inode it was indexed with (input_file.py)."""
        try:
            return self.inputs[k].unchanged(InputFile.stat(self.inputs[k].path))
        except OSError:
            return False

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
        mapped = state.pop("_mapped", None)
        if mapped is not None and os.path.exists(mapped.path):
            state["_mapped_path"] = mapped.path   # mapped again on the other side
            for name in _ARRAYS + _OPTIONAL:
                if mapped.header["arrays"].get(name) is not None and getattr(self, name) is not None:
                    state[name] = None
        else:
            for name in _ARRAYS + _OPTIONAL:
                if state.get(name) is not None:
                    state[name] = np.array(state[name])
        return state

    def __setstate__(self, state):
        path = state.pop("_mapped_path", None)
        self.__dict__.update(state)
        self._mapped = None
        if path is not None:
            other = SequenceIndex.load(path, verify=False)
            for name in _ARRAYS + _OPTIONAL:
                if getattr(self, name, None) is None:
                    setattr(self, name, getattr(other, name))
            self._mapped = other._mapped

    # ----------------------------------------------------------------- sharding
    def stride_shard(self, rank: int, world: int) -> np.ndarray:
        """Input positions of worker `rank` of `world`: every world-th record of the length-descending order
        (a contiguous slice of the run's stride table when the index has one for `world`)."""
        assert 0 <= rank < world
        if self.stride is not None and self.stride["world"] == world:
            starts = self.stride["starts"]
            positions = np.array(self.stride["positions"][int(starts[rank]):int(starts[rank + 1])], np.int64)
            self.stride["mapped"].release()   # (going through every shard would otherwise keep every page read)
            return positions
        return self.order[rank::world].astype(np.int64)

    def shard_stats(self, world: int) -> ShardStats:
        """Sequences and residues per shard: as the run's stride table for `world` says (exact, also for a
        run that copies some records instead of computing them), else from the length histogram alone: the
        sorted lengths are runs of equal values, and a run of c records from sorted rank a gives each shard
        its share of c."""
        if self.stride is not None and self.stride["world"] == world and self.stride.get("tokens") is not None:
            return ShardStats(np.diff(np.asarray(self.stride["starts"], np.int64)),
                              np.asarray(self.stride["tokens"], np.int64))
        seqs = np.full(world, len(self) // world, np.int64)
        seqs[:len(self) % world] += 1
        toks = np.zeros(world + 1, np.int64)   # a difference array over the shards, plus whole cycles
        whole = 0
        a = 0
        for value, count in zip(self.length_values.tolist(), self.length_counts.tolist()):
            cycles, rest = divmod(count, world)
            whole += value * cycles
            first = a % world     # shards first .. first+rest-1 (mod world) get one more record of this run
            if rest:
                end = first + rest
                toks[first] += value
                if end <= world:
                    toks[end] -= value
                else:
                    toks[world] -= value
                    toks[0] += value
                    toks[end - world] -= value
            a += count
        return ShardStats(seqs, np.cumsum(toks[:world]) + whole)

    def adopt_stride(self, path: str | os.PathLike) -> None:
        """Take the stride table of `path`, a run's copy of this very index (`save(path, world)`), so that
        `stride_shard` reads each shard's positions from it instead of striding through the whole order."""
        mapped = index_file.Mapped(path, READABLE_VERSIONS)
        if "stride" not in mapped.header or int(mapped.header["count"]) != len(self):
            mapped.close()
            raise IndexCorrupt(f"{path}: no stride table for these {len(self):,} records")
        self.stride = stride_table.table(mapped)

    def length_percentiles(self, qs: Sequence[float] = (0, 50, 90, 99, 100)) -> dict[float, int]:
        """As numpy's percentile with method 'nearest', from the length histogram."""
        if len(self) == 0:
            return {q: 0 for q in qs}
        values, counts = self.length_values[::-1], self.length_counts[::-1]
        ends = np.cumsum(counts)
        ranks = np.around(np.asarray(qs, float) / 100 * (len(self) - 1)).astype(np.int64)
        return {q: int(values[np.searchsorted(ends, r, "right")]) for q, r in zip(qs, ranks)}

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
        if not len(self.length_values) or int(self.length_values[-1]) != 0:
            return np.zeros(0, np.int64)
        return self.positions_where(lambda lengths: lengths == 0)

    def positions_where(self, test, chunk: int = 1 << 22) -> np.ndarray:
        """Positions whose length passes `test` (a vectorised predicate), read a chunk at a time."""
        found = []
        for a in range(0, len(self), chunk):
            found.append(np.flatnonzero(test(np.asarray(self.lengths[a:a + chunk]))) + a)
            self.release()
        return np.concatenate(found) if found else np.zeros(0, np.int64)

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
        copy._mapped = self._mapped   # the arrays it shares stay mapped
        originals = {i: self.id(i) for i in renamed}
        copy.meta["renamed_ids"] = {str(i): originals[i] for i in sorted(originals)}
        copy.meta["duplicate_groups"] = []
        return copy, originals

    # ----------------------------------------------------------------- storage
    def _parts(self) -> list[index_file.Part]:
        """The arrays to store, in file order: a mapped one read from its file, the others from memory."""
        parts = []
        for name in _ARRAYS + _OPTIONAL:
            arr = getattr(self, name)
            if arr is None:
                continue
            mine = self._mapped is not None and self._crc is not None and self._mapped.header["arrays"].get(name) \
                and arr is self._loaded.get(name)
            if mine:
                parts.append(index_file.Part(name, arr.dtype, tuple(arr.shape),
                                             lambda name=name: self._mapped.chunks(name)))
            else:
                parts.append(index_file.in_memory(name, arr))
        return parts

    def fingerprint(self) -> str:
        """Checksum of the index arrays and the files' contents (what the run's manifest records)."""
        if self._crc is not None and all(getattr(self, n) is self._loaded.get(n) for n in _ARRAYS + _OPTIONAL):
            crc = self._crc
        else:
            crc = 0
            for part in self._parts():
                for chunk in part.chunks():
                    crc = zlib.crc32(chunk, crc)
            self.release()
        for f in self.inputs:
            if f.content_crc32 is not None:
                crc = zlib.crc32(f.content_crc32.to_bytes(4, "little"), crc)
        return f"{crc:08x}-{len(self)}"

    def save(self, path: str | os.PathLike, world: int | None = None, only: stride_table.Only | None = None) -> None:
        """Write atomically (temporary name, fsync, rename), with bounded memory. With `world`, also the
        stride table of a run of that many shards (stride.py), which its workers read: of every record, or
        of the records `only` keeps (those a run computes, the others being copied)."""
        header = {**input_file.to_header(self.inputs), "meta": self.meta}
        table = contextlib.nullcontext([]) if world is None else \
            stride_table.parts(self, world, os.path.dirname(os.path.abspath(os.fspath(path))), only)
        with table as extra:
            if world is not None:
                header["stride"] = {"world": world}
            index_file.write(path, FORMAT_VERSION, len(self), self._parts() + extra, header)

    @classmethod
    def load(cls, path: str | os.PathLike, verify: bool = True) -> "SequenceIndex":
        """A saved index, memory-mapped. With `verify`, its checksum is checked first (reading the file, not
        the mapping): IndexCorrupt if it is truncated, altered or of another format version."""
        mapped = index_file.Mapped(path, READABLE_VERSIONS)
        names = [n for n in _ARRAYS + _OPTIONAL if n in mapped.header["arrays"]]
        missing = [n for n in _ARRAYS if n not in names]
        if missing:
            raise IndexCorrupt(f"{path}: no {', '.join(missing)}")
        if verify:
            mapped.verify(names, mapped.header["crc32"])
            stride_names = [n for n in mapped.header["arrays"] if n.startswith("stride_")]
            if stride_names:
                mapped.verify(stride_names, mapped.header["stride"]["crc32"], "checksum mismatch in the stride table")
        arrays = {n: mapped.array(n) for n in names}
        inputs = input_file.from_header(mapped.header)
        meta = mapped.header.get("meta", {})
        if mapped.version < 5:
            meta = {**meta, "checksum_kind": 1}
        index = cls(inputs, meta=meta, **arrays)
        index._mapped, index._crc, index._loaded = mapped, int(mapped.header["crc32"]), dict(arrays)
        if "stride" in mapped.header:
            index.stride = stride_table.table(mapped)
        return index

    def edited_inputs(self, fresh: "SequenceIndex") -> list[str]:
        """Inputs whose records hold other bytes in `fresh` (the same files indexed again, with the same
        record layout) than in this index: by the records' checksums, or for an index of format 2, by its
        whole-file checksums."""
        if self.checksums is not None and fresh.checksums is not None and self.checksum_kind != fresh.checksum_kind:
            return self._edited_by_reading()
        if self.checksums is not None:
            return [f.path for k, f in enumerate(self.inputs)
                    if not np.array_equal(self.checksums[self.file_no == k], fresh.checksums[fresh.file_no == k])]
        return [f.path for f in self.inputs
                if f.content_crc32 is not None and f.content_crc32 != legacy_content_crc32(f.path)]

    def _edited_by_reading(self) -> list[str]:
        """The input whose text no longer matches this index's checksums, read block by block with their kind
        (an index built by an earlier run_shards, whose checksums a fresh index's cannot be compared with)."""
        from .residue_digest import record_digests
        try:
            for _ in record_digests(self):
                pass
        except InputChanged as e:
            return [e.path]
        return []

    def stat_changes(self) -> list[str]:
        """Inputs whose size, modification time, change time or inode moved since indexing, each with what moved
        (empty when every file still has what was recorded: input_file.py)."""
        changes = []
        for f in self.inputs:
            try:
                now = InputFile.stat(f.path)
            except OSError as e:
                changes.append(f"{f.path}: {e.strerror.lower() if e.strerror else e}")
                continue
            change = f.change(now)
            if change:
                changes.append(f"{f.path}: {change}")
        return changes

    def records_changed_in(self, fresh: "SequenceIndex", changes: list[str]) -> str | None:
        """What changed in the FASTA files since this index was built, judged on `fresh` (the same files indexed
        now, their `stat_changes` being `changes`), or None when their records and bytes are the same (a file
        only touched, same bytes, is accepted): cache.records_changed."""
        same = (len(fresh) == len(self) and np.array_equal(fresh.offsets, self.offsets)
                and np.array_equal(fresh.lengths, self.lengths))
        edited = self.edited_inputs(fresh) if same else []
        if not same or edited:
            detail = (f"{len(self):,} records when the run started, {len(fresh):,} now" if not same else
                      f"same records and lengths, but the contents of {some(edited, ', ')} differ")
            return f"{some(changes)}; {detail}"
        # The same text compressed again (bgzip of another block size, a recompression): this index reads its
        # records through the old blocks, at offsets the file no longer has.
        moved = [f.path for k, f in enumerate(self.inputs)
                 if not _same_table(self.block_table(k), fresh.block_table(k))]
        if moved:
            return (f"{some(changes)}; the same text, but {some(moved, ', ')} was compressed again: its BGZF blocks, "
                    "through which this run reads its records, moved")
        if self.checksums is None and any(f.content_crc32 is None for f in self.inputs):
            log.warning("input files were touched (%s); their records have the same layout, but this run's "
                        "index predates content checksums, so edits that keep every length cannot be ruled out",
                        some(changes))
        else:
            log.info("input files were touched (%s) but their contents are unchanged", some(changes))
        return None


def _same_table(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    return (a is None) == (b is None) and (a is None or np.array_equal(a, b))


def some(items: list[str], sep: str = "; ", shown: int = 5) -> str:
    """`items` joined, or the first few and how many more: 3,000 input files moved made a 200 KB message."""
    if len(items) <= shown + 1:
        return sep.join(items)
    return f"{sep.join(items[:shown])}{sep}and {len(items) - shown:,} more"


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


