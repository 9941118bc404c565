"""Checks of a run's input: before any model runs, duplicate ids and empty records (refused or handled by
the chosen policy), sequences over the model's length limit and the disk space the result will need;
later, whether the FASTA files changed since the run started, and the ways out when they did.

Each refusal names the file, line or id, how many there are, and the option (or command) that handles them.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from index import SequenceIndex

from ..output import status_codes
from ..config import RunConfig
from ..errors import RunDirError, UserError
from ..rundir.layout import RunDir
from ..output.schema import Schema
from ..tasks.tokenization import SequenceTokenizer

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
    groups = index.duplicate_ids()
    if groups:
        if config.on_duplicate_id == "error":
            total = sum(len(g) - 1 for g in groups)
            shown = "; ".join(f"'{index.id(g[0])}' at " + ", ".join(index.where(i) for i in g)
                              for g in groups[:MAX_LISTED])
            more = f" (and {len(groups) - MAX_LISTED:,} more ids)" if len(groups) > MAX_LISTED else ""
            raise UserError(f"{total} duplicate sequence id(s) in the input: {shown}{more}. Output rows are "
                            "keyed by id, so ids must be unique: fix the FASTA, or pass --on-duplicate-id rename "
                            "to suffix repeats ('id.dup2') and keep the original ids in the output.")
        index, originals = index.with_renamed_duplicates(groups)
        log.warning("%d duplicate id(s) renamed (e.g. %s); originals kept in `original_ids`", len(originals),
                    ", ".join(f"{v} -> {index.id(k)}" for k, v in list(originals.items())[:3]))
    empty = index.empty_records()
    if len(empty) and not config.skip_empty:
        shown = listing([where_in_input(index, int(i)) for i in empty[:MAX_LISTED]], len(empty))
        raise UserError(f"{len(empty)} record(s) have no residues: {shown}. Remove them, or pass --skip-empty "
                        f"to keep them as rows with status {status_codes.EMPTY} (empty) and no values.")
    return index


def check_long(index: SequenceIndex, tokenizer: SequenceTokenizer, limit: int | None, config: RunConfig) -> None:
    """Refuse, before any work, sequences over the model's hard limit unless a policy says what to do."""
    if config.on_long == "window":   # windows.plan fixed config.window (at most the limit)
        limit = config.window
    if not limit:
        return
    if limit <= tokenizer.num_special:
        where = "--max-length" if config.max_length == limit else "the model's length limit"
        raise UserError(f"{where} of {limit} tokens leaves no room for residues: the model adds "
                        f"{tokenizer.num_special} special token(s) to every sequence. Give a larger --max-length.")
    if int(tokenizer.tokens_for_residues(np.array([index.max_length]))[0]) <= limit:
        return   # (the longest record fits: nothing to read)
    long = index.positions_where(lambda lengths: tokenizer.tokens_for_residues(lengths) > limit)
    if len(long) and not tokenizer.char_level:  # the residue estimate is an upper bound: count exactly
        exact = tokenizer.encode([index.sequence(int(i)) for i in long])
        long = long[[len(t.ids) > limit for t in exact]]
    if len(long) == 0:
        return
    what = "the --max-length limit" if config.max_length == limit else "the model's limit"
    if config.on_long == "error":
        longest = int(long[np.argmax(index.lengths[long])])
        shown = listing([f"'{index.id(int(i))}' ({index.lengths[i]} residues)" for i in long[:MAX_LISTED]], len(long))
        raise UserError(
            f"{len(long)} sequence(s) exceed {what} of {limit} tokens ({tokenizer.num_special} of them "
            f"special), the longest '{index.id(longest)}' with {index.lengths[longest]} residues: {shown}. "
            "Choose --on-long truncate (cut to the limit; recorded in `truncated` and `num_tokens`) or "
            f"--on-long skip (kept as rows with status {status_codes.SKIPPED_TOO_LONG}).")
    if config.on_long == "window":
        log.info("%d sequence(s) are over %d tokens and run as overlapping windows of %d tokens (%d shared by "
                 "neighbours), stitched into one row each (the `windows` column counts them)", len(long), limit,
                 config.window, config.overlap)
        return
    log.warning("%d sequence(s) exceed %s of %d tokens and will be %s (--on-long %s)", len(long), what,
                limit, "truncated" if config.on_long == "truncate" else "skipped", config.on_long)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1000
    return f"{n:.1f} TB"


