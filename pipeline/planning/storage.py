"""The disk a run will need, said before any work, with a warning when it will not fit."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

from index import SequenceIndex

from ..errors import human_bytes
from ..output.schema import Schema, ragged_values

log = logging.getLogger("run_shards")


def check_storage(schema: Schema, index: SequenceIndex, world: int, where: Path, task: str = "embed",
                  max_new_tokens: int = 0, free_bytes: int | None = None) -> str:
    """Log the estimate, as a warning when it will not fit on the disk holding `where`; returns its text.

    Shards hold the rows once, the merged result once more, and a shard being finalised briefly holds
    its checkpoints beside it: the peak is about 2 x result + 1 shard. Per-residue values are counted per
    residue, which they are for every tokenizer (tasks/residue_spans.py); a truncated record has fewer. A
    generate run's rows are counted at `max_new_tokens` new tokens each (ragged_values), their text apart.
    """
    values = ragged_values(task, max_new_tokens, index.length_values)
    result = int((schema.row_bytes(values) * index.length_counts).sum()) + int(index.id_offsets[-1])
    peak = 2 * result + result // max(1, world)
    if free_bytes is None:
        disk = next(p for p in (where, *where.parents) if p.exists())   # `where` may not be created yet
        free_bytes = shutil.disk_usage(disk).free
    bound = f" (every row to --max-new-tokens {max_new_tokens:,}, the text apart)" if task == "generate" else ""
    text = (f"storage estimate: result {human_bytes(result)}{bound}, about {human_bytes(peak)} on disk at the peak "
            f"(shards + merged result); {human_bytes(free_bytes)} free in {where}")
    if peak > free_bytes:
        fewer = "a lower --max-new-tokens" if task == "generate" else \
            "drop --per-residue, or use --per-residue-dtype float16"
        log.warning("%s. This will NOT fit: free space, choose another --out, or %s", text, fewer)
    else:
        log.info("%s", text)
    return text
