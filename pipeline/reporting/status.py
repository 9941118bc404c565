"""`run_shards status OUT`: each shard's state and progress read from the run directory alone, whether a
command is working there now, the disk's free space, and the result.

It reads without locking, so it never gets in a running command's way. It says what it verified: finished
shards and checkpoints, the run's index and its copy plan are read back against their checksums when they are
small enough to read quickly (or with `--verify`); otherwise their states rest on their headers, and the
report says so.
"""
from __future__ import annotations

import shutil

import numpy as np
import socket

from index import SequenceIndex

from ..advice import command
from ..config import LISTED_SHARDS
from ..errors import RunDirError, UserError, human_bytes
from ..launchers.slurm_queue import Queue
from ..output import copy_plan, shard_state
from ..output.h5io import CorruptFile, Reader
from ..output.schema import Schema, ragged_total
from ..planning.copies import plan_advice, plan_problem
from ..planning.run_index import load_run_index
from ..rundir.layout import RunDir, unwritable_reason
from ..rundir.locks import RunLock, ShardLock, describe_holder
from .facts import row_status_lines
from .task_summary import task_words, variant_statuses


def status(out: str, verify: bool | None = None, every_shard: bool = False) -> str:
    """The report; `verify` None reads checksums when the shards total at most VERIFY_AUTO_BYTES.
    `every_shard` prints a row per shard however many there are."""
    run = RunDir(out)
    manifest = run.read_manifest()
    config, world = manifest["config"], manifest["world"]
    lines = [f"run: {run.root}", f"task: {task_words(run, manifest)}  model: {config['model']}  "
             f"engine: {manifest['engine']}"]
    unwritable = unwritable_reason(run.root)
    if unwritable:
        lines.append(f"NOT WRITABLE here ({unwritable}): rerun, merge and work must run where {run.root} is "
                     "mounted read-write")
    try:
        run.check_entry_kinds()
    except RunDirError as e:   # (rerun, merge and work refuse until it is moved: the commands below come after)
        lines.append(f"IN THE WAY: {e}")
    stored = shard_state.stored_bytes(run, world) + sum(_size(p) for p in (run.result_path, run.index_path,
                                                                           run.copies_path))
    auto = verify is None   # shards recorded as verified when they finished are not read again
    if verify is None:
        verify = stored <= shard_state.VERIFY_AUTO_BYTES
    try:   # mapped: status reads a few pages of it, after its checksum where it reads files back
        index = load_run_index(run, manifest, verify=verify)
    except RunDirError as e:   # missing or damaged (nothing below can be read without it)
        return "\n".join(lines + [f"index: {e}"])
    except UserError as e:
        lines.append(f"inputs: CHANGED - {e}")
        index = SequenceIndex.load(run.index_path, verify=False)
    lines.append(f"sequences: {len(index):,} in {world:,} shard(s)")
    rows_at = len(lines)   # (the line on rows copied instead of computed follows, once the shards are read)
    holder = RunLock.active_holder(run)
    if holder:
        alive = "alive" if holder.get("host") == socket.gethostname() else "another host: not checked"
        doing = ACTIVITY.get(holder.get("purpose"), "")
        lines.append(f"ACTIVE: `{holder.get('purpose')}` (pid {holder.get('pid')} on {holder.get('host')}, {alive}, "
                     f"since {holder.get('since')}) holds this run{doing}")
    states = _states(run, index, world, verify, auto)
    merged = _complete_result(run)
    _all_durable(run, states, merged)
    queue = None
    if config.get("launcher") == "slurm":
        from . import slurm_status
        queue = Queue.read(run, world)
        slurm_status.amend(states, queue)
    rows = _rows_line(run, manifest, states, merged, verify)
    if rows:
        lines.insert(rows_at, rows)
    lines += _table(run, states, every_shard or world <= LISTED_SHARDS)
    lines.append(f"checksums: every finished file read back ({human_bytes(stored)})" if verify else
                 f"checksums: NOT verified ({human_bytes(stored)} stored; states rest on file headers); "
                 f"`{command('status', run.root, '--verify')}` reads every byte")
    lines.append(_disk_line(run, manifest, index, states, merged))
    if queue is not None:
        lines += slurm_status.lines(run, states, queue, writable=not unwritable)
    lines.append(_result_line(run, config, states, holder, verify, unwritable))
    lines.append(_report_line(run, writable=not unwritable))
    return "\n".join(lines)


