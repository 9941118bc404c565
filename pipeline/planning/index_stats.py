"""`run_shards index FASTA...`: build (or reuse) the index and describe it, without importing torch (the
command answers in well under a second on a cached index)."""
from __future__ import annotations

from index import load_or_build

from ..config import LISTED_SHARDS
from .input_policies import where_in_input


def index_report(fasta: list[str], workers: int, rebuild: bool = False) -> str:
    """`run_shards index`: records, residues, length percentiles, per-worker token imbalance; `rebuild`:
    index the files anew, whatever the cache holds."""
    index, reused = load_or_build(fasta, rebuild=rebuild)
    pct = index.length_percentiles((0, 10, 50, 90, 99, 100))
    stats = index.shard_stats(workers)
    lines = [
        f"index: {'reused cached' if reused else 'built'} ({len(index.inputs)} file(s))",
        f"records: {len(index):,}",
        f"residues: {index.total_residues:,}",
        "length: " + ", ".join(f"{'min' if q == 0 else 'max' if q == 100 else f'p{q}'} {v:,}" for q, v in pct.items()),
        f"stride split over {workers} worker(s): max/mean tokens {stats.imbalance:.4f}"
        + (f", sequences per worker {stats.sequences.min():,}..{stats.sequences.max():,}"
           if workers > LISTED_SHARDS else ""),
    ]
    for r in range(workers) if workers <= LISTED_SHARDS else ():   # else the line above says it
        lines.append(f"  worker {r}: {stats.sequences[r]:,} sequences, {stats.tokens[r]:,} residues")
    dups = index.duplicate_ids()
    if dups:
        lines.append(f"warning: {len(dups)} duplicate id(s), on {sum(map(len, dups))} records, e.g. "
                     f"'{index.id(dups[0][0])}'")
    empty = index.empty_records()
    if len(empty):
        lines.append(f"warning: {len(empty)} empty record(s), e.g. {where_in_input(index, int(empty[0]))}")
    return "\n".join(lines)
