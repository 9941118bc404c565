"""A run's stride table: every shard's records side by side, so that a worker (or array task) reads its
own rows with a few contiguous reads and never the whole index.

Shard r of W holds the records at ranks r, r + W, r + 2W, ... of the length order (longest first), ranked
among the records the run computes (all of them, or those its copy plan does not copy). The table stores
them shard after shard (`stride_starts` [W + 1] says where each begins, `stride_tokens` [W] each shard's
residues), each record with its position, byte offset, byte length, residue count, file number, checksum
and id. It is written into the
run's copy of the index when the run is planned (`SequenceIndex.save(path, world)`) by two scatters on
disk (spill.py), so planning keeps bounded memory; a worker maps the file and reads its slices
(`open_stride`): about 40 bytes plus the id per row of its own, whatever the size of the index.
"""
from __future__ import annotations

import contextlib
import shutil
import tempfile
from typing import Callable, Iterator

import numpy as np

from . import index_file
from .build import Column
from .spill import Scatter, ragged_arange

FIELDS = ("offsets", "nbytes", "lengths", "file_no", "checksums")
_WINDOW_BYTES = 64 << 20
_FIXED_ID = 64   # ids up to this many bytes travel in the records themselves
_STEP = 1 << 19  # records handled at once on their way into the scatter