# What a command holding the run's lock is doing there, as `status` says it.
ACTIVITY = {"run": "; its shards are being computed or merged now", "rerun": "; its shards are being computed or "
            "merged now", "merge": "; it is merging the shards now (no shard is being computed by it)"}


def _states(run: RunDir, index: SequenceIndex, world: int, verify: bool,
            auto: bool) -> list[shard_state.ShardState]:
    """Every shard's state from its files; `running` where a worker holds the shard's lock, whatever started it
    (a local run, a scheduler's task, `work` by hand). Durable counts are the checkpointed rows. `auto`: shards
    recorded as verified when they finished are not read again."""
    sizes = index.shard_stats(world).sequences
    states = []
    for r in range(world):
        s = shard_state.inspect(run, lambda r=r: index.stride_shard(r, world), r, verify_shard=None if auto and verify
                                else verify, verify_parts=verify, count=int(sizes[r]))
        lock = ShardLock(run, r)
        if s.state not in ("complete", "corrupt") and lock.held_elsewhere():
            s.state, s.detail = "running", f"being computed by {describe_holder(lock.holder())}"
        states.append(s)
    return states


def _all_durable(run: RunDir, states: list, merged: bool) -> None:
    """Shards whose checkpoints hold every row, their worker stopped before it wrote the shard file: complete
    where the `merged` result (complete) took them from there, else said to need no compute."""
    for s in states:
        if not shard_state.every_row_durable(s.state, s.durable, s.expected):
            continue
        if merged:
            s.detail = "merged from its checkpoints" + (f"; {s.detail}" if s.detail else "")
            s.state = "complete"
        else:
            s.detail = ((f"{s.detail}; " if s.detail else "") + "every row is durable: "
                        f"`{command('rerun', run.root)}` writes its shard file without computing")


