"""Which rows of a run are copied instead of computed, fixed when the run is planned: OUT/copies.rsidx.

A record whose sequence (its digest, sequence_digest.py) occurred earlier in the FASTA is copied from the
first record of that sequence; a first record whose sequence an earlier result (`--reuse`) holds, with
the same model and settings, is copied from that result's row; only the others go to the shards. The
file has the index's format (index/index_file.py, read memory-mapped), with per FASTA position p:

    digests            V16 [N]    p's sequence digest, which the merge checks every row of the result against
    source             int16 [N]  COMPUTED (-1): in a shard; DUPLICATE (-2): copied from an earlier record;
                                  k >= 0: reused from the k-th result of `sources`
    ref                int64 [N]  DUPLICATE: the position of the first record of the sequence; reused: the
                                  row in that result; else -1

and the copies in the order the merge makes them:

    duplicates_first   int64 [D]  the first record q of a sequence, ascending, ...
    duplicates_copy    int64 [D]  ... and each later record p of it (ascending within q)
    reused_K_row       int64 [R]  rows of the K-th result, ascending, ...
    reused_K_position  int64 [R]  ... and the position each is copied to

The header lists the `sources` (each reused result's path and identity) and the `counts`.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import numpy as np

from index import index_file

from ..advice import command
from ..config import RunConfig
from ..errors import UserError
from ..rundir.layout import RunDir, free_out
from .h5io import CorruptFile, Reader

VERSION = 1
COMPUTED, DUPLICATE = -1, -2


@dataclass
class SourceFile:
    """A result rows are reused from, as it was when the run was planned."""
    path: str          # the result.h5
    given: str         # as --reuse named it
    rows: int
    checksums: str     # its `crc32` attribute: the checksum of every dataset, as written
    size: int
    mtime_ns: int

    def problem(self) -> str | None:
        """Why the rows planned cannot be taken from the file now (gone, damaged, another file in its place),
        or None. A file of the size and modification time recorded is the one planned; one written again
        since (`run_shards merge` of the same shards, a copy put back) is judged by its content: the rows and
        dataset checksums as planned (the merge reads it whole and verifies them)."""
        try:
            st = os.stat(self.path)
        except OSError as e:
            return f"{self.path}: {e.strerror or e}"
        if (st.st_size, st.st_mtime_ns) == (self.size, self.mtime_ns):
            return None
        try:
            with Reader(self.path, cache_bytes=0) as reader:
                rows, same = reader.rows, (reader.rows, str(reader.attrs.get("crc32"))) == (self.rows, self.checksums)
        except CorruptFile as e:
            return f"{self.path} is damaged ({e})"
        return None if same else (f"{self.path} is not the result this run was planned with (other rows or checksums: "
                                  f"{rows:,} rows now, {self.rows:,} then)")


class CopyPlan:
    """A run's copies.rsidx, memory-mapped (see the module's docstring). `verify`: read the whole file for its
    checksum first (IndexCorrupt where a byte changed: a digest altered would make the merge refuse rows that
    are right, a source or ref altered copy the wrong row)."""

    def __init__(self, path: str | os.PathLike, verify: bool = False):
        self.mapped = index_file.Mapped(path, (VERSION,))
        header = self.mapped.header
        if verify:
            try:
                self.mapped.verify(list(header["arrays"]), header["crc32"])
            except BaseException:
                self.mapped.close()
                raise
        self.n = int(header["count"])
        self.sources = [SourceFile(**s) for s in header["sources"]]
        self.counts = header["counts"]
        self.digests = self.mapped.array("digests")
        self.source = self.mapped.array("source")
        self.ref = self.mapped.array("ref")

    def pairs(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(duplicates_first, duplicates_copy) for "duplicates", (reused_K_row, reused_K_position) for
        "reused_K"."""
        keys = ("first", "copy") if name == "duplicates" else ("row", "position")
        return self.mapped.array(f"{name}_{keys[0]}"), self.mapped.array(f"{name}_{keys[1]}")

    def digest_bytes(self, a: int, b: int) -> np.ndarray:
        """[b - a, 16] uint8: the digests of positions a .. b - 1."""
        return np.asarray(self.digests[a:b]).view(np.uint8).reshape(-1, 16)

    def release(self) -> None:
        self.mapped.release()

    def close(self) -> None:
        self.mapped.close()