def shard_sizes(n: int, world: int) -> np.ndarray:
    sizes = np.full(world, n // world, np.int64)
    sizes[:n % world] += 1
    return sizes


class Only:
    """The records a run computes, when it is not all of them (the others are copies: a run's copy plan,
    pipeline/output/copy_plan.py): `count` of them, and which of some positions they are."""

    def __init__(self, count: int, kept: Callable[[np.ndarray], np.ndarray]):
        self.count, self.kept = count, kept


@contextlib.contextmanager
def parts(index, world: int, directory: str, only: Only | None = None) -> Iterator[list[index_file.Part]]:
    """The stride table of `index` for `world` shards, as parts of an index file (valid inside the block).
    With `only`, the table holds those records alone, strided in the same length order."""
    root = tempfile.mkdtemp(prefix=".rs-stride-", dir=directory)
    try:
        yield _build(index, world, root, only)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _chunks(index, name: str, step: int) -> Iterator[np.ndarray]:
    """An array of the index a window at a time (pages of a mapped one released after each)."""
    arr = getattr(index, name)
    for a in range(0, len(arr), step):
        yield np.array(arr[a:a + step])
        index.release()


def _build(index, world: int, root: str, only: Only | None) -> list[index_file.Part]:
    n = len(index)
    kept_count = n if only is None else only.count
    starts = np.zeros(world + 1, np.int64)
    np.cumsum(shard_sizes(kept_count, world), out=starts[1:])
    # 1. where each position goes: rank k (order[k] = p) goes to starts[k % W] + k // W (ranks counted among
    #    the records kept; the others go nowhere: -1)
    where = Scatter(n, np.int64, root, window=_WINDOW_BYTES // 16)
    k = 0
    for chunk in _chunks(index, "order", where.window):
        chunk = chunk.astype(np.int64)
        slots = np.full(len(chunk), -1, np.int64)
        kept = np.ones(len(chunk), bool) if only is None else only.kept(chunk)
        ranks = np.arange(k, k + int(kept.sum()), dtype=np.int64)
        slots[kept] = starts[ranks % world] + ranks // world
        where.add(chunk, slots)
        k += len(ranks)
    if k != kept_count:
        raise AssertionError(f"stride table: {k} records kept, {kept_count} expected")
    # 2. every record to its place, with its id (a fixed-width field up to _FIXED_ID bytes, else a blob)
    width = max((int(np.diff(c).max(initial=0)) for c in _chunks(index, "id_offsets", 1 << 22)), default=0)
    fixed = width <= _FIXED_ID
    fields = [("position", "<i8")] + [(f, getattr(index, f).dtype) for f in FIELDS if getattr(index, f) is not None]
    fields += [("id_len", "<i4")] + ([("id", f"V{max(1, width)}")] if fixed else [])
    record = np.dtype(fields)
    place = Scatter(kept_count, record, root, window=max(1, _WINDOW_BYTES // (record.itemsize + 40)), blob=not fixed)
    for start, dests, _, _ in where.chunks():
        for a in range(0, len(dests), _STEP):   # a few MiB of records at a time
            _place(index, place, record, fixed, width, start + a, dests[a:a + _STEP])
    # 3. the table, in shard order
    names = [f for f in record.names if f not in ("id_len", "id")]
    cols = {f: Column(root, f"stride_{f}", record[f]) for f in names}
    id_offsets, id_blob = Column(root, "stride_id_offsets", np.int64), Column(root, "stride_id_blob", np.uint8)
    id_offsets.append(np.zeros(1, np.int64))
    end = 0
    tokens = np.zeros(world, np.int64)   # residues per shard (SequenceIndex.shard_stats reads them)
    for lo, rec, blob, offsets in place.chunks():
        shard = np.searchsorted(starts, np.arange(lo, lo + len(rec)), "right") - 1
        tokens += np.bincount(shard, weights=rec["lengths"], minlength=world).astype(np.int64)
        for f in names:
            cols[f].append(rec[f])
        if fixed:
            lens = rec["id_len"].astype(np.int64)
            padded = np.ascontiguousarray(rec["id"]).view(np.uint8).reshape(len(rec), max(1, width))   # (0 rows too)
            blob = padded[np.arange(max(1, width)) < lens[:, None]]
            offsets = np.concatenate(([0], np.cumsum(lens)))
        id_offsets.append(offsets[1:] + end)
        id_blob.append(blob)
        end += int(offsets[-1])
    out = [index_file.in_memory("stride_starts", starts, stride=True),
           index_file.in_memory("stride_tokens", tokens, stride=True)]
    for f in names:
        name = "stride_positions" if f == "position" else f"stride_{f}"
        out.append(_stride(cols[f].part(name)))
    return out + [_stride(id_offsets.part("stride_id_offsets")), _stride(id_blob.part("stride_id_blob"))]


def _place(index, place: Scatter, record: np.dtype, fixed: bool, width: int, lo: int, dest: np.ndarray) -> None:
    """Records lo .. lo + len(dest) - 1 (input order) with their ids, to their places in the table."""
    hi = lo + len(dest)
    rec = np.empty(len(dest), record)
    rec["position"] = np.arange(lo, hi)
    for f in record.names[1:-2 if fixed else -1]:
        rec[f] = getattr(index, f)[lo:hi]
    ids = np.array(index.id_offsets[lo:hi + 1], np.int64)
    blob = np.array(index.id_blob[int(ids[0]):int(ids[-1])])
    lens = np.diff(ids)
    rec["id_len"] = lens
    kept = np.flatnonzero(dest >= 0)   # (records left out of the table have no place)
    if fixed:
        rec["id"] = _padded(blob, lens, width).view(record["id"]).reshape(-1)
        place.add(dest[kept], rec[kept])
    else:
        offsets = ids - ids[0]
        if len(kept) < len(dest):
            blob, offsets = blob[ragged_arange(offsets[kept], lens[kept])], np.concatenate(([0], np.cumsum(lens[kept])))
        place.add(dest[kept], rec[kept], blob, offsets)
    index.release()


def _padded(blob: np.ndarray, lens: np.ndarray, width: int) -> np.ndarray:
    """Ids back to back as a [len(lens), width] matrix of bytes, each padded with zeros (a column at a
    time: ids are short, records many)."""
    out = np.zeros((len(lens), max(1, width)), np.uint8)
    starts = np.cumsum(lens) - lens
    last = max(0, len(blob) - 1)
    for j in range(width):
        has = lens > j
        out[:, j] = np.where(has, blob[np.minimum(starts + j, last)] if len(blob) else 0, 0)
    return out


def _stride(part: index_file.Part) -> index_file.Part:
    part.stride = True
    return part


def table(mapped: index_file.Mapped) -> dict:
    """The stride table of a mapped run index: its world and shard starts (and residues per shard, in a
    table written since they were kept), and views of its arrays."""
    return {"world": int(mapped.header["stride"]["world"]), "starts": mapped.array("stride_starts"),
            "tokens": mapped.array("stride_tokens"), "positions": mapped.array("stride_positions"), "mapped": mapped}