def _size(path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _rows_line(run: RunDir, manifest: dict, states: list, merged: bool, verify: bool) -> str | None:
    """Rows copied instead of computed (duplicates, --reuse), as done once the result is merged, else as
    planned with what is durable so far; and what is wrong with the copy plan (`verify`: its checksum read)."""
    if not manifest.get("copies"):
        return None
    line = f"rows: {copy_plan.described_now(manifest, merged, sum(s.durable for s in states))}"
    problem = plan_problem(run, manifest, verify=verify)
    return f"{line}; {plan_advice(run, manifest, problem)}" if problem else line


def _complete_result(run: RunDir) -> bool:
    try:
        with Reader(run.result_path) as r:
            return bool(r.attrs.get("complete"))
    except (OSError, CorruptFile):
        return False


def _table(run: RunDir, states: list, full: bool) -> list[str]:
    rows = [("shard", "state", "durable", "of", "progress", "detail")]
    for s in states:
        if full or s.state not in ("complete", "pending"):
            rows.append((str(s.rank), s.state, f"{s.durable:,}", f"{s.expected:,}",
                         f"{100.0 * s.durable / s.expected if s.expected else 100.0:.1f}%", s.detail))
    lines = []
    if not full:
        lines.append(_state_counts(states, len(rows) - 1, run))
        if len(rows) - 1 > LISTED_SHARDS:
            rows = rows[:LISTED_SHARDS + 1] + [(f"... and {len(rows) - 1 - LISTED_SHARDS:,} more", "", "",
                                                    "", "", "")]
    if len(rows) > 1:
        widths = [max(len(row[i]) for row in rows) for i in range(5)]
        lines += ["  ".join(c.ljust(w) for c, w in zip(row[:5], widths)) + "  " + row[5] for row in rows]
    return lines


def _result_line(run: RunDir, config: dict, states: list, holder: dict | None, verify: bool,
                 unwritable: str | None) -> str:
    if run.result_path.exists():
        try:
            with Reader(run.result_path) as r:
                if verify:
                    r.verify()
                complete = bool(r.attrs.get("complete"))
                variants = sum(variant_statuses(r).values()) if config["task"] == "variants" else None
                line = (f"result: {run.result_path} ({r.rows:,} rows"
                        f"{'' if variants is None else f', {variants:,} variants'}{'' if complete else ', PARTIAL'}"
                        f"{', checksums verified' if verify else ', checksums not verified'})")
            if not complete and not (holder or any(s.state == "running" for s in states)):
                line += f"; `{command('rerun', run.root)}` computes the missing rows and merges"
            return line + "".join(f"\nrows: {text}" for _, text in row_status_lines(run))
        except CorruptFile as e:   # the merge writes it anew from complete shards; else they are computed first
            again = "merge" if all(s.state == "complete" for s in states) else "rerun"
            return f"result: CORRUPT ({e}); run `{command(again, run.root)}`"
    if config.get("launcher") == "slurm":
        return "result: not merged yet"   # what comes next is the scheduler's part, said above
    where = "" if not unwritable else " where the run directory is writable"
    if holder or any(s.state == "running" for s in states):
        return "result: not merged yet"
    unfinished = [s.rank for s in states if s.state != "complete"]
    if run.settings_refused(unfinished):
        return (f"result: not merged yet; a rerun stops the same way: shard(s) {', '.join(map(str, unfinished))} "
                "refused the run's settings, and their message above says which to change")
    if unfinished:
        return (f"result: not merged yet; `{command('rerun', run.root)}`{where} computes the unfinished shards and "
                "merges")
    return f"result: not merged yet; `{command('merge', run.root)}`{where} merges"


def _report_line(run: RunDir, writable: bool = True) -> str:
    """Where the run's page is (runs write it at their end; a SLURM run's failed tasks leave none), and the
    command that writes it where the run directory can be written here."""
    import datetime
    path = run.root / "report.html"
    where = (f"`{command('report', run.root)}` writes" if writable else
             f"`{command('report', run.root)}` writes, where {run.root} is writable,")
    if not path.exists():
        return f"report: none yet; {where} {path}"
    written = datetime.datetime.fromtimestamp(path.stat().st_mtime).isoformat(sep=" ", timespec="seconds")
    return f"report: {path} (written {written}; {where} it again)"


def _state_counts(states: list, listed: int, run: RunDir) -> str:
    counts: dict[str, int] = {}
    for s in states:
        counts[s.state] = counts.get(s.state, 0) + 1
    order = ["complete", "running", "requeued", "partial", "interrupted", "failed", "corrupt", "pending"]
    text = ", ".join(f"{counts[k]:,} {k}" for k in sorted(counts, key=lambda k: (order + [k]).index(k)))
    return (f"shards: {text}. " + (f"Below: the {listed:,} not complete and not pending; "
                                   if listed else "None needs a look; ")
            + f"every shard: `{command('status', run.root, '--all')}`")


def _disk_line(run: RunDir, manifest: dict, index: SequenceIndex, states: list, merged: bool) -> str:
    """Free space beside what the unfinished shards and the merge still need (a full disk stops a run even
    where it could not record why)."""
    if merged:   # (its shards may be deleted: they are pending then, but nothing is left to do)
        return f"disk: {human_bytes(shutil.disk_usage(run.root).free)} free in {run.root}; the run is finished"
    schema = Schema.from_json(manifest["schema"])
    left = 0
    residues = index.shard_stats(manifest["world"]).tokens   # from the index's length histogram
    config = manifest["config"]
    empty, one = (int(b) for b in schema.row_bytes(np.array([0, 1])))   # a row's bytes: empty + per value
    fixed, per_value = empty, one - empty
    for s in states:
        if s.state != "complete":
            share = 1 - s.durable / max(1, s.expected)
            values = ragged_total(config.get("task", "embed"), config.get("max_new_tokens", 0), s.expected,
                                  int(residues[s.rank]))
            left += int(share * (fixed * s.expected + per_value * values))
    # The shard, then the result (the merge), which copies every shard's rows; a partial result.h5 is
    # replaced only once the new one is written beside it, so it frees nothing before then.
    need = left * 2 + sum(p.stat().st_size for p in run.shards_dir.glob("shard_*.h5"))
    free = shutil.disk_usage(run.root).free
    text = f"disk: {human_bytes(free)} free in {run.root}; finishing needs about {human_bytes(need)} more"
    if need > free:
        text += (" - NOT ENOUGH: free space (or move the run to a larger disk), then "
                 f"`{command('rerun', run.root)}`")
    return text
