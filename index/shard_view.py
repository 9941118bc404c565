"""What a worker (or array task) reads of a run's index: its own shard's rows of the stride table
(stride.py), a few contiguous reads, as a SequenceIndex of those records."""
from __future__ import annotations

import os

import numpy as np

from . import index_file
from .input_file import from_header
from .sequence_index import READABLE_VERSIONS, SequenceIndex
from .stride import FIELDS


class _ByPosition:
    """Values of a shard's records looked up by FASTA position, as `index.lengths[positions]` is."""

    def __init__(self, keys: np.ndarray, values: np.ndarray):
        self.keys, self.values = keys, values

    @property
    def dtype(self) -> np.dtype:
        return self.values.dtype

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, positions):
        j = np.searchsorted(self.keys, positions)
        jj = np.minimum(j, len(self.keys) - 1)
        if len(self.keys) == 0 or np.any(self.keys[jj] != positions):
            raise IndexError("position is not one of this shard's records")
        return self.values[jj]


def open_stride(path: str | os.PathLike, rank: int, world: int):
    """Shard `rank` of `world` of the run index at `path`, reading only that shard's rows (and the small
    arrays: inputs, BGZF block tables, length histogram). A SequenceIndex for those records: `positions`
    in the order the shard computes them (longest first), lengths, ids and sequences by FASTA position.
    An index saved without a stride table for `world` (a run planned by an older version) is mapped whole."""
    mapped = index_file.Mapped(path, READABLE_VERSIONS)
    if mapped.header.get("stride", {}).get("world") != world:
        mapped.close()
        index = SequenceIndex.load(path, verify=False)
        index.positions = index.stride_shard(rank, world)
        return index
    starts = mapped.read("stride_starts", 0, world + 1)
    a, b = int(starts[rank]), int(starts[rank + 1])
    positions = mapped.read("stride_positions", a, b)
    by = np.argsort(positions, kind="stable")
    keys = positions[by]
    index = SequenceIndex.__new__(SequenceIndex)
    small = {n: mapped.array(n) for n in ("bgzf_blocks", "bgzf_spans", "length_values", "length_counts")}
    index.__dict__.update(inputs=from_header(mapped.header), meta=mapped.header.get("meta", {}),
                          order=None, id_offsets=None, id_blob=None, _texts={}, _mapped=mapped, _crc=None, _loaded={},
                          stride=None, positions=positions, _count=int(mapped.header["count"]), **small)
    for f in FIELDS:
        name = f"stride_{f}"
        values = mapped.read(name, a, b) if name in mapped.header["arrays"] else None
        setattr(index, f, None if values is None else _ByPosition(keys, values[by]))
    id_offsets = mapped.read("stride_id_offsets", a, b + 1)
    blob = mapped.read("stride_id_blob", int(id_offsets[0]), int(id_offsets[-1])).tobytes()
    local = (id_offsets - id_offsets[0]).tolist()
    index._stride_ids = (keys, by, blob, local)
    index.__class__ = StrideIndex
    return index


class StrideIndex(SequenceIndex):
    """One shard's records of a run index (`open_stride`); positions outside the shard raise IndexError."""

    def __len__(self) -> int:
        return self._count

    def id_bytes(self, i: int) -> bytes:
        keys, by, blob, local = self._stride_ids
        j = int(np.searchsorted(keys, i))
        if j >= len(keys) or keys[j] != i:
            raise IndexError(f"position {i} is not one of this shard's records")
        k = int(by[j])
        return blob[local[k]:local[k + 1]]

    def stride_shard(self, rank: int, world: int) -> np.ndarray:
        return np.array(self.positions, np.int64)

    def close(self) -> None:
        """Close the input files read so far and the index file itself: a worker computes several shards in one
        process (each opens its own view), and a file left open per shard ran it out of descriptors."""
        super().close()
        self._mapped.close()