def estimate_result_bytes(schema: Schema, index: SequenceIndex, tokenizer: SequenceTokenizer) -> int:
    """Bytes of the merged result: fixed-width columns per row, ragged columns per residue token, ids."""
    fixed = sum(c.row_bytes() for c in schema.row_columns if c.path != "ids") * len(index)
    ids = int(index.id_offsets[-1]) + 16 * len(index)
    per_token = sum(c.row_bytes() for c in schema.ragged_columns)
    ragged = per_token * index.total_residues
    return fixed + ids + ragged + 8 * len(index) * len(schema.ragged_groups)


def check_storage(schema: Schema, index: SequenceIndex, tokenizer: SequenceTokenizer, world: int, where: Path,
                  free_bytes: int | None = None) -> str:
    """Say before any work how much disk the run needs; warn when it will not fit on the target disk.

    Shards hold the rows once, the merged result once more, and a shard being finalised briefly holds
    its checkpoints beside it: the peak is about 2 x result + 1 shard.
    """
    result = estimate_result_bytes(schema, index, tokenizer)
    peak = 2 * result + result // max(1, world)
    if free_bytes is None:
        import shutil
        free_bytes = shutil.disk_usage(where).free
    text = (f"storage estimate: result {human_bytes(result)}, about {human_bytes(peak)} on disk at the peak "
            f"(shards + merged result); {human_bytes(free_bytes)} free in {where}")
    if peak > free_bytes:
        log.warning("%s. This will NOT fit: free space, choose another --out, drop --per-residue, or use "
                    "--per-residue-dtype float16", text)
    else:
        log.info("%s", text)
    return text


def free_out(root: Path) -> str:
    """A sibling of `root` that does not exist yet (`OUT-2`, `OUT-3`, ...), for messages that suggest one."""
    k = 2
    while Path(f"{root}-{k}").exists():
        k += 1
    return f"{root}-{k}"


def start_over_advice(run: RunDir, manifest: dict) -> str:
    """Advice when a run's inputs changed: both ways out, each with a command that works."""
    config = RunConfig.from_json(json.dumps(manifest["config"]))
    return (f"Restore the original file and run `run_shards rerun {run.root}` again, or start a new run on the "
            f"file as it is now: `{config.as_command(free_out(run.root))}`.")


def load_run_index(run: RunDir, manifest: dict, refresh_copies: bool = False, verify: bool = True) -> SequenceIndex:
    """The run's index (memory-mapped), after checking that the FASTA files still match it (refusing with
    what changed). `refresh_copies` (only where no worker of the run can be reading them): decompress again
    the .gz inputs that changed, so a restored .gz lets the run continue. `verify`: read the whole file for
    its checksum first (`status` and array tasks, which read a few pages of it, do not)."""
    try:
        index = SequenceIndex.load(run.index_path, verify=verify)
    except Exception as e:
        config = RunConfig.from_json(json.dumps(manifest["config"]))
        raise RunDirError(f"{run.index_path}: the run's index is damaged ({e}); start a new run: "
                          f"`{config.as_command(free_out(run.root))}`") from None
    if refresh_copies:
        from index.compressed import refresh
        refresh([f.path for f in index.inputs])
    changed = index.records_changed()
    if not changed:   # a .gz whose decompressed copy the run reads
        from index.compressed import source_changes
        changed = "; ".join(source_changes([f.path for f in index.inputs])) or None
    if changed:
        raise UserError(f"the input FASTA no longer matches this run ({changed}). {start_over_advice(run, manifest)}")
    return index