def check_sources(run: RunDir, manifest: dict, plan: CopyPlan) -> None:
    """Refuse (UserError) when a result whose rows the run copies cannot give them now: before any shard is
    computed (a rerun of a run planned with --reuse) and before the merge. The message names each file, and
    both ways out with a command that works; the shards computed so far are kept whichever is taken."""
    found = [(s, s.problem()) for k, s in enumerate(plan.sources) if plan.counts["reused"][k]]
    bad = [(s, why) for s, why in found if why]
    if not bad:
        return
    config = RunConfig.from_manifest(manifest)
    given = {s.given for s, _ in bad}
    without = dataclasses.replace(config, reuse=[r for r in config.reuse if r not in given])
    which, files = ("that --reuse", "the file back as it was") if len(bad) == 1 else \
        ("those --reuse", "the files back as they were")
    # A result merged again since (a partial one completed by its own rerun, say) cannot be put back, but a new
    # run can take the rows it holds now, with this run's --reuse as it is.
    now = "" if any("is not the result this run was planned with" not in why for _, why in bad) else (
        f"; or start it again in another directory reusing {'it' if len(bad) == 1 else 'them'} as "
        f"{'it is' if len(bad) == 1 else 'they are'} now: `{config.as_command(free_out(run.root))}`")
    raise UserError(
        f"this run copies rows of {'; '.join(f'--reuse {s.given}, and {why}' for s, why in bad)}. Nothing was "
        f"merged, and the shards computed so far are kept: put {files} when the run was planned "
        f"and run `{command('rerun', run.root)}`, which computes what is left and merges; or start the run again "
        f"without {which}, in another directory: `{without.as_command(free_out(run.root))}`{now}")


def summary(counts: dict, sources: list[str], planned: bool = False) -> str:
    """'N records: C computed, D copied from an earlier record of the same sequence, R reused from X'
    (`sources`: the reused results as --reuse named them); `planned`: what a run will do ('C to compute,
    D to copy from ..., R to reuse from X'), for a run not merged yet."""
    done = ("computed", "copied", "reused") if not planned else ("to compute", "to copy", "to reuse")
    parts = [f"{counts['computed']:,} {done[0]}"]
    if counts["duplicates"]:
        parts.append(f"{counts['duplicates']:,} {done[1]} from an earlier record of the same sequence")
    for name, r in zip(sources, counts["reused"]):
        parts.append(f"{r:,} {done[2]} from {name}")
    return f"{counts['records']:,} records: " + ", ".join(parts)


def described(manifest: dict, planned: bool = False) -> str | None:
    """The summary of a run's copies as its manifest records them (None: it copies nothing)."""
    copies = manifest.get("copies")
    return summary(copies["counts"], copies["sources"], planned) if copies else None


def described_now(manifest: dict, merged: bool, durable: int) -> str | None:
    """The copies as done once the complete result is merged, else as planned with the rows the shards hold
    so far (what `status` and report.html say; None: the run copies nothing)."""
    if not merged:
        planned = described(manifest, planned=True)
        return planned and f"{planned} ({durable:,} computed and durable so far)"
    return described(manifest)


def write(path: str | os.PathLike, n: int, parts: list[index_file.Part], sources: list[SourceFile],
          counts: dict) -> None:
    """Write the plan atomically (index_file.write: temporary name, fsync, rename)."""
    header = {"kind": "copies", "sources": [vars(s) for s in sources], "counts": counts}
    index_file.write(path, VERSION, n, parts, header)
