"""What happens to records a model cannot take as they are, decided before any model runs: duplicate ids
and empty records (refused with the list, or handled by the chosen policy), and records too long for the
output's int32 `lengths` column. Each refusal names the file, line or id, how many there are, and the
option that handles them."""
from __future__ import annotations

import dataclasses
import logging

import numpy as np

from index import SequenceIndex

from ..config import RunConfig
from ..errors import UserError
from ..output import status_codes

log = logging.getLogger("run_shards")

MAX_LISTED = 10


def listing(items: list[str], total: int | None = None) -> str:
    """The first MAX_LISTED items, comma-separated, saying how many more there are."""
    total = len(items) if total is None else total
    shown = ", ".join(items[:MAX_LISTED])
    return shown + (f" (and {total - MAX_LISTED:,} more)" if total > MAX_LISTED else "")


def where_in_input(index: SequenceIndex, i: int) -> str:
    return f"{index.where(i)} '{index.id(i)}'"


def apply_input_policies(index: SequenceIndex, config: RunConfig) -> SequenceIndex:
    """Duplicate ids and empty records: refuse with the list, or apply the chosen policy. Records over
    2**31 - 1 residues, more than the output's int32 `lengths` column holds, are refused."""
    limit = np.iinfo(np.int32).max
    huge = index.positions_where(lambda lengths: lengths > limit) if index.max_length > limit else []
    if len(huge):
        shown = listing([f"{where_in_input(index, int(i))} ({int(index.lengths[i]):,} residues)"
                         for i in huge[:MAX_LISTED]], len(huge))
        raise UserError(f"{len(huge)} record(s) have more than 2,147,483,647 residues, more than the output's "
                        f"`lengths` column (int32) holds: {shown}. Split them into pieces, e.g. "
                        "`samtools faidx FILE ID:1-1000000000 ID:1000000001-2000000000 ...`.")
    empty = [] if config.skip_empty else index.empty_records()   # (refused: positions, which renaming keeps)
    index = _duplicate_ids(index, config, empty)
    if len(empty):
        keep = dataclasses.replace(config, skip_empty=True).as_command()
        raise UserError(f"{len(empty)} record(s) have no residues: {_where(index, empty)}. Remove them, or keep them "
                        f"as rows with status {status_codes.EMPTY} (empty) and no values (--skip-empty): `{keep}`")
    return index


def _where(index: SequenceIndex, positions) -> str:
    """The first records at `positions` by file, line and id, saying how many more there are."""
    return listing([where_in_input(index, int(i)) for i in positions[:MAX_LISTED]], len(positions))


def _duplicate_ids(index: SequenceIndex, config: RunConfig, empty) -> SequenceIndex:
    """Refuse duplicate ids (naming the empty records too, `empty`, which the run would refuse next, so that
    the command suggested handles both), or rename them."""
    groups = index.duplicate_ids()
    if not groups:
        return index
    if config.on_duplicate_id == "error":
        shown = "; ".join(f"'{index.id(g[0])}' at " + ", ".join(index.where(i) for i in g)
                          for g in groups[:MAX_LISTED])
        more = f" (and {len(groups) - MAX_LISTED:,} more ids)" if len(groups) > MAX_LISTED else ""
        also = "" if not len(empty) else (f"; {len(empty)} record(s) have no residues as well "
                                          f"({_where(index, empty)}), which --skip-empty keeps as rows with status "
                                          f"{status_codes.EMPTY} and no values")
        rename = dataclasses.replace(config, on_duplicate_id="rename", skip_empty=config.skip_empty or bool(len(empty)))
        raise UserError(f"{len(groups)} duplicate sequence id(s) in the input, on {sum(map(len, groups))} records: "
                        f"{shown}{more}. Output rows are "
                        "keyed by id, so ids must be unique: fix the FASTA, or suffix the repeats ('id.dup2'; "
                        f"the original ids kept in the output's `original_ids`) with --on-duplicate-id rename{also}: "
                        f"`{rename.as_command()}`")
    index, originals = index.with_renamed_duplicates(groups)
    log.warning("%d duplicate id(s) renamed (e.g. %s); originals kept in `original_ids`", len(originals),
                ", ".join(f"{v} -> {index.id(k)}" for k, v in list(originals.items())[:3]))
    return index
